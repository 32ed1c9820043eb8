"""Parsing and printing memory sizes. Decimal units are powers of 10 (8GB = 8e9), binary ones of 2."""

import math
import re

from autoplan.errors import UsageError

__all__ = ["ACCEPTED_FORMS", "check_mem_limit", "format_bytes", "parse_mem_bytes"]

_UNIT_BYTES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
ACCEPTED_FORMS = "a positive size such as 8GB (10^9 bytes), 8GiB (2^30 bytes), 8000MB or 8e9 (bytes)"


def parse_mem_bytes(text: str | int | float) -> int:
    """'8GB' -> 8_000_000_000; '8GiB' -> 8*2**30; '8e9' -> 8_000_000_000. Raises UsageError otherwise."""
    if isinstance(text, bool):
        raise UsageError(f"memory limit {text!r} is not a size: give {ACCEPTED_FORMS}")
    if isinstance(text, int):  # exact, however large (float() of a huge int would overflow)
        if text < 1:
            raise UsageError(f"memory limit {text!r} must be positive: give {ACCEPTED_FORMS}")
        return text
    if isinstance(text, float):
        value, unit = text, ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match or match.group(2).lower() not in _UNIT_BYTES:
            raise UsageError(f"memory limit {text!r} is not a size: give {ACCEPTED_FORMS}")
        value, unit = float(match.group(1)), match.group(2).lower()
    mem_bytes = value * _UNIT_BYTES[unit]
    if math.isnan(mem_bytes):
        raise UsageError(f"memory limit {text!r} is not a number: give {ACCEPTED_FORMS}")
    if mem_bytes <= 0:
        raise UsageError(f"memory limit {text!r} must be positive: give {ACCEPTED_FORMS}")
    if math.isinf(mem_bytes):  # 1e400 overflows a float
        raise UsageError(f"memory limit {text!r} is too large (it is not a finite number of bytes): give {ACCEPTED_FORMS}")
    if mem_bytes < 1:
        raise UsageError(f"memory limit {text!r} is less than one byte: give {ACCEPTED_FORMS}")
    return int(mem_bytes)


def format_bytes(num_bytes: float) -> str:
    """Decimal units, to match how limits are usually written (8GB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def check_mem_limit(mem_limit_bytes: int, device_mem_bytes: int, profile: str, allowed: bool,
                    source: str = "`mem`") -> None:
    """UsageError for a limit above the device's memory (a plan to it could not run), unless `allowed`."""
    if mem_limit_bytes > device_mem_bytes and not allowed:
        raise UsageError(f"{source} {format_bytes(mem_limit_bytes)} is more than the {format_bytes(device_mem_bytes)} "
                         f"of memory a device of profile {profile} has, so a plan to it could not run there. Give "
                         f"`mem` at most {format_bytes(device_mem_bytes)}, the `profile` of the device you will run "
                         "on, or `allow_over_device_mem` to plan above the device's memory anyway")
