"""A recorded allocation sequence run through the caching allocator's model: its peaks, and the smallest limit it
runs in. The sequence is rank 0's step as autoplan.run.allocator_fit records it (fake tensors, FSDP2's streams
tagged); the allocator is the native one (cost_models.allocator) or the one with expandable segments
(cost_models.expandable_segments)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.allocator import ROUND_LARGE, CachingAllocator, OutOfMemory
from cost_models.expandable_segments import ExpandableAllocator

__all__ = ["ReplayResult", "min_limit", "replay"]


@dataclass
class ReplayResult:
    peak_requested: int  # the live bytes as requested (what max_memory_allocated would be without rounding)
    peak_allocated: int  # torch.cuda.max_memory_allocated: rounded blocks
    peak_reserved: int  # torch.cuda.max_memory_reserved
    segments: int  # segments held at the end
    retries: int  # times the limit made the allocator free its cache (num_alloc_retries)


def replay(events, limit: int | None = None, max_split_size: int | None = None,
           expandable: bool = False) -> ReplayResult:
    """Run `events` through the allocator: ("alloc", key, nbytes, stream) or ("free", key) each; a key
    names one allocation until it is freed. Raises OutOfMemory when the sequence does not fit `limit`.
    `expandable`: with expandable segments (cost_models.expandable_segments; max_split_size does not apply)."""
    allocator = ExpandableAllocator(limit) if expandable else CachingAllocator(limit, max_split_size)
    live: dict = {}
    for event in events:
        if event[0] == "alloc":
            _, key, nbytes, stream = event
            if key in live:
                raise ValueError(f"allocation {key!r} made twice without a free")
            live[key] = allocator.malloc(nbytes, stream)
        elif event[0] == "free":
            block = live.pop(event[1], None)
            if block is None:
                raise ValueError(f"allocation {event[1]!r} freed but never made (or freed twice)")
            allocator.free(block)
        else:
            raise ValueError(f"unknown event {event[0]!r}: expected 'alloc' or 'free'")
    return ReplayResult(allocator.peak_requested, allocator.peak_allocated, allocator.peak_reserved,
                        allocator.segments, allocator.retries)


def min_limit(events, max_split_size: int | None = None, step: int = ROUND_LARGE, expandable: bool = False) -> int:
    """The smallest limit (to `step` bytes) that `events` run in without OutOfMemory: between the rounded
    allocated peak and the reserved peak without a limit (the allocator frees its cache under pressure).
    `expandable`: with expandable segments."""
    events = list(events)
    free_run = replay(events, None, max_split_size, expandable)
    low = math.ceil(free_run.peak_allocated / step) - 1  # below the allocated peak: fails
    high = math.ceil(free_run.peak_reserved / step)  # the limit is never reached: runs
    while high - low > 1:
        middle = (low + high) // 2
        try:
            replay(events, middle * step, max_split_size, expandable)
            high = middle
        except OutOfMemory:
            low = middle
    return high * step
