"""argparse types shared by the subcommands: each turns a bad value into a usage error (exit 2)."""

import argparse

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
