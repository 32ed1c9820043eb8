from autoplan.cli.main import main

raise SystemExit(main())
