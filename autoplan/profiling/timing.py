"""Wall time of a callable on a device: warm-up, then repeats until a count and a time budget are met.

CPU: time.perf_counter around each call. CUDA: a pair of events around each call, read after one
synchronize, so the host's launch overhead overlaps with the kernels as it does in training.
The median is reported: on a shared machine the mean is dragged up by the odd descheduled repeat.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Repeats:
    warmup: int = 2
    min_repeats: int = 5
    max_repeats: int = 50
    min_time_s: float = 0.05  # keep repeating (up to max_repeats) until this much was timed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time_s(
    fn: Callable[[], object], device: torch.device, repeats: Repeats, before_each: Callable[[], None] | None = None,
) -> float:
    """Median seconds per call of `fn`; `before_each` (untimed) resets state between calls."""
    for _ in range(repeats.warmup):
        if before_each:
            before_each()
        fn()
    synchronize(device)
    if device.type == "cuda":
        return _cuda_median_s(fn, device, repeats, before_each)
    times: list[float] = []
    while len(times) < repeats.max_repeats and (len(times) < repeats.min_repeats or sum(times) < repeats.min_time_s):
        if before_each:
            before_each()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cuda_median_s(fn, device, repeats: Repeats, before_each) -> float:
    times: list[float] = []
    while len(times) < repeats.max_repeats and (len(times) < repeats.min_repeats or sum(times) < repeats.min_time_s):
        events = []
        for _ in range(repeats.min_repeats):  # a batch of event pairs per synchronize
            if before_each:
                before_each()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        times += [start.elapsed_time(end) / 1e3 for start, end in events]
    return statistics.median(times)
