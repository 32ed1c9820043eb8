"""A recorded allocation sequence run through the caching allocator's model: its peaks, and the smallest limit it
runs in (and every limit a little above it: natively a step can fail under a limit above one it runs in), and where
a limit just under that fails, what the cache holds that no request could use (`stranded`).
The sequence is rank 0's step as autoplan.run.allocator_fit records it (fake tensors, FSDP2's streams tagged); the
allocator is the native one (cost_models.allocator) or the one with expandable segments
(cost_models.expandable_segments)."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from cost_models.allocator import LARGE_BUFFER, MIN_BLOCK, ROUND_LARGE, CachingAllocator, OutOfMemory
from cost_models.expandable_segments import ExpandableAllocator
from cost_models.steady_steps import Steps

__all__ = ["ABOVE", "ABOVE_STEP", "GPU_REPLAY_ERROR", "ReplayResult", "Stranded", "min_limit", "replay", "replay_room",
           "run_and_min_limit", "stranded"]

# What a GPU needed beyond a replay's figure (the smallest limit plus cost_models.allocator.SEGMENT_SLACK), by
# configuration (expandable segments or not): on one H200 (torch 2.11, CUDA 13; benchmarks/gpu_min_limit.py, the GPU
# kit's 27 plans of 1-8B models, each capped at the replay's figure and 1% steps from it) every step ran capped at
# 1.01 x its replay's figure with expandable segments and at 1.02 x natively, and 33 of the 54 failed capped at the
# figure itself: with expandable segments the GPU's need lies within 1% of it either side, natively from 2% below to
# 2% above (more than 1% above in two: the order in which blocks free on the GPU's streams moves what the cache
# strands). A replay's figure is fitted to the limit less this share (benchmarks/RESULTS.md section 9).
GPU_REPLAY_ERROR = {True: 0.01, False: 0.02}
# Whether a step runs is not monotone in the limit natively: a limit that makes the allocator free its cache at
# another moment leaves other blocks in other segments, and a limit above one the step runs in can fail (the held-out
# llama-1b at 10GB runs capped at 8.59 GiB by replay and fails at caps from 8.65 to 8.87; benchmarks/RESULTS.md
# section 11b). The smallest limit is the one from which every limit on a grid of ABOVE_STEP of it runs, up to
# ABOVE above it (where a bisection ends, raised past the last that fails, and bisected again there).
ABOVE, ABOVE_STEP = 0.06, 0.0025


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


def replay_room(limit: int, expandable: bool) -> int:
    """The most a replay's figure may be for the step to run under `limit` on a GPU: the limit less the replay's
    measured error (GPU_REPLAY_ERROR)."""
    return math.floor(limit / (1 + GPU_REPLAY_ERROR[expandable]))


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


def _run(allocator, events, live: dict | None = None, start: int = 0, stop: int | None = None,
         fork_for: float | None = None, settle: Steps | None = None) -> tuple[tuple | None, list[tuple[int, int]]]:
    """`events[start:stop]` through `allocator`; an OutOfMemory carries the failing event as (index, bytes,
    stream). Returns a fork and where the allocator's demand grew: (index, demand after it) each time.

    `fork_for`: a limit L; the fork is taken before the last allocation that may, as far as can be told before it,
    be the first to compare more than L with a limit: one the cache does not serve, whose request could take the
    reserved bytes past L (within a segment's 20 MiB and the rounding), while all compared so far (the allocator's
    `demand`) is at most L. The fork: that allocation's index, the demand then, and forks of the allocator and of
    `live`; None where no allocation is such (or without `fork_for`).

    `settle`: the events' steps (cost_models.steady_steps.Steps, `events` its events): the run ends at the start of
    a repeated step where the allocator's layout is one it had at the start of an earlier repeated step: the steps
    between go round again from there, and passed once (under a limit the cache emptied in the same places each
    time, the layouts can repeat every second or third step)."""
    live = {} if live is None else live
    found, near = None, None if fork_for is None else fork_for - LARGE_BUFFER - MIN_BLOCK
    grew, demand = [], allocator.demand
    checks, layouts = ({} if settle is None else settle.checks()), set()
    for index in range(start, len(events) if stop is None else stop):
        if index in checks:
            step = checks[index]
            layout = allocator.layout(live, lambda key: settle.role(key, step))
            if layout in layouts:
                break
            layouts.add(layout)
        event = events[index]
        if event[0] == "alloc":
            _, key, nbytes, stream = event
            if key in live:
                raise ValueError(f"allocation {key!r} made twice without a free")
            if near is not None and allocator.reserved + nbytes > near and not allocator.cache_serves(nbytes, stream):
                if allocator.demand > fork_for:  # from here on a run under the limit may go otherwise
                    near = None
                else:
                    found = (index, allocator.demand, *allocator.fork(live))
            try:
                live[key] = allocator.malloc(nbytes, stream)
            except OutOfMemory as exc:
                exc.event = (index, nbytes, stream)
                raise
            if allocator.demand > demand:
                demand = allocator.demand
                grew.append((index, demand))
        elif event[0] == "free":
            block = live.pop(event[1], None)
            if block is None:
                raise ValueError(f"allocation {event[1]!r} freed but never made (or freed twice)")
            allocator.free(block)
        else:
            raise ValueError(f"unknown event {event[0]!r}: expected 'alloc' or 'free'")
    return found, grew


def min_limit(events, max_split_size: int | None = None, step: int = ROUND_LARGE, expandable: bool = False) -> int:
    """The smallest limit (to `step` bytes) that `events` run in without OutOfMemory, and every limit above it on
    a grid (run_and_min_limit): between the rounded allocated peak and the reserved peak without a limit (the
    allocator frees its cache under pressure).
    `expandable`: with expandable segments."""
    return run_and_min_limit(events, max_split_size, step, expandable)[1]


def run_and_min_limit(events, max_split_size: int | None = None, step: int = ROUND_LARGE, expandable: bool = False,
                      above: float = ABOVE, settle: Steps | None = None) -> tuple[ReplayResult, int]:
    """`replay(events)` without a limit and `min_limit(events)`, from one run without a limit.

    The limit is bisected between the allocated peak and the reserved peak of the run without one. A limit is not
    monotone in whether the events run (the cache freed earlier or later leaves other blocks), so where the
    bisection ends a grid above it is tried (ABOVE_STEP of it, up to ABOVE above), and the bisection goes on above
    the last that fails until none does: the answer is a limit from which every limit of that grid runs. Each try
    is cheaper than a run from the start: a run under a limit goes exactly as the run without one until a request
    compares more than the limit with it (the allocator's `demand`), so a try whose limit is at least the demand
    before some event goes on from a fork of the run without a limit taken there; a try that would compare nothing
    more than its limit runs as the run without one did. The run without a limit forks before the last allocation
    that could compare more than the lowest limit tried (which the peak of the live bytes bounds from below). A try
    whose first comparison above its limit lies more events past the latest fork it can use than that fork holds
    blocks goes on from a copy of the fork carried there without a limit, kept for the tries after it (long
    sequences: a recorded step). `above`: how far above the grid goes (0: the bisection's answer alone). `settle`:
    the events' repeated steps (cost_models.steady_steps): each run ends where the allocator has settled (`_run`)."""
    events = list(events)
    new = (lambda limit: ExpandableAllocator(limit)) if expandable else (
        lambda limit: CachingAllocator(limit, max_split_size))
    free, lowest = new(None), _live_peak(events)
    fork, grew = _run(free, events, {}, 0, None, None if lowest is None else math.ceil(lowest / step) * step, settle)
    free_run = ReplayResult(free.peak_requested, free.peak_allocated, free.peak_reserved, free.segments, free.retries)
    forks, demands = [] if fork is None else [fork], [demand for _, demand in grew]

    def runs(limit: int) -> bool:
        first = bisect_right(demands, limit)  # the first event where the run compares more than the limit
        if first == len(grew):
            return True  # none: it runs as the run without a limit did
        until = grew[first][0]
        base = max((f for f in forks if f[0] <= until and f[1] <= limit), key=lambda f: f[0], default=None)
        if base is None:
            start, allocator, live = 0, new(limit), {}
        else:
            if until - base[0] > len(base[3]) + len(base[2]._by_key):  # more events than blocks to copy
                allocator, live = base[2].fork(base[3])
                _run(allocator, events, live, base[0], until)
                base = (until, allocator.demand, allocator, live)
                forks.append(base)
            start, allocator, live = base[0], *base[2].fork(base[3])
            allocator.limit = limit
        try:
            _run(allocator, events, live, start, settle=settle)
            return True
        except OutOfMemory:
            return False

    low = math.ceil(free_run.peak_allocated / step) - 1  # below the allocated peak: fails
    top = high = math.ceil(free_run.peak_reserved / step)  # the limit is never reached: runs
    while True:
        while high - low > 1:
            middle = (low + high) // 2
            if runs(middle * step):
                high = middle
            else:
                low = middle
        failing, grid = _last_failing(runs, high, top, above, step)
        if failing is None:
            return free_run, high * step
        low, high = failing, min(top, failing + grid)


def _last_failing(runs, high: int, top: int, above: float, step: int) -> tuple[int | None, int]:
    """Above where a bisection ends (`high`, in steps), the last limit of a grid of ABOVE_STEP of it, up to `above`
    above it and below `top`, that `runs` fails (None: every one runs), and the grid's spacing (in steps)."""
    grid = max(1, math.ceil(high * ABOVE_STEP))
    failing = [k for k in range(high + grid, min(top, math.ceil(high * (1 + above)) + 1), grid) if not runs(k * step)]
    return (failing[-1] if failing else None), grid


def _live_peak(events) -> float | None:
    """The peak of the bytes requested and not yet freed, a lower bound of the allocated peak; None for events
    that do not read as a sequence (the run says what is wrong with them)."""
    live, total, peak = {}, 0, 0
    try:
        for event in events:
            if event[0] == "alloc":
                total += event[2] - live.get(event[1], 0)
                live[event[1]] = event[2]
                if total > peak:
                    peak = total
            else:
                total -= live.pop(event[1], 0)
    except (IndexError, KeyError, TypeError):
        return None
    return peak
