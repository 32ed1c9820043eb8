"""The smallest limit of a replay (cost_models/allocator_replay.py) is the plain search's, however it is found.

min_limit tries each limit from a fork of the run without a limit (cost_models.allocator.CachingAllocator.fork)
instead of from the start; whether a sequence runs is not monotone in the limit, so the answer is a bisection's,
raised past the limits of a grid above it that fail, and any shortcut must leave every try's outcome as a run from
the start has it. The reference here runs each try from the start, on random sequences that free the cache under
pressure, fail, and run at a lower limit than one they fail at."""

from __future__ import annotations

import math
import random

import pytest

from cost_models.allocator import ROUND_LARGE, CachingAllocator, OutOfMemory
from cost_models import allocator_replay
from cost_models.allocator_replay import ABOVE, ABOVE_STEP, min_limit, replay, run_and_min_limit
from cost_models.expandable_segments import ExpandableAllocator

MiB = 1 << 20
SIZES = (lambda r: r.randint(0, MiB), lambda r: r.randint(MiB, 10 * MiB), lambda r: r.randint(10 * MiB, 120 * MiB),
         lambda r: r.choice([512, MiB, MiB + 1, 2 * MiB, 10 * MiB, 20 * MiB, 64 * MiB, 86 * MiB]))


def _events(seed: int) -> list[tuple]:
    """Allocations of every pool on one to three streams, and frees, most of them of a random live block."""
    rng = random.Random(seed)
    streams, events, live = rng.choice([1, 1, 2, 3]), [], []
    for key in range(rng.choice([10, 40, 120, 300])):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live)) if rng.random() < 0.7 else -1)))
        events.append(("alloc", key, rng.choice(SIZES)(rng), rng.randrange(streams)))
        live.append(key)
    return events


def _steps(seed: int) -> list[tuple]:
    """A recorded step's shape: weights kept, then three steps of a forward that keeps activations among transients
    and a backward that frees them, later steps landing in what the first one cached."""
    rng = random.Random(seed)
    events = [("alloc", ("w", i), rng.choice(SIZES)(rng), 0) for i in range(rng.randint(5, 30))]
    for step in range(3):
        kept = []
        for i in range(rng.randint(20, 80)):
            events.append(("alloc", (step, i), rng.choice(SIZES)(rng), rng.choice([0, 0, 0, 1])))
            if rng.random() < 0.4:
                events.append(("free", (step, i)))
            else:
                kept.append((step, i))
        for key in reversed(kept):
            events += [("alloc", (step, key, "grad"), rng.choice(SIZES)(rng), 0), ("free", key)]
            events += [("free", (step, key, "grad"))] if rng.random() < 0.8 else []
    return events


def _plain(events, max_split_size, expandable) -> tuple[int, list[bool]]:
    """min_limit as a bisection of runs from the start, then the grid above where it ends (ABOVE_STEP of it, up to
    ABOVE above), bisected again above the last that fails until none does; and whether each bisection try ran."""
    free, step, tries = replay(events, None, max_split_size, expandable), ROUND_LARGE, []

    def runs(limit: int) -> bool:
        try:
            replay(events, limit, max_split_size, expandable)
            return True
        except OutOfMemory:
            return False

    low, top = math.ceil(free.peak_allocated / step) - 1, math.ceil(free.peak_reserved / step)
    high = top
    while True:
        while high - low > 1:
            middle = (low + high) // 2
            tries.append(runs(middle * step))
            high, low = (middle, low) if tries[-1] else (high, middle)
        grid = max(1, math.ceil(high * ABOVE_STEP))
        failing = [k for k in range(high + grid, min(top, math.ceil(high * (1 + ABOVE)) + 1), grid)
                   if not runs(k * step)]
        if not failing:
            return high * step, tries
        low, high = failing[-1], min(top, failing[-1] + grid)


def test_min_limit_is_the_plain_bisections_on_random_sequences():
    configurations = [(None, False), (64 * MiB, False), (None, True)]
    not_monotone = 0
    for seed in range(60):
        events = _events(seed)
        for max_split_size, expandable in configurations:
            expected, tries = _plain(events, max_split_size, expandable)
            kind = "expandable" if expandable else "native"
            assert min_limit(events, max_split_size, expandable=expandable) == expected, (seed, kind, max_split_size)
            run, needed = run_and_min_limit(events, max_split_size, expandable=expandable)
            assert needed == expected and run == replay(events, None, max_split_size, expandable)
            not_monotone += False in tries[tries.index(True):] if True in tries else 0
    assert not_monotone >= 20  # sequences that fail at a limit above one they ran in


