"""Slowdown of compute and of communication while they run at the same time, inside one rank of a
running process group: a matmul loop and an all-gather loop are timed alone, then together (the
all-gather loop on a second thread, and on its own CUDA stream on a GPU). The slowdown of each is
the median time of its iterations that ran while the other loop was running, over its median alone;
the median over a few trials, since one trial on a shared machine can catch a neighbour's burst.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

OVERLAP_PHASE_S = 0.4  # how long each loop runs, alone and together, per trial
OVERLAP_TRIALS = 3


def _timed_loop(step: Callable[[], None], iterations: int, wait: Callable[[], None]) -> list[tuple[float, float]]:
    """(start, end) perf_counter stamps of each iteration; `wait` blocks until the step's work is done."""
    stamps = []
    for _ in range(iterations):
        start = time.perf_counter()
        step()
        wait()
        stamps.append((start, time.perf_counter()))
    return stamps


def _median_s(stamps: list[tuple[float, float]]) -> float:
    return statistics.median(end - start for start, end in stamps)


def _during(stamps: list[tuple[float, float]], other: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Iterations that ran entirely while the other loop was running."""
    first, last = other[0][0], other[-1][1]
    return [(start, end) for start, end in stamps if start >= first and end <= last]


def _agree_max(value: float, device: torch.device, group=None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def measure_overlap(device: torch.device, gather_bytes: int, phase_s: float = OVERLAP_PHASE_S,
                    trials: int = OVERLAP_TRIALS) -> dict[str, float]:
    """{"compute_slowdown": ..., "comm_slowdown": ...}, each >= 1, the worst over the ranks."""
    world = dist.get_world_size()
    on_gpu = device.type == "cuda"
    size = 4096 if on_gpu else 768  # one matmul: ~0.1 ms on a datacentre GPU, ~5 ms on one CPU core
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    numel = max(world, gather_bytes // 4 // world * world)
    full, shard = torch.empty(numel, device=device), torch.randn(numel // world, device=device)
    compute_stream = torch.cuda.Stream(device) if on_gpu else None
    comm_stream = torch.cuda.Stream(device) if on_gpu else None

    def compute_step():
        if compute_stream is not None:
            with torch.cuda.stream(compute_stream):
                torch.mm(a, b, out=out)
        else:
            torch.mm(a, b, out=out)

    def comm_step():
        if comm_stream is not None:
            with torch.cuda.stream(comm_stream):
                dist.all_gather_single(full, shard)
        else:
            dist.all_gather_single(full, shard)

    def wait_for(stream):
        return (lambda: stream.synchronize()) if stream is not None else (lambda: None)

    wait_compute, wait_comm = wait_for(compute_stream), wait_for(comm_stream)
    for _ in range(3):  # warm-up
        compute_step(), wait_compute(), comm_step(), wait_comm()

    # iteration counts for ~phase_s each; every rank must issue the same number of collectives
    compute_probe = _median_s(_timed_loop(compute_step, 3, wait_compute))
    comm_probe = _agree_max(_median_s(_timed_loop(comm_step, 3, wait_comm)), device)
    compute_iterations = max(5, math.ceil(phase_s / compute_probe))
    comm_iterations = max(5, math.ceil(phase_s / comm_probe))

    compute_slowdowns, comm_slowdowns = [], []
    for _ in range(trials):
        compute_alone = _timed_loop(compute_step, compute_iterations, wait_compute)
        dist.barrier()
        comm_alone = _timed_loop(comm_step, comm_iterations, wait_comm)
        dist.barrier()

        comm_together: list[tuple[float, float]] = []
        thread = threading.Thread(
            target=lambda: comm_together.extend(_timed_loop(comm_step, comm_iterations, wait_comm)))
        thread.start()
        compute_together = _timed_loop(compute_step, compute_iterations, wait_compute)
        thread.join()
        dist.barrier()

        compute_overlapped = _during(compute_together, comm_together) or compute_together
        comm_overlapped = _during(comm_together, compute_together) or comm_together
        compute_slowdowns.append(_median_s(compute_overlapped) / _median_s(compute_alone))
        comm_slowdowns.append(_median_s(comm_overlapped) / _median_s(comm_alone))
    return {
        "compute_slowdown": max(1.0, _agree_max(statistics.median(compute_slowdowns), device)),
        "comm_slowdown": max(1.0, _agree_max(statistics.median(comm_slowdowns), device)),
    }
