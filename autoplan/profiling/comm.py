"""Collectives measured across N processes through torch.distributed: all-gather, reduce-scatter and
all-reduce, each on its own, over a sweep of message sizes and group sizes; then the overlap slowdown
(overlap.py) in the same process group.

Message size is the full (unsharded) buffer, as cost_models/comm.py reads it: all-gather fills a
buffer of that size from 1/g shards, reduce-scatter reduces one of that size into 1/g shards.
Processes are started with torch.multiprocessing (spawn) and meet through a FileStore, so no port
is needed; rank 0 writes the results to a JSON file the parent reads.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from autoplan.errors import AutoplanError
from autoplan.profiling.calibration import CALIBRATION_ROUNDS, measure_training_steps
from autoplan.profiling.fsdp import measure_fsdp
from autoplan.profiling.overlap import OVERLAP_PHASE_S, OVERLAP_TRIALS, measure_overlap
from autoplan.profiling.timing import Repeats

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
ELEMENT_BYTES = 4  # fp32 buffers: FSDP2 reduces gradients in fp32 under bf16-mixed


class CommProfileError(AutoplanError):
    """The collective benchmark processes failed (backend missing, a rank crashed)."""


@dataclass(frozen=True)
class CommRequest:
    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda"
    world_size: int
    threads: int | None  # torch intra-op threads per rank (CPU)
    measurements: tuple[tuple[str, int, int], ...]  # (collective, group size, message bytes)
    overlap_bytes: int | None  # all-gather size for the overlap measurement; None: skip it
    overlap_phase_s: float = OVERLAP_PHASE_S
    overlap_trials: int = OVERLAP_TRIALS
    repeats: Repeats = field(default_factory=Repeats)
    # each measurement is taken once per round, rounds one after the other, and the median over rounds
    # kept: a neighbour's burst on a shared host then spoils one round of a size, not the size
    rounds: int = 3
    show_progress: bool = True
    fsdp: bool = False  # also measure FSDP2's own overheads (fsdp.py)
    calibration: bool = False  # also time whole training steps of the calibration model (calibration.py)
    calibration_rounds: int = CALIBRATION_ROUNDS


def measurement_key(collective: str, group_size: int, nbytes: int) -> str:
    return f"{collective}/g{group_size}/{nbytes}"


def message_bytes(nbytes: int, group_size: int) -> int:
    """The message actually sent: fp32 elements, a multiple of the group size, at least one per rank."""
    numel = max(group_size, nbytes // ELEMENT_BYTES // group_size * group_size)
    return numel * ELEMENT_BYTES


def run_comm_benchmark(request: CommRequest) -> dict:
    """{"collectives": {measurement_key: seconds}, "overlap", "fsdp", "calibration": {...} or None}, measured in
    request.world_size spawned processes."""
    with tempfile.TemporaryDirectory(prefix="autoplan-comm-") as tmp:
        store, result = Path(tmp) / "store", Path(tmp) / "result.json"
        try:
            mp.spawn(_worker, args=(asdict(request), str(store), str(result)), nprocs=request.world_size, join=True)
        except Exception as exc:  # ProcessRaisedException / ProcessExitedException carry the rank's error
            raise CommProfileError(
                f"collective benchmark with {request.world_size} {request.backend} processes failed: {exc}"
            ) from exc
        return json.loads(result.read_text())


def _worker(rank: int, request_fields: dict, store_path: str, result_path: str) -> None:
    request_fields["repeats"] = Repeats(**request_fields["repeats"])
    request_fields["measurements"] = tuple(tuple(m) for m in request_fields["measurements"])
    request = CommRequest(**request_fields)
    if request.threads:
        torch.set_num_threads(request.threads)
    device = torch.device("cuda", rank) if request.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(request.backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=request.world_size)
    try:
        # every rank creates every group, in the same order, as torch.distributed requires
        groups = {size: dist.new_group(list(range(size))) for size in sorted({g for _, g, _ in request.measurements})}
        _warm_up(device)
        rounds: dict[str, list[float]] = {}
        todo = [m for _ in range(request.rounds) for m in request.measurements]
        for collective, group_size, nbytes in tqdm(todo, desc="collectives", unit="call",
                                                   disable=rank != 0 or not request.show_progress):
            if rank < group_size:
                seconds = _time_collective(collective, nbytes, groups[group_size], group_size, device, request.repeats)
                rounds.setdefault(measurement_key(collective, group_size, nbytes), []).append(seconds)
            dist.barrier()
        collectives = {key: statistics.median(values) for key, values in rounds.items()}
        overlap = None
        if request.overlap_bytes:
            overlap = measure_overlap(device, request.overlap_bytes, request.overlap_phase_s, request.overlap_trials)
        fsdp = measure_fsdp(device, request.repeats) if request.fsdp else None
        calibration = measure_training_steps(device, request.calibration_rounds) if request.calibration else None
        if rank == 0:
            Path(result_path).write_text(json.dumps({"collectives": collectives, "overlap": overlap, "fsdp": fsdp,
                                                     "calibration": calibration}))
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
        "all_gather": lambda: dist.all_gather_single(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, group=group),
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

