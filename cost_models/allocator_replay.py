"""A recorded allocation sequence run through the caching allocator's model: its peaks, and the smallest limit it
runs in, and where a limit just under that fails, what the cache holds that no request could use (`stranded`). The sequence is rank 0's step as autoplan.run.allocator_fit records it (fake tensors, FSDP2's streams
tagged); the allocator is the native one (cost_models.allocator) or the one with expandable segments
(cost_models.expandable_segments)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.allocator import ROUND_LARGE, CachingAllocator, OutOfMemory
from cost_models.expandable_segments import ExpandableAllocator

__all__ = ["ReplayResult", "Stranded", "min_limit", "replay", "stranded"]


@dataclass
class ReplayResult:
    peak_requested: int  # the live bytes as requested (what max_memory_allocated would be without rounding)
    peak_allocated: int  # torch.cuda.max_memory_allocated: rounded blocks
    peak_reserved: int  # torch.cuda.max_memory_reserved
    segments: int  # segments held at the end
    retries: int  # times the limit made the allocator free its cache (num_alloc_retries)


@dataclass
class Stranded:
    """The cache at the request a limit could not serve: the free bytes that segments holding a live block keep
    (the cache was emptied of every other segment first), by segment size. Bytes."""

    event: int  # the index of the failing allocation in the sequence
    request: int  # its bytes
    stream: int
    reserved: int
    allocated: int  # blocks, rounded
    by_segment: dict[int, int]  # segment size -> free bytes inside segments of that size that hold a live block

    @property
    def total(self) -> int:
        return sum(self.by_segment.values())


def replay(events, limit: int | None = None, max_split_size: int | None = None,
           expandable: bool = False) -> ReplayResult:
    """Run `events` through the allocator: ("alloc", key, nbytes, stream) or ("free", key) each; a key
    names one allocation until it is freed. Raises OutOfMemory when the sequence does not fit `limit`.
    `expandable`: with expandable segments (cost_models.expandable_segments; max_split_size does not apply)."""
    allocator = ExpandableAllocator(limit) if expandable else CachingAllocator(limit, max_split_size)
    _run(allocator, events)
    return ReplayResult(allocator.peak_requested, allocator.peak_allocated, allocator.peak_reserved,
                        allocator.segments, allocator.retries)


def stranded(events, limit: int) -> Stranded | None:
    """Where the native allocator first runs out under `limit`: what it holds there beyond the allocated blocks,
    free space inside segments a live block keeps (None where the sequence runs). With `limit` just under
    `min_limit(events)`, this is the memory a step needs beyond its live bytes, by the segment size it sits in."""
    allocator, live = CachingAllocator(limit), {}
    try:
        _run(allocator, events, live)
        return None
    except OutOfMemory as exc:
        index, request, stream = exc.event
    segments: dict[int, list] = {}  # first block's address -> the segment's blocks
    for block in [*live.values(), *allocator._by_key.values()]:
        head = block
        while head.prev is not None:
            head = head.prev
        segments.setdefault(head.addr, []).append(block)
    by_segment: dict[int, int] = {}
    for blocks in segments.values():
        free = sum(b.size for b in blocks if not b.allocated)
        if free and len(blocks) > 1:
            size = sum(b.size for b in blocks)
            by_segment[size] = by_segment.get(size, 0) + free
    return Stranded(index, request, stream, allocator.reserved, allocator.allocated, by_segment)


def _run(allocator, events, live: dict | None = None) -> None:
    """`events` through `allocator`; an OutOfMemory carries the failing event as (index, bytes, stream)."""
    live = {} if live is None else live
    for index, event in enumerate(events):
        if event[0] == "alloc":
            _, key, nbytes, stream = event
            if key in live:
                raise ValueError(f"allocation {key!r} made twice without a free")
            try:
                live[key] = allocator.malloc(nbytes, stream)
            except OutOfMemory as exc:
                exc.event = (index, nbytes, stream)
                raise
        elif event[0] == "free":
            block = live.pop(event[1], None)
            if block is None:
                raise ValueError(f"allocation {event[1]!r} freed but never made (or freed twice)")
            allocator.free(block)
        else:
            raise ValueError(f"unknown event {event[0]!r}: expected 'alloc' or 'free'")


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
