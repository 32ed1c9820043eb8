"""`autoplan search`: the fastest plan that fits a memory limit, written to a file and printed."""

from __future__ import annotations

import argparse
import sys
import time

from autoplan.cli.flags import add_settings_flags, settings_fields, to_flags

__all__ = ["register"]

EXAMPLES = """examples:
  autoplan search --model gpt2-1.5b --mem 8GB
  autoplan search --model llama2-70b --mem 80GB --nodes 8 --gpus-per-node 8 --profile h100-sxm-80gb
  autoplan search --model gpt2 --mem 2GB --gpus 2 --seq-len 128 --global-batch 64 -o plan.json
  autoplan search --model mypkg.models:build --seq-len 2048 --mem 40GiB --json
"""


def register(subparsers) -> None:
    from autoplan.settings import SearchSettings

    parser = subparsers.add_parser(
        "search", help="find the fastest sharding plan that fits a memory limit",
        description="Trace the model, cost every unit's options and pick, with CP-SAT, the fastest plan "
                    "whose predicted per-GPU peak memory fits --mem. Writes the plan (JSON) and prints it.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(parser, SearchSettings)
    parser.add_argument("-o", "--out", default="plan.json", help="plan file to write (default plan.json)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    parser.set_defaults(handler=_run, subparser=parser)


def _run(args) -> int:
    from autoplan.api.search import search
    from autoplan.plan.report import format_plan
    from autoplan.settings import SearchSettings

    start = time.perf_counter()
    settings = SearchSettings.create(**settings_fields(SearchSettings, args))
    plan = search(settings=settings)
    plan.save(args.out)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        print(to_flags(format_plan(plan, cluster_is_default=settings.cluster_is_default), args.subparser))
        print(f"plan written to {args.out} ({time.perf_counter() - start:.1f} s)")
    return 0
