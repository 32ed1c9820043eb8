"""The `autoplan` command: argparse subcommands, one module each; work is done by library functions.

Library errors name API parameters in backticks; here they are shown as the subcommand's flags, and
each error class maps to its exit code (usage 2, no plan fits 3).

Only the subcommand that runs is imported: a subcommand module pulls in torch, pydantic or the
solver, and `autoplan --help` should answer at once. The list below carries each subcommand's
one-line help for the overview (tests/test_trace_reuse.py checks it against the modules' own).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys

from autoplan.api.heap import young_collections_only
from autoplan.errors import AutoplanError

__all__ = ["COMMANDS", "QUICK_EXIT", "build_parser", "main"]

# subcommand -> (module that registers it, its one-line help), in the order `--help` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "search": ("autoplan.cli.search", "find the fastest sharding plan that fits a memory limit"),
    "models": ("autoplan.cli.models", "list the model zoo with parameter counts"),
    "profile": ("autoplan.cli.profile", "measure this machine's ops and collectives into a device profile"),
    "profiles": ("autoplan.cli.profiles", "list the shipped and local device profiles and their figures' sources"),
    "estimate": ("autoplan.cli.estimate", "per-GPU peak memory and step time of a fixed sharding strategy or a plan"),
    "apply": ("autoplan.cli.apply", "run a plan as a measured training run (torchrun + FSDP2)"),
    "explain": ("autoplan.cli.explain",
                "why a plan chose each option: time and memory of the alternatives, where the limit binds"),
    "diff": ("autoplan.cli.diff",
             "the units two plans decide differently, with each difference's step-time and memory change"),
}


def _command_in(argv: list[str]) -> str | None:
    """The subcommand `argv` names (the top-level parser has no options but --help)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with `command`, only the module of that subcommand is imported
    and registered, the others are listed by name and help (enough for `--help` and a misspelling)."""
    parser = argparse.ArgumentParser(
        prog="autoplan", description="Cost-model-driven FSDP2 sharding planner for PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = COMMANDS[command][0] if command in COMMANDS else None
    registered: set[str] = set()
    for name, (module, help_text) in COMMANDS.items():
        if command is None or module == wanted:
            if module not in registered:  # one module may register several subcommands (profile, profiles)
                registered.add(module)
                importlib.import_module(module).register(subparsers)
        else:
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command in `argv` (default: the process's arguments) and return its exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    # the process's own command that ends it: without CPython's full collections from its start (autoplan.api.heap;
    # the API's calls have them off already), its imports (torch's) and what follows the API's call included
    with young_collections_only() if argv is None and _command_in(args) in QUICK_EXIT else contextlib.nullcontext():
        code, command = _run(args)
        if argv is None and command in QUICK_EXIT and "coverage" not in sys.modules:
            _exit_now(code)
    return code


# Commands whose work is over when their handler returns. As the process's own command they exit without
# the interpreter's teardown: once torch is imported, freeing its modules at exit takes 0.6 s here, a
# fifth of a search. Nothing of theirs waits for exit (files are written and closed, no child processes);
# `apply` and `profile` run other processes and exit normally.
QUICK_EXIT = frozenset({"search", "estimate", "models", "profiles", "explain", "diff"})


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the command is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def _signals():
    """While a command runs: SIGTERM and SIGHUP stop it as Ctrl-C does (the exception unwinds, so a file being
    written is removed, not left half-written or as a temporary; exit 128 + the signal's number), where they
    would have ended the process on the spot; and a command a non-interactive shell starts in the background
    (`autoplan profile &` in a script), which inherits SIGINT ignored, takes `kill -INT` as Ctrl-C (it did
    nothing), its child processes then starting with SIGINT's default. A command that handles a signal itself
    (apply forwards them to its ranks) sets its own handler meanwhile. The previous handlers come back after."""
    previous = {}
    try:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _raise_stopped)
    except ValueError:  # not the main thread (main() called from a thread): signals are not ours to set
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(argv: list[str]) -> tuple[int, str]:
    with _signals():
        parser = build_parser(_command_in(argv) or "")
        args = parser.parse_args(argv)
        try:
            return args.handler(args), args.command
        except AutoplanError as exc:
            from autoplan.cli.flags import to_flags

            print(f"autoplan {args.command}: error: {to_flags(str(exc), args.subparser)}", file=sys.stderr)
            return exc.exit_code, args.command
        except BrokenPipeError:  # output piped into `head` and closed early
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stays open: the process is ending
            return 0, args.command
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            print("interrupted" + (f" by {signal.Signals(signum).name}" if signum != signal.SIGINT else ""),
                  file=sys.stderr)
            return 128 + int(signum), args.command


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader that went away, a closed stream
            pass
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
