"""Defaults and choices shared by the Python API and the command line."""

from __future__ import annotations

from autoplan.errors import UsageError
from cost_models.precision import OPTIMIZER_STATES, PRECISIONS

DEFAULT_MODEL = "gpt2-1.5b"
DEFAULT_PROFILE = "a100-sxm4-80gb"
# plans are made to this fraction below the limit: predicted peaks land within ~1% of measured ones in a
# typical step (see benchmarks/RESULTS.md), and now and then a buffer freed late by another thread
# (gloo's) lifts a step's peak by up to ~2% more
DEFAULT_HEADROOM = 0.02
MAX_HEADROOM = 0.5
DTYPES = tuple(PRECISIONS)
OPTIMIZERS = tuple(OPTIMIZER_STATES)


def check_choice(param: str, value: str, choices) -> None:
    """UsageError naming the parameter, the bad value and the accepted ones."""
    if value not in choices:
        raise UsageError(f"unknown `{param}` {value!r}; choose one of {', '.join(choices)}")
