"""Collectives measured across N processes through torch.distributed: all-gather, reduce-scatter and
all-reduce, each on its own, over a sweep of message sizes and group sizes; then, in the same process
group, the overlap slowdown (overlap.py), FSDP2's own overheads (fsdp.py) and whole calibration
training steps (calibration.py).

Message size is the full (unsharded) buffer, as cost_models/comm.py reads it: all-gather fills a
buffer of that size from 1/g shards, reduce-scatter reduces one of that size into 1/g shards.
Processes are started with torch.multiprocessing (spawn) and meet through a FileStore, so no port
is needed. Every item of the request carries the measurement cache's key for it; rank 0 appends each
result to a JSON-lines file as soon as it is measured, and the parent hands each one on (to the
cache) while the ranks run, so an interrupted or failed benchmark keeps everything it finished.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from autoplan.errors import AutoplanError
from autoplan.profiling.calibration import TIMED_STEPS, WARMUP_STEPS, measure_training_steps
from autoplan.profiling.fsdp import FSDP_CALLS, measure_fsdp
from autoplan.profiling.overlap import OVERLAP_PHASE_S, OVERLAP_TRIALS, measure_overlap
from autoplan.profiling.timing import Repeats
from autoplan.run.host_memory import keep_freed_memory

__all__ = ["COLLECTIVES", "CommProfileError", "CommRequest", "run_comm_benchmark", "message_bytes", "measurement_key",
           "default_backend", "group_sizes"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
ELEMENT_BYTES = 4  # fp32 buffers: FSDP2 reduces gradients in fp32 under bf16-mixed
POLL_S = 0.5  # how often the parent hands the ranks' finished results on while they run
STOP_GRACE_S = 10.0  # on an interrupt, how long the ranks get to exit before they are killed


class CommProfileError(AutoplanError):
    """The collective benchmark processes failed (backend missing, a rank crashed)."""


@dataclass(frozen=True)
class CommRequest:
    """What the ranks measure; every item is (cache key, what to measure), in the order measured."""

    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda"
    world_size: int
    threads: int | None  # torch intra-op threads per rank (CPU)
    # (key, collective, group size, message bytes): one round of one size; the caller takes the median
    # over rounds, and orders them round after round, so a neighbour's burst on a shared host spoils
    # one round of a size, not the size
    collectives: tuple[tuple[str, str, int, int], ...] = ()
    overlap: tuple[str, int] | None = None  # (key, all-gather bytes) of the overlap measurement
    overlap_phase_s: float = OVERLAP_PHASE_S
    overlap_trials: int = OVERLAP_TRIALS
    repeats: Repeats = field(default_factory=Repeats)
    fsdp: str | None = None  # key of FSDP2's own overheads (fsdp.py), or None: not measured
    fsdp_calls: int = FSDP_CALLS
    # (key, strategy, checkpoint, depth, micro-batch): one round of one calibration step (calibration.py)
    calibration: tuple[tuple[str, str, str, int, int], ...] = ()
    calibration_steps: tuple[int, int] = (WARMUP_STEPS, TIMED_STEPS)  # (warm-up, timed) steps per case
    show_progress: bool = True

    @property
    def empty(self) -> bool:
        return not (self.collectives or self.overlap or self.fsdp or self.calibration)


def measurement_key(collective: str, group_size: int, nbytes: int) -> str:
    return f"{collective}/g{group_size}/{nbytes}"


def message_bytes(nbytes: int, group_size: int) -> int:
    """The message actually sent: fp32 elements, a multiple of the group size, at least one per rank."""
    numel = max(group_size, nbytes // ELEMENT_BYTES // group_size * group_size)
    return numel * ELEMENT_BYTES


class _Results:
    """Reads the complete lines rank 0 has appended to the results file so far, once each."""

    def __init__(self, path: Path, on_result: Callable[[str, object], None]):
        self.path, self.on_result, self.offset = path, on_result, 0

    def drain(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            if line.strip():
                item = json.loads(line)
                self.on_result(item["key"], item["value"])


def _stop(context) -> None:
    """End the ranks of an interrupted benchmark: SIGINT (each rank exits at once, see _exit_on_interrupt), a
    grace period, then SIGKILL."""
    for process in context.processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_comm_benchmark(request: CommRequest, on_result: Callable[[str, object], None]) -> None:
    """Measure `request` in request.world_size spawned processes, calling `on_result(key, value)` for each
    item as it is measured (also when the benchmark fails or is interrupted: what finished is kept)."""
    with tempfile.TemporaryDirectory(prefix="autoplan-comm-") as tmp:
        store, path = Path(tmp) / "store", Path(tmp) / "results.jsonl"
        results = _Results(path, on_result)
        context = mp.start_processes(_worker, args=(asdict(request), str(store), str(path)),
                                     nprocs=request.world_size, join=False, start_method="spawn")
        try:
            while not context.join(timeout=POLL_S):
                results.drain()
        except KeyboardInterrupt:
            _stop(context)
            raise
        except Exception as exc:  # ProcessRaisedException / ProcessExitedException carry the rank's error
            raise CommProfileError(
                f"collective benchmark with {request.world_size} {request.backend} processes failed: {exc}"
            ) from exc
        finally:
            results.drain()


def _exit_on_interrupt(signum, frame) -> None:
    """A rank's SIGINT: exit now. Raised as KeyboardInterrupt it could land in a weakref callback or a __del__,
    where Python prints "Exception ignored" with a traceback and the rank runs on until it is killed; what the
    rank measured is already in the results file, a line at a time."""
    os._exit(128 + signum)


def _worker(rank: int, request_fields: dict, store_path: str, result_path: str) -> None:
    signal.signal(signal.SIGINT, _exit_on_interrupt)
    request_fields["repeats"] = Repeats(**request_fields["repeats"])
    for name in ("collectives", "calibration"):
        request_fields[name] = tuple(tuple(item) for item in request_fields[name])
    for name in ("overlap", "calibration_steps"):
        request_fields[name] = tuple(request_fields[name]) if request_fields[name] is not None else None
    request = CommRequest(**request_fields)
    if request.threads:
        torch.set_num_threads(request.threads)
    device = torch.device("cuda", rank) if request.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()  # as apply's CPU ranks run (autoplan.run.host_memory)

    def report(key: str, value) -> None:
        if rank == 0:
            with open(result_path, "a") as handle:
                handle.write(json.dumps({"key": key, "value": value}) + "\n")

    dist.init_process_group(request.backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=request.world_size)
    try:
        # every rank creates every group, in the same order, as torch.distributed requires
        groups = {size: dist.new_group(list(range(size))) for size in sorted({g for _, _, g, _ in request.collectives})}
        _warm_up(device)
        for key, collective, group_size, nbytes in tqdm(request.collectives, desc="collectives", unit="call",
                                                        disable=rank != 0 or not request.show_progress):
            seconds = None
            if rank < group_size:
                seconds = _time_collective(collective, nbytes, groups[group_size], group_size, device, request.repeats)
            report(key, seconds)  # rank 0 is in every group
            dist.barrier()
        if request.overlap is not None:
            key, nbytes = request.overlap
            report(key, measure_overlap(device, nbytes, request.overlap_phase_s, request.overlap_trials))
        if request.fsdp is not None:
            report(request.fsdp, measure_fsdp(device, request.repeats, request.fsdp_calls))
        if request.calibration:
            measure_training_steps(device, request.calibration, request.calibration_steps, report,
                                   progress=request.show_progress)
    finally:
        dist.destroy_process_group()


def _warm_up(device: torch.device) -> None:
    """The first collectives of a process group set up connections and buffers: not part of any size."""
    buffer = torch.ones(1 << 20, device=device)
    for _ in range(3):
        dist.all_reduce(buffer)
    dist.barrier()


def _time_collective(collective: str, nbytes: int, group, group_size: int, device: torch.device,
                     repeats: Repeats) -> float:
    """Median seconds per call, the slowest rank's; every rank issues the same number of calls."""
    numel = message_bytes(nbytes, group_size) // ELEMENT_BYTES
    full = torch.randn(numel, device=device)
    shard = torch.randn(numel // group_size, device=device)
    call = {
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "all_reduce": lambda: dist.all_reduce(full, group=group),
    }[collective]

    def timed() -> float:
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(repeats.warmup):
        timed()
    probe = _group_max(timed(), device, group)
    count = min(repeats.max_repeats, max(repeats.min_repeats, math.ceil(repeats.min_time_s / max(probe, 1e-9))))
    return _group_max(statistics.median(timed() for _ in range(count)), device, group)


def _group_max(value: float, device: torch.device, group) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def group_sizes(world_size: int) -> list[int]:
    """Powers of two up to the world size, and the world size itself."""
    sizes = {2 ** k for k in range(1, int(math.log2(world_size)) + 1)} | {world_size}
    return sorted(s for s in sizes if s >= 2)

