"""Planning without CPython's full garbage collections.

A search builds millions of objects that live until it returns (a 3000-layer stack: two traces of 132,009 op
records, the ops at each micro-batch, the cost tables, the timelines: 5 million tracked objects) and frees few
reference cycles. CPython runs a full collection each time the objects that survived the young generations grow
by a quarter, and each one rescans all of them: 20 full collections took 13 of that search's 50 CPU seconds, and
found nothing to free (the search's peak RSS is the same without them). Inside `young_collections_only` the young
generations are collected as before (a cycle that dies young, as tracing's do, is freed as usual) and the oldest
is left alone; what survives into it is collected by the first full collection after the call returns, when the
thresholds are restored.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["young_collections_only"]

# gc's third threshold: full collections once the middle generation has been collected this many times
# (CPython also waits for the old objects to grow by a quarter); as good as never within one call
_NEVER = 1_000_000_000


@contextlib.contextmanager
def young_collections_only() -> Iterator[None]:
    """No automatic full collection inside (see the module docstring); the thresholds are restored on exit, and a
    nested use leaves them to the outer one."""
    before = gc.get_threshold()
    if len(before) < 3 or before[2] >= _NEVER:  # already inside, or a collector without a third generation
        yield
        return
    gc.set_threshold(before[0], before[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*before)

