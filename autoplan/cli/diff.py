"""`autoplan diff`: the units two plans of one model decide differently, and what each difference costs."""

from __future__ import annotations

import argparse

__all__ = ["register"]

EXAMPLES = """examples:
  autoplan diff free.json pinned.json
  autoplan diff a.json b.json --json
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "diff", help="the units two plans decide differently, with each difference's step-time and memory change",
        description="List the units whose decisions differ between plan A and plan B (of one model), and for each "
                    "group of them the predicted change in step time and peak memory when A takes B's decision "
                    "there alone (on A's settings); then all differences together, and the settings that differ.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", help="plan A (the reference)")
    parser.add_argument("b", help="plan B")
    parser.add_argument("--model", help="the model, for plans made from a factory (package.module:factory)")
    parser.add_argument("--json", action="store_true", help="print the differences as JSON")
    parser.set_defaults(handler=_run, subparser=parser)


def _run(args) -> int:
    from autoplan.api.inspect import diff
    from autoplan.cli.args import user_prints_to_stderr

    with user_prints_to_stderr(args.json) as stdout:
        result = diff(args.a, args.b, args.model)
    stdout.write(result.model_dump_json(indent=2) + "\n" if args.json else result.table() + "\n")
    return 0