def test_every_limit_of_the_grid_above_the_answer_runs():
    """The answer is a limit the sequence runs in, and so is every limit of the grid above it (ABOVE_STEP of it, up
    to ABOVE above): on step-like sequences, natively, where a bisection alone can end below limits that fail."""
    raised = 0
    for seed in range(25):
        events = _steps(seed)
        needed, step = min_limit(events), ROUND_LARGE
        grid = max(1, math.ceil(needed / step * ABOVE_STEP))
        for k in range(needed // step, math.ceil(needed / step * (1 + ABOVE)) + 1, grid):
            replay(events, k * step)  # raises OutOfMemory where a limit of the grid fails
        free = replay(events)
        low, high = math.ceil(free.peak_allocated / step) - 1, math.ceil(free.peak_reserved / step)
        while high - low > 1:  # the bisection alone
            middle = (low + high) // 2
            try:
                replay(events, middle * step)
                high = middle
            except OutOfMemory:
                low = middle
        raised += needed > high * step
    assert raised >= 2, raised  # seeds 2 and one more of the 25 (deterministic)


def test_min_limit_is_the_plain_bisections_on_step_like_sequences(monkeypatch):
    advanced, run = [], allocator_replay._run  # runs without a limit that carry a fork to a later try's start

    def counted(allocator, events, live=None, start=0, stop=None, fork_for=None, settle=None):
        advanced.extend([stop] if stop is not None else [])
        return run(allocator, events, live, start, stop, fork_for, settle)

    monkeypatch.setattr(allocator_replay, "_run", counted)
    for seed in range(25):
        events = _steps(seed)
        for max_split_size, expandable in [(None, False), (None, True)]:
            assert min_limit(events, max_split_size, expandable=expandable) == _plain(
                events, max_split_size, expandable)[0], (seed, expandable)
    assert len(advanced) >= 10, len(advanced)


@pytest.mark.parametrize("make", [CachingAllocator, lambda: CachingAllocator(max_split_size=64 * MiB),
                                  ExpandableAllocator])
def test_a_fork_goes_on_as_the_allocator_it_was_taken_from(make):
    for seed in range(20):
        events = _events(seed)
        allocator, live, forks = make(), {}, []
        for index, event in enumerate(events):
            if index % 17 == 0:
                forks.append((index, *allocator.fork(live)))
            if event[0] == "alloc":
                live[event[1]] = allocator.malloc(event[2], event[3])
            else:
                allocator.free(live.pop(event[1]))
        for index, twin, twin_live in forks:
            for event in events[index:]:
                if event[0] == "alloc":
                    twin_live[event[1]] = twin.malloc(event[2], event[3])
                else:
                    twin.free(twin_live.pop(event[1]))
            assert _state(twin, twin_live) == _state(allocator, live)
            twin.empty_cache()
            allocator_copy, copy_live = allocator.fork(live)
            allocator_copy.empty_cache()
            assert _state(twin, twin_live) == _state(allocator_copy, copy_live)


def _state(allocator: CachingAllocator, live: dict) -> tuple:
    """The counters, each segment's blocks in address order, the free lists' keys and where each handle points."""
    heads = {block for block in [*live.values(), *allocator._blocks(live)] if block.prev is None}
    segments = []
    for head in sorted(heads, key=lambda block: block.addr):
        segment, block = [], head
        while block is not None:
            segment.append((block.addr, block.size, block.allocated, block.mapped, block.stream))
            block = block.next
        segments.append(segment)
    counters = ("allocated", "reserved", "requested", "peak_allocated", "peak_reserved", "peak_requested",
                "segments", "retries", "demand")
    lists = allocator._free, sorted(allocator._by_key), getattr(allocator, "_unmapped", None)
    return tuple(getattr(allocator, name) for name in counters), segments, lists, sorted(
        (key, block.addr) for key, block in live.items())
