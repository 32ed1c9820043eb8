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
  (the units' predicted forward and backward and FSDP2's per-unit overhead, times the accumulation steps, plus
  the optimizer step: autoplan.run.fake_world_prediction);
- on a CPU profile (gloo), gloo's copy of each reduce-scatter input: the plan's prediction counts it
  (cost_models/table.py, _gloo_copy_bytes), the fake backend allocates nothing. So the prediction the
  run is compared with (`predicted_peak_bytes`, the headline) is the plan's decisions costed again on the
  plan's own profile with every reduction in place (table.without_gloo_copy: only that copy left out, the
  CPU optimizer's per-tensor scratch and all else as planned); the plan's own prediction stands beside it
  (`plan_predicted_peak_bytes`), above it by at most the largest unit's reduction input (`gloo_copy_bytes`);
- the values: gathered parameters and reduced gradients hold whatever the buffers held (no data moves),
  so losses are not the real run's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoplan.errors import AutoplanError, UsageError
from autoplan.fileio import write_text_atomic
from autoplan.plan.schema import Plan, load_plan
from autoplan.profile_store import load_profile
from autoplan.run.apply import DEFAULT_LR, apply, materialise, resolve_plan_model
from autoplan.run.attention import check_attention, planned_attention
from autoplan.run.data import BatchShape, SyntheticTokens, vocab_size_of
from autoplan.run.fake_world_prediction import Headline
from autoplan.run.fake_world_prediction import headline as prediction_headline
from autoplan.run.memtrack import RankMemory
from autoplan.run.report import PHASES, predicted_phase_peaks
from autoplan.run.tp import training_context
from autoplan.run.worker import RankResult, TrainingRun, train_measured, train_untracked
from autoplan.sizes import format_bytes

