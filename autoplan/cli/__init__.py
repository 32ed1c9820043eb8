"""The `autoplan` command: one module per subcommand; `main` parses and maps errors to exit codes."""
