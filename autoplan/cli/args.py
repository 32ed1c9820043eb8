"""argparse types shared by the subcommands: each turns a bad value into a usage error (exit 2); and
`user_prints_to_stderr`, which keeps a --json output clean of what the user's code prints."""

import argparse
import contextlib
import sys
from collections.abc import Iterator

from autoplan.errors import UsageError
from autoplan.sizes import parse_mem_bytes


def mem_arg(text: str) -> int:
    try:
        return parse_mem_bytes(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


@contextlib.contextmanager
def user_prints_to_stderr(active: bool = True) -> Iterator:
    """While `active` (a --json command doing its work), what the user's code prints (a factory, a model's
    forward, a transformers warning on stdout) goes to stderr, so stdout holds the JSON alone. Yields the
    stream the JSON goes to."""
    stdout = sys.stdout
    if not active:
        yield stdout
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield stdout
