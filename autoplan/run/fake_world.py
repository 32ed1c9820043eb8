"""One rank of a plan's real world, in this process, on torch's fake process group (`autoplan apply --fake-world`).

Why: a plan for 8 or 64 ranks cannot be run on this machine, but one of its ranks can. On the "fake"
backend this process is rank 0 of a world of the plan's size: FSDP2 shards every unit for that world, so
the rank allocates exactly the shards, gathered parameters, gradients, reduction buffers, optimizer
states and activations the real rank 0 would, and every collective returns at once without moving
data. The training step is `autoplan apply`'s own (worker.train_measured / train_untracked: the same
micro-batches, loss, phases and live-tensor tracker), so the measured peak is what one rank of the real
run holds, short of what the collectives themselves allocate inside the backend.

What a fake world cannot exercise, and says so in its result (`not_exercised`):
- the collectives' time: the step time is compute only, compared with the plan's predicted compute
  (the units' predicted forward and backward, times the accumulation steps, plus the optimizer step);
- on a CPU profile (gloo), gloo's copy of each reduce-scatter input: the prediction counts it (see
  cost_models/table.py, _gloo_copy_bytes), the fake backend allocates nothing, so the measured peak
  can fall short of the predicted by up to the largest unit's reduction input (`gloo_copy_bytes`). The
  same decisions are costed again for NCCL (a shipped CUDA profile: memory only, the reduction in place)
  and that prediction (`predicted_no_gloo_bytes`) shown too: it is the one a fake group can match;
- the values: gathered parameters and reduced gradients hold whatever the buffers held (no data moves),
  so losses are not the real run's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoplan.api.estimate import estimate
from autoplan.errors import AutoplanError, UsageError
from autoplan.fileio import write_text_atomic
from autoplan.plan.schema import Plan, load_plan
from autoplan.profile_store import available_profiles, load_profile
from autoplan.run.apply import DEFAULT_LR, apply, materialise, resolve_plan_model
from autoplan.run.data import BatchShape, SyntheticTokens, vocab_size_of
from autoplan.run.memtrack import RankMemory
from autoplan.run.report import PHASES, predicted_phase_peaks
from autoplan.run.worker import RankResult, train_measured, train_untracked
from autoplan.sizes import format_bytes
from cost_models.options import PRECISIONS, SHARDING_KINDS, Dtype, ShardGroup

__all__ = ["FakeWorldResult", "format_fake_world", "run_fake_world"]


@dataclass
class FakeWorldResult:
    """Predicted beside measured for rank 0 of the plan's world, run alone on a fake process group."""

    plan: str  # the plan file, or "<Plan object>"
    model: str
    world_size: int  # the plan's world, which rank 0 was run as a part of
    device: str  # "cpu" or "cuda"
    dtype: str
    optimizer: str
    micro_batch_size: int
    grad_accum_steps: int
    seq_len: int
    warmup_steps: int
    steps: int  # measured steps after the warm-up
    mem_source: str  # what the measured peak counts
    mem_limit_bytes: int  # the plan's limit
    predicted_peak_bytes: int
    predicted_peak_point: str
    measured_peak_bytes: int  # over the measured steps and the warm-up (materialisation included)
    predicted_phase_bytes: dict[str, int] | None
    measured_phase_bytes: dict[str, int]  # the last step's peak within each phase
    gloo_copy_bytes: int  # predicted bytes the fake group cannot allocate (0 on a CUDA profile)
    predicted_no_gloo_bytes: int | None  # the same decisions' peak costed for NCCL (None: a CUDA profile already)
    predicted_compute_s: float  # accum x (units' fwd + bwd) + their optimizer step: no collectives
    measured_compute_s: float  # median step time, collectives free (tracker off on the CPU)
    predicted_step_s: float  # the plan's whole step (collectives and per-unit overheads included), for reference
    step_times_s: list[float] = field(default_factory=list)  # measured steps (tracker on, on the CPU)
    untracked_step_times_s: list[float] = field(default_factory=list)
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    not_exercised: list[str] = field(default_factory=list)
    predicted_host_bytes: int = 0  # offloaded units' state in host memory (the plan's)
    measured_host_bytes: int = 0  # their storages after the last optimizer step (on the CPU: inside the peak too)

    @property
    def error(self) -> float:
        """(predicted - measured) / measured peak."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def no_gloo_error(self) -> float:
        """(predicted without gloo's copy - measured) / measured peak: what a fake group can check."""
        predicted = self.predicted_no_gloo_bytes or self.predicted_peak_bytes
        return (predicted - self.measured_peak_bytes) / self.measured_peak_bytes

    def to_dict(self) -> dict:
        return {"kind": "autoplan fake-world run", **dataclasses.asdict(self), "error": self.error,
                "no_gloo_error": self.no_gloo_error}

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def run_fake_world(plan: Plan | str | os.PathLike, steps: int = 3, model: str | None = None, *, warmup: int = 1,
                   device: str | None = None, seed: int = 0, lr: float = DEFAULT_LR,
                   mem_limit_bytes: int | None = None, log=None) -> FakeWorldResult:
    """Run `plan` here as rank 0 of its world (`plan.cluster.world_size` ranks) on a fake process group:
    `warmup` + `steps` steps of `autoplan apply`'s training step on synthetic tokens, memory measured per
    phase; on the CPU `steps` more with the memory tracker off, timed. `model` names the model for a plan
    made from a factory (as `autoplan apply --model`). `device`: "cpu" or "cuda"; by default CUDA when the
    plan's profile is a CUDA one and a GPU is here, else the CPU. `mem_limit_bytes` fails the run like an
    out-of-memory error above it. `log(line)` is told each step. The process group is destroyed on return."""
    plan_file = None if isinstance(plan, Plan) else Path(plan)
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    world = plan.cluster.world_size
    if steps < 1 or warmup < 0:
        raise UsageError(f"a fake-world run needs `steps` >= 1 and `warmup` >= 0, got {steps} and {warmup}")
    if world < 2:
        raise UsageError(f"the plan is for a world of {world} rank; a fake world stands in for a world of several "
                         "ranks: run this plan for real with `autoplan apply`")
    if dist.is_available() and dist.is_initialized():
        raise UsageError("a process group is already initialised in this process; a fake-world run makes its own "
                         "(call torch.distributed.destroy_process_group() first)")
    profile_device = _profile_device(plan)
    device = device or ("cuda" if profile_device == "cuda" and torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise UsageError(f"`device` must be 'cpu' or 'cuda' (with a GPU present), got {device!r}")
    resolved = resolve_plan_model(plan, model, plan_file)  # before the group: a missing factory fails here
    gloo_copy = _gloo_copy_bytes(plan) if profile_device != "cuda" else 0
    no_gloo = _predicted_no_gloo_bytes(plan, plan_file, model) if gloo_copy else None

    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    training = plan.training
    shape = BatchShape(training.micro_batch_size, training.grad_accum_steps, world, training.seq_len)
    torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    result = RankResult(rank=0, pid=os.getpid())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        memory = RankMemory(torch_device, mem_limit_bytes)
        result.mem_source = memory.source + f", rank 0 of a fake {world}-rank world"
        with memory:
            mesh = init_device_mesh(torch_device.type, (world,))
            module, optimizer = apply(resolved.module, plan, mesh, lr=lr)
            materialise(module, torch_device, seed)
            data = SyntheticTokens(vocab_size_of(module), seed=seed)
            result.peak_mem_bytes = memory.peak_and_reset()

            def step_done(step: int, label: str, step_s: float, loss: float) -> None:
                if log is not None:
                    log(f"{label}: {step_s:.3f} s (compute only)")

            train_measured(module, optimizer, data, 0, shape, memory, result, warmup, steps, step_done)
        train_untracked(module, optimizer, data, 0, shape, memory, result, warmup, steps, step_done)
        cuda_allocated = torch.cuda.max_memory_allocated(torch_device) if device == "cuda" else None
        cuda_reserved = torch.cuda.max_memory_reserved(torch_device) if device == "cuda" else None
    finally:
        dist.destroy_process_group()

    timed = result.untracked_step_times_s or result.step_times_s[warmup:]
    return FakeWorldResult(
        plan=str(plan_file) if plan_file is not None else "<Plan object>", model=resolved.name, world_size=world,
        device=device, dtype=training.dtype, optimizer=training.optimizer,
        micro_batch_size=training.micro_batch_size, grad_accum_steps=training.grad_accum_steps,
        seq_len=training.seq_len, warmup_steps=warmup, steps=steps, mem_source=result.mem_source,
        mem_limit_bytes=plan.cluster.mem_limit_bytes,
        predicted_peak_bytes=plan.predicted.peak_mem_bytes, predicted_peak_point=plan.predicted.peak_point,
        measured_peak_bytes=result.peak_mem_bytes, predicted_phase_bytes=predicted_phase_peaks(plan),
        measured_phase_bytes=dict(result.phase_peak_bytes_by_step[-1]), gloo_copy_bytes=gloo_copy,
        predicted_no_gloo_bytes=no_gloo,
        predicted_compute_s=predicted_compute_s(plan), measured_compute_s=statistics.median(timed),
        predicted_step_s=plan.predicted.step_time_s,
        step_times_s=result.step_times_s[warmup:], untracked_step_times_s=result.untracked_step_times_s,
        cuda_max_allocated_bytes=cuda_allocated, cuda_max_reserved_bytes=cuda_reserved,
        predicted_host_bytes=plan.predicted.host_mem_bytes, measured_host_bytes=result.host_state_bytes,
        not_exercised=_not_exercised(plan, profile_device, device, gloo_copy),
    )


def predicted_compute_s(plan: Plan) -> float:
    """The plan's predicted step time without collectives: per micro-batch every unit's forward and
    backward (recompute included), times the accumulation steps, plus every unit's optimizer step."""
    units = [unit.predicted for unit in plan.units]
    per_micro_batch = sum(u.fwd_s + u.bwd_s for u in units)
    return plan.training.grad_accum_steps * per_micro_batch + sum(u.optimizer_s for u in units)


def _gloo_copy_bytes(plan: Plan) -> int:
    """The largest reduce-scatter input of a sharded unit (padded to the shard group, reduce dtype): the
    most that gloo's copy of it adds to a CPU prediction at any one time."""
    world = plan.cluster.world_size
    reduce_bytes = Dtype(PRECISIONS[plan.training.dtype].reduce_dtype).bytes
    largest = 0
    for unit in plan.units:
        group = SHARDING_KINDS[unit.sharding].shard_group
        shard = world if group == ShardGroup.WORLD else plan.cluster.gpus_per_node if group == ShardGroup.NODE else 1
        if shard > 1:
            numel = sum(math.ceil(math.prod(s) / shard) * shard if s else shard for s in unit.param_shapes.values())
            largest = max(largest, numel * reduce_bytes)
    return largest


def _predicted_no_gloo_bytes(plan: Plan, plan_file: Path | None, model: str | None) -> int | None:
    """The plan's decisions costed for NCCL (the first shipped CUDA profile; memory does not depend on which):
    its predicted peak, gloo's copies left out. None when no CUDA profile is available."""
    cuda = next((name for name in sorted(available_profiles()) if _device_of(name) == "cuda"), None)
    if cuda is None:
        return None
    estimated = estimate(model, plan=plan_file if plan_file is not None else plan, profile=cuda,
                         allow_over_device_mem=True)
    return estimated.predicted.peak_mem_bytes


def _device_of(profile: str) -> str | None:
    try:
        return load_profile(profile).device_type
    except AutoplanError:
        return None


def _profile_device(plan: Plan) -> str:
    try:
        return load_profile(plan.cluster.profile).device_type
    except AutoplanError:
        return "cpu" if plan.cluster.profile.startswith("cpu") else "cuda"


def _not_exercised(plan: Plan, profile_device: str, device: str, gloo_copy: int) -> list[str]:
    notes = [("collectives: they return at once and move no data, so the step time is compute only and the "
              "losses are not the real run's")]
    if gloo_copy:
        notes.append(f"gloo's copy of a reduce-scatter input, which the {plan.cluster.profile} prediction counts "
                     f"(up to {format_bytes(gloo_copy)}, the largest unit's): no gloo on a fake group, so the "
                     "measured peak may fall short of the predicted by up to that; 'without gloo's copy' is the "
                     "same decisions costed for NCCL, which reduces in place")
    if profile_device != device:
        notes.append(f"the profile's device: the plan was costed for {profile_device} ({plan.cluster.profile}) "
                     f"and ran on {device}: compare memory, not time")
    return notes


def format_fake_world(r: FakeWorldResult) -> str:
    """The predicted-vs-measured table of a fake-world run."""
    lines = [
        (f"autoplan apply --fake-world: {r.model} as rank 0 of a fake {r.world_size}-rank world ({r.device}), "
         f"{r.dtype}, {r.optimizer}, micro-batch {r.micro_batch_size} x {r.grad_accum_steps} accum, "
         f"seq {r.seq_len}, synthetic tokens; {r.warmup_steps} warm-up + {r.steps} measured steps"),
        f"{'':28}{'predicted':>14}{'measured':>14}{'measured/predicted':>21}",
    ]
    rows = [("peak memory, rank 0", r.predicted_peak_bytes, r.measured_peak_bytes, format_bytes)]
    if r.predicted_no_gloo_bytes is not None:
        rows.append(("  without gloo's copy", r.predicted_no_gloo_bytes, r.measured_peak_bytes, format_bytes))
    for phase in PHASES:
        predicted = (r.predicted_phase_bytes or {}).get(phase)
        rows.append((f"  in {phase}", predicted, r.measured_phase_bytes.get(phase), format_bytes))
    if r.predicted_host_bytes or r.measured_host_bytes:
        rows.append(("host memory (offloaded)", r.predicted_host_bytes, r.measured_host_bytes, format_bytes))
    rows.append(("step time, compute only", r.predicted_compute_s, r.measured_compute_s, _seconds))
    for label, predicted, measured, fmt in rows:
        ratio = f"{measured / predicted:.2f}" if measured is not None and predicted else "-"
        lines.append(f"{label:28}{_dash(predicted, fmt):>14}{_dash(measured, fmt):>14}{ratio:>21}")
    lines.append(f"  predicted peak at: {r.predicted_peak_point}; the plan's limit: {format_bytes(r.mem_limit_bytes)}"
                 + ("" if r.measured_peak_bytes <= r.mem_limit_bytes else " (MEASURED OVER THE LIMIT)"))
    lines.append(f"  measured memory: {r.mem_source}")
    if r.cuda_max_allocated_bytes is not None:
        lines.append(f"  CUDA: max_memory_allocated {format_bytes(r.cuda_max_allocated_bytes)}, "
                     f"max_memory_reserved {format_bytes(r.cuda_max_reserved_bytes)}")
    times = r.untracked_step_times_s or r.step_times_s
    lines.append("  step times (compute only" + (", memory tracker off" if r.untracked_step_times_s else "")
                 + "): " + ", ".join(f"{t:.3f}s" for t in times))
    lines.append("  predicted compute: the units' forward and backward x accumulation + the optimizer step, "
                 f"no collectives or per-unit overheads (the plan's whole step: {_seconds(r.predicted_step_s)})")
    if r.measured_host_bytes and r.device == "cpu":
        lines.append("  note: on the CPU the host is the device: the offloaded state is in the peak too (measured, "
                     "and predicted by a CPU profile); the host row shows its share")
    lines.extend(f"  not exercised: {note}" for note in r.not_exercised)
    return "\n".join(lines)


def _dash(value, fmt) -> str:
    return "-" if value is None else fmt(value)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"
