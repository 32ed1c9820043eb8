"""`autoplan explain`: why a plan chose what it chose, group by group, and where the memory limit binds."""

from __future__ import annotations

import argparse

__all__ = ["register"]

EXAMPLES = """examples:
  autoplan explain plan.json
  autoplan explain plan.json --json
  autoplan explain plan.json --model mypkg.models:build     # a plan made from a factory
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "explain", help="why a plan chose each option: time and memory of the alternatives, where the limit binds",
        description="Rebuild the plan's cost table from the plan file and, per group of alike units, predict the "
                    "step time and peak memory with the group under each of its options (the rest of the plan "
                    "kept), whether that fits the plan's limit, and at which point of the step's memory timeline "
                    "the limit binds.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan", help="a plan file from `autoplan search`")
    parser.add_argument("--model", help="the model, for a plan made from a factory (package.module:factory)")
    parser.add_argument("--json", action="store_true", help="print the explanation as JSON")
    parser.set_defaults(handler=_run, subparser=parser)


def _run(args) -> int:
    from autoplan.api.inspect import explain
    from autoplan.cli.args import user_prints_to_stderr

    with user_prints_to_stderr(args.json) as stdout:
        result = explain(args.plan, args.model)
    stdout.write(result.model_dump_json(indent=2) + "\n" if args.json else result.table() + "\n")
    return 0
