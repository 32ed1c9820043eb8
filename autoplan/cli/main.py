"""The `autoplan` command: argparse subcommands, one module each; work is done by library functions.

Library errors name API parameters in backticks; here they are shown as the subcommand's flags, and
each error class maps to its exit code (usage 2, no plan fits 3).
"""

from __future__ import annotations

import argparse
import os
import sys

from autoplan.cli import apply, estimate, models, profile, search
from autoplan.cli.flags import to_flags
from autoplan.errors import AutoplanError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan", description="Cost-model-driven FSDP2 sharding planner for PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in (search, models, profile, estimate, apply):
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except AutoplanError as exc:
        print(f"autoplan {args.command}: error: {to_flags(str(exc), args.subparser)}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
