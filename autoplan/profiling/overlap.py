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
from dataclasses import dataclass
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
    compute, comm = _loops(device, gather_bytes)
    for _ in range(3):  # warm-up
        compute.step(), compute.wait(), comm.step(), comm.wait()

    # iteration counts for ~phase_s each; every rank must issue the same number of collectives
    compute.iterations = max(5, math.ceil(phase_s / _median_s(_timed_loop(compute.step, 3, compute.wait))))
    comm_probe = _agree_max(_median_s(_timed_loop(comm.step, 3, comm.wait)), device)
    comm.iterations = max(5, math.ceil(phase_s / comm_probe))

    compute_slowdowns, comm_slowdowns = [], []
    for _ in range(trials):
        compute_slowdown, comm_slowdown = _trial(compute, comm)
        compute_slowdowns.append(compute_slowdown)
        comm_slowdowns.append(comm_slowdown)
    return {
        "compute_slowdown": max(1.0, _agree_max(statistics.median(compute_slowdowns), device)),
        "comm_slowdown": max(1.0, _agree_max(statistics.median(comm_slowdowns), device)),
    }


@dataclass
class _Loop:
    """One of the two loops: its step, how to wait for the step's work, and how many steps a phase runs."""

    step: Callable[[], None]
    wait: Callable[[], None]
    iterations: int = 0

    def timed(self) -> list[tuple[float, float]]:
        return _timed_loop(self.step, self.iterations, self.wait)


def _on_stream(stream, work: Callable[[], None]) -> _Loop:
    """`work` as a loop's step, issued on `stream` (None: the CPU, where it runs as it is called)."""
    if stream is None:
        return _Loop(work, lambda: None)

    def step() -> None:
        with torch.cuda.stream(stream):
            work()

    return _Loop(step, stream.synchronize)


def _loops(device: torch.device, gather_bytes: int) -> tuple[_Loop, _Loop]:
    """A matmul loop and an all-gather loop of `gather_bytes`, each on its own CUDA stream on a GPU."""
    world = dist.get_world_size()
    on_gpu = device.type == "cuda"
    size = 4096 if on_gpu else 768  # one matmul: ~0.1 ms on a datacentre GPU, ~5 ms on one CPU core
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    numel = max(world, gather_bytes // 4 // world * world)
    full, shard = torch.empty(numel, device=device), torch.randn(numel // world, device=device)
    compute = _on_stream(torch.cuda.Stream(device) if on_gpu else None, lambda: torch.mm(a, b, out=out))
    comm = _on_stream(torch.cuda.Stream(device) if on_gpu else None, lambda: dist.all_gather_into_tensor(full, shard))
    return compute, comm


def _trial(compute: _Loop, comm: _Loop) -> tuple[float, float]:
    """Each loop timed alone, then both together (the all-gather loop on a second thread): the slowdown of
    compute and of communication, medians of the iterations that overlapped the other loop over alone."""
    compute_alone = compute.timed()
    dist.barrier()
    comm_alone = comm.timed()
    dist.barrier()

    comm_together: list[tuple[float, float]] = []
    thread = threading.Thread(target=lambda: comm_together.extend(comm.timed()))
    thread.start()
    compute_together = compute.timed()
    thread.join()
    dist.barrier()

    compute_overlapped = _during(compute_together, comm_together) or compute_together
    comm_overlapped = _during(comm_together, compute_together) or comm_together
    return (_median_s(compute_overlapped) / _median_s(compute_alone),
            _median_s(comm_overlapped) / _median_s(comm_alone))
