"""What one search computes again and again, computed once while it runs.

A search builds a cost table per mesh, micro-batch and (pipelined) kind of stage, and many of them read the same
things: the same repeated block priced on the same profile, mesh and training (cost_models.unit_prices), the same
ops transformed for the same tensor-parallel layout, the same split backward's bytes. `memo` keeps such a result
under a key naming everything it reads, and only inside `search_scope()` (autoplan.search enters it around a
search): outside, every call computes afresh. So nothing outlives the search that made it (no model, trace or
profile kept alive after it), and no result is read by a later search in the same process (a test session, a
notebook that changes a profile between two searches).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["memo", "search_scope", "searching"]

T = TypeVar("T")
# the searches running in this process, innermost last: each one's results by key (and what the key names by id)
_SEARCHES: list[dict[tuple, tuple]] = []


@contextmanager
def search_scope():
    """While inside, `memo` keeps what it computes (for this scope only: a nested search starts empty)."""
    _SEARCHES.append({})
    try:
        yield
    finally:
        _SEARCHES.pop()


def memo(key: tuple, make: Callable[[], T], held: tuple = ()) -> T:
    """make(), kept under `key` while a search runs (made afresh outside one). The key must name everything the
    result reads; an object it names by id() must be in `held`, kept alive with the result so that its id stays
    its own."""
    if not _SEARCHES:
        return make()
    cache = _SEARCHES[-1]
    found = cache.get(key)
    if found is None:
        found = cache[key] = (make(), held)
    return found[0]


def searching() -> bool:
    """Whether a search is running (where what `memo` keeps is shared)."""
    return bool(_SEARCHES)