__all__ = ["FakeWorldOptions", "FakeWorldResult", "format_fake_world", "run_fake_world"]


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
    # the prediction for what runs: the plan's decisions on its profile, reductions in place as on the fake group
    predicted_peak_bytes: int
    predicted_peak_point: str
    measured_peak_bytes: int  # over the measured steps and the warm-up (materialisation included)
    predicted_phase_bytes: dict[str, int] | None
    measured_phase_bytes: dict[str, int]  # the last step's peak within each phase
    plan_predicted_peak_bytes: int  # the plan's own prediction (on a CPU profile: gloo's copies counted)
    prediction_basis: str  # what `predicted_peak_bytes` is, in words
    gloo_copy_bytes: int  # the largest unit's gloo copy: at most plan's - run's prediction (0 on a CUDA profile)
    predicted_compute_s: float  # accum x (units' fwd + bwd + FSDP2 overhead) + optimizer step: no collectives
    measured_compute_s: float  # median step time, collectives free (tracker off on the CPU)
    predicted_step_s: float  # the plan's whole step (collectives and per-unit overheads included), for reference
    step_times_s: list[float] = field(default_factory=list)  # measured steps (tracker on, on the CPU)
    untracked_step_times_s: list[float] = field(default_factory=list)
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    not_exercised: list[str] = field(default_factory=list)
    predicted_host_bytes: int = 0  # offloaded units' state in host memory (the plan's)
    measured_host_bytes: int = 0  # their storages after the last optimizer step (on the CPU: inside the peak too)
    rank: int = 0  # the rank of the world that ran (a pipelined plan: of the stage it runs)
    predicted_phase_s: dict[str, float] | None = None  # predicted_compute_s by phase (forward, backward, optimizer)
    measured_phase_s: dict[str, float] = field(default_factory=dict)  # median over the timed steps, by phase

    @property
    def error(self) -> float:
        """(predicted - measured) / measured peak, the prediction being the one for the backend that ran."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def plan_error(self) -> float:
        """(the plan's own prediction - measured) / measured peak (on a CPU profile: with gloo's copies)."""
        return (self.plan_predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def no_gloo_error(self) -> float:
        """The former name of `error` (the prediction without gloo's copy), kept for callers of it."""
        return self.error

    def to_dict(self) -> dict:
        return {"kind": "autoplan fake-world run", **dataclasses.asdict(self), "error": self.error,
                "plan_error": self.plan_error}

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass(frozen=True)
class FakeWorldOptions:
    """How a fake-world run trains, beyond which model and how many steps (`autoplan apply --fake-world`'s
    --seed, --lr and --mem-limit): the seed of the weights and the synthetic tokens, the learning rate, and a
    limit above which live memory fails the run like an out-of-memory error (None: no limit)."""

    seed: int = 0
    lr: float = DEFAULT_LR
    mem_limit_bytes: int | None = None
    rank: int = 0  # the rank of the world run here: a pipelined plan's stage is the one this rank runs


def run_fake_world(plan: Plan | str | os.PathLike, steps: int = 3, model: str | None = None, *, warmup: int = 1,
                   device: str | None = None, options: FakeWorldOptions | None = None, log=None) -> FakeWorldResult:
    """Run `plan` here as rank 0 of its world (`plan.cluster.world_size` ranks) on a fake process group:
    `warmup` + `steps` steps of `autoplan apply`'s training step on synthetic tokens, memory measured per
    phase; on the CPU `steps` more with the memory tracker off, timed. `model` names the model for a plan
    made from a factory (as `autoplan apply --model`). `device`: "cpu" or "cuda"; by default CUDA when the
    plan's profile is a CUDA one and a GPU is here, else the CPU. `options`: the seed, the learning rate and
    a memory limit (FakeWorldOptions). `log(line)` is told each step. The process group is destroyed on
    return."""
    options = options or FakeWorldOptions()
    plan_file = None if isinstance(plan, Plan) else Path(plan)
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    _check_fake_world(plan, steps, warmup)
    profile_device = _profile_device(plan)
    device = device or ("cuda" if profile_device == "cuda" and torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise UsageError(f"`device` must be 'cpu' or 'cuda' (with a GPU present), got {device!r}")
    resolved = resolve_plan_model(plan, model, plan_file)  # before the group: a missing factory fails here
    headline = prediction_headline(plan, resolved, profile_device, options.rank)
    check_attention(plan, device)
    result, cuda_peaks = _run_rank_zero(plan, resolved.module, device, (warmup, steps), options, log)

    training, predicted = plan.training, headline.plan
    timed = result.untracked_step_times_s or result.step_times_s[warmup:]
    return FakeWorldResult(
        plan=str(plan_file) if plan_file is not None else "<Plan object>", model=resolved.name,
        world_size=plan.cluster.world_size, device=device, dtype=training.dtype, optimizer=training.optimizer,
        micro_batch_size=training.micro_batch_size, grad_accum_steps=training.grad_accum_steps,
        seq_len=training.seq_len, warmup_steps=warmup, steps=steps, mem_source=result.mem_source,
        mem_limit_bytes=plan.cluster.mem_limit_bytes,
        predicted_peak_bytes=predicted.predicted.peak_mem_bytes, predicted_peak_point=predicted.predicted.peak_point,
        measured_peak_bytes=result.peak_mem_bytes, predicted_phase_bytes=predicted_phase_peaks(predicted),
        measured_phase_bytes=dict(result.phase_peak_bytes_by_step[-1]),
        plan_predicted_peak_bytes=plan.predicted.peak_mem_bytes, prediction_basis=headline.basis,
        gloo_copy_bytes=headline.gloo_copy_bytes,
        predicted_compute_s=headline.compute_s, measured_compute_s=statistics.median(timed),
        predicted_step_s=plan.predicted.step_time_s,
        step_times_s=result.step_times_s[warmup:], untracked_step_times_s=result.untracked_step_times_s,
        cuda_max_allocated_bytes=cuda_peaks[0], cuda_max_reserved_bytes=cuda_peaks[1],
        predicted_host_bytes=plan.predicted.host_mem_bytes, measured_host_bytes=result.host_state_bytes,
        rank=options.rank, predicted_phase_s=headline.phase_s,
        measured_phase_s=_median_phases(result.phase_times_s_by_step[-steps:]),
        not_exercised=_not_exercised(plan, profile_device, device, headline),
    )


def _check_fake_world(plan: Plan, steps: int, warmup: int) -> None:
    """UsageError where a fake world cannot stand in for the plan's run here."""
    world = plan.cluster.world_size
    if steps < 1 or warmup < 0:
        raise UsageError(f"a fake-world run needs `steps` >= 1 and `warmup` >= 0, got {steps} and {warmup}")
    if world < 2:
        raise UsageError(f"the plan is for a world of {world} rank; a fake world stands in for a world of several "
                         "ranks: run this plan for real with `autoplan apply`")
    if dist.is_available() and dist.is_initialized():
        raise UsageError("a process group is already initialised in this process; a fake-world run makes its own "
                         "(call torch.distributed.destroy_process_group() first)")


def _run_rank_zero(plan: Plan, module: torch.nn.Module, device: str, warmup_and_steps: tuple[int, int],
                   options: FakeWorldOptions, log) -> tuple[RankResult, tuple[int | None, int | None]]:
    """Apply, materialise and train `module` as rank 0 of the plan's world on the fake backend, as apply's
    ranks do; the measurements, and CUDA's max allocated and reserved bytes (None on the CPU)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    world, training, mesh, rank = plan.cluster.world_size, plan.training, plan.cluster.mesh, options.rank
    data_world = mesh.dp  # a context- or tensor-parallel group and a pipeline's stages share rows, as in apply
    shape = BatchShape(training.micro_batch_size, training.grad_accum_steps, data_world, training.seq_len)
    torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    result = RankResult(rank=rank, pid=os.getpid(), pipeline_rank=mesh.pipeline_rank(rank) if mesh.pp > 1 else None)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        memory = RankMemory(torch_device, options.mem_limit_bytes)
        result.mem_source = memory.source + f", rank {rank} of a fake {world}-rank world"
        with memory, training_context(plan), planned_attention(plan, module, torch_device.type):  # as apply
            data = SyntheticTokens(vocab_size_of(module), seed=options.seed)  # of the whole model: a stage may lack it
            module, optimizer = applied = apply(module, plan, init_device_mesh(torch_device.type, (world,)),
                                                lr=options.lr)
            materialise(module, torch_device, options.seed)
            result.peak_mem_bytes = memory.peak_and_reset()

            def step_done(step: int, label: str, step_s: float, loss: float) -> None:
                if log is not None:
                    log(f"{label}: {step_s:.3f} s (compute only)")

            run = TrainingRun(module, optimizer, data, mesh.data_rank(rank), shape, memory, result, *warmup_and_steps,
                              step_done, applied.context)
            train_measured(run)
        with training_context(plan), planned_attention(plan, module, torch_device.type):
            train_untracked(run)
        if device != "cuda":
            return result, (None, None)
        return result, memory.cuda_peaks()
    finally:
        dist.destroy_process_group()


def _median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median seconds over `steps` (RankResult.phase_times_s_by_step's)."""
    return {phase: statistics.median(step.get(phase, 0.0) for step in steps) for phase in steps[-1]} if steps else {}


def _profile_device(plan: Plan) -> str:
    try:
        return load_profile(plan.cluster.profile).device_type
    except AutoplanError:
        return "cpu" if plan.cluster.profile.startswith("cpu") else "cuda"


def _not_exercised(plan: Plan, profile_device: str, device: str, headline: Headline) -> list[str]:
    gloo_copy, recosted = headline.gloo_copy_bytes, headline.recosted
    notes = [("collectives: they return at once and move no data, so the step time is compute only and the "
              "losses are not the real run's")]
    if not headline.overhead_priced:
        notes.append("FSDP2's per-unit overhead (hooks, copy-in and copy-out), which the step runs: the compute "
                     "prediction leaves it out (the plan's profile is not here, or the plan is pipelined)")
    if gloo_copy and recosted:
        notes.append(f"gloo's copy of a reduce-scatter input, which the plan's {plan.cluster.profile} prediction "
                     f"counts (up to {format_bytes(gloo_copy)}, the largest unit's): no gloo on a fake group, so "
                     "the run is compared with the plan's decisions costed with every reduction in place; the "
                     "plan's own prediction is the 'as planned' row")
    elif gloo_copy:
        notes.append(f"gloo's copy of a reduce-scatter input (up to {format_bytes(gloo_copy)}): the plan could not "
                     "be costed again here without it (its profile is not available), "
                     "so the prediction shown counts it and the measured peak may fall short by up to that")
    if profile_device != device:
        notes.append(f"the profile's device: the plan was costed for {profile_device} ({plan.cluster.profile}) "
                     f"and ran on {device}: compare memory, not time")
    return notes


def format_fake_world(r: FakeWorldResult) -> str:
    """The predicted-vs-measured table of a fake-world run."""
    lines = [
        (f"autoplan apply --fake-world: {r.model} as rank {r.rank} of a fake {r.world_size}-rank world ({r.device}), "
         f"{r.dtype}, {r.optimizer}, micro-batch {r.micro_batch_size} x {r.grad_accum_steps} accum, "
         f"seq {r.seq_len}, synthetic tokens; {r.warmup_steps} warm-up + {r.steps} measured steps"),
        f"{'':28}{'predicted':>14}{'measured':>14}{'measured/predicted':>21}",
    ]
    rows = [(f"peak memory, rank {r.rank}", r.predicted_peak_bytes, r.measured_peak_bytes, format_bytes)]
    if r.plan_predicted_peak_bytes != r.predicted_peak_bytes:
        rows.append(("  as planned (gloo's copy)", r.plan_predicted_peak_bytes, r.measured_peak_bytes, format_bytes))
    for phase in PHASES:
        predicted = (r.predicted_phase_bytes or {}).get(phase)
        rows.append((f"  in {phase}", predicted, r.measured_phase_bytes.get(phase), format_bytes))
    if r.predicted_host_bytes or r.measured_host_bytes:
        rows.append(("host memory (offloaded)", r.predicted_host_bytes, r.measured_host_bytes, format_bytes))
    rows.append(("step time, compute only", r.predicted_compute_s, r.measured_compute_s, _seconds))
    rows += [(f"  in {phase}", (r.predicted_phase_s or {}).get(phase), r.measured_phase_s.get(phase), _seconds)
             for phase in PHASES if phase in r.measured_phase_s]
    for label, predicted, measured, fmt in rows:
        ratio = f"{measured / predicted:.2f}" if measured is not None and predicted else "-"
        lines.append(f"{label:28}{_dash(predicted, fmt):>14}{_dash(measured, fmt):>14}{ratio:>21}")
    lines.append(f"  predicted: {r.prediction_basis}")
    lines.append(f"  predicted peak at: {r.predicted_peak_point}; the plan's limit: {format_bytes(r.mem_limit_bytes)}"
                 + ("" if r.measured_peak_bytes <= r.mem_limit_bytes else " (MEASURED OVER THE LIMIT)"))
    lines.append(f"  measured memory: {r.mem_source}")
    if r.cuda_max_allocated_bytes is not None:
        lines.append(f"  CUDA: max_memory_allocated {format_bytes(r.cuda_max_allocated_bytes)}, "
                     f"max_memory_reserved {format_bytes(r.cuda_max_reserved_bytes)}")
    times = r.untracked_step_times_s or r.step_times_s
    lines.append("  step times (compute only" + (", memory tracker off" if r.untracked_step_times_s else "")
                 + "): " + ", ".join(f"{t:.3f}s" for t in times))
    overhead = not any("per-unit overhead" in note for note in r.not_exercised)  # priced where the profile is here
    lines.append("  predicted compute: the units' forward and backward" + (" and FSDP2's per-unit overhead" if overhead
                 else "") + " x accumulation + the optimizer step, no collectives (the plan's whole step: "
                 f"{_seconds(r.predicted_step_s)})")
    if r.measured_host_bytes and r.device == "cpu":
        lines.append("  note: on the CPU the host is the device: the offloaded state is in the peak too (measured, "
                     "and predicted by a CPU profile); the host row shows its share")
    lines.extend(f"  not exercised: {note}" for note in r.not_exercised)
    return "\n".join(lines)


def _dash(value, fmt) -> str:
    return "-" if value is None else fmt(value)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"
