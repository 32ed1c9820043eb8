"""Predicted beside measured: the record of one `autoplan apply` run, and its printed table.

The record is a strict pydantic model (`RunReport`), written by `autoplan apply --report r.json`, so
that a script comparing runs reads fields it can trust: `schema_version` comes first, unknown fields
are refused, and a report from a newer autoplan is refused rather than misread. The checked-in JSON
Schema (run_report_schema.json beside this file) is kept equal to `RunReport.model_json_schema()` by
a test; regenerate it with `python -m autoplan.run.report > autoplan/run/run_report_schema.json`.

Measured step time is the median over the timed steps (after warm-up) of the slowest rank's step;
peak memory is the largest over ranks; the loss of a step is the mean over ranks (each rank's loss is
the mean over its equal share of the global batch, so this is the global batch's loss).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autoplan.errors import AutoplanError
from autoplan.fileio import read_versioned_json, write_text_atomic
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile
from autoplan.run.failures import failure_messages
from autoplan.run.launch import LaunchResult
from autoplan.run.stage_report import StagePeak, format_stage_peaks, stage_peaks
from autoplan.run.worker import RunSpec
from autoplan.sizes import format_bytes
from cost_models.memory import phase_of

__all__ = [
    "REPORT_SCHEMA_VERSION", "PHASES", "PhasePeaks", "PredictedRun", "MeasuredRun", "RunReport", "build_report",
    "load_report", "failure_messages", "format_report", "predicted_phase_peaks", "profile_note",
    "run_report_json_schema",
]

REPORT_SCHEMA_VERSION = 1
PHASES = ("forward", "backward", "optimizer")


class _Strict(BaseModel):
    # a diverging run's NaN loss is written as NaN (as json.dumps does) and read back, not turned into null
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class PhasePeaks(_Strict):
    """Peak bytes per rank within each phase of a step."""

    forward: int  # the forward, the loss included
    backward: int
    optimizer: int  # the optimizer step


class PredictedRun(_Strict):
    """What the plan predicted, per rank (copied from the plan file's `predicted`)."""

    peak_mem_bytes: int
    peak_point: str  # the timeline point of the peak, e.g. "bwd transformer.h.0"
    step_time_s: float
    throughput_samples_s: float
    throughput_tokens_s: float
    phase_peak_bytes: PhasePeaks | None  # the largest timeline point of each phase; None: a phase has none
    host_mem_bytes: int = 0  # offloaded units' parameters, gradients and optimizer states in host memory
    host_mem_per_node_bytes: int = 0  # the same over a node's ranks


class MeasuredRun(_Strict):
    """What the ranks measured. Lists are per step, warm-up included unless said otherwise; empty (and
    the summaries None) when no step finished on every rank."""

    step_time_s: float | None  # median of the timed steps, slowest rank's time per step
    step_times_s: list[float]  # per step, the slowest rank's time
    untracked_step_times_s: list[float]  # CPU: extra steps timed with the memory tracker off (then the median's)
    throughput_samples_s: float | None  # global batch / step_time_s
    throughput_tokens_s: float | None
    peak_mem_bytes: int | None  # largest over ranks, since the start (materialisation included)
    peak_mem_bytes_per_rank: dict[str, int]  # rank (as a string: a JSON key) -> peak
    peak_mem_bytes_by_step: list[int]  # per step, largest over ranks
    phase_peak_bytes: PhasePeaks | None  # the last step's (optimizer states exist from the second step on)
    peak_mem_source: str | None  # what peak memory counts: the CUDA allocator, or live tensors on the CPU
    peak_rss_bytes_per_rank: dict[str, int]  # for reference: the processes' resident set
    losses: list[float]  # per step, the mean over ranks (the global batch's loss)
    # offloaded units' parameters, gradients and optimizer states on the host (their storages' bytes, after the
    # last optimizer step): largest over ranks, per rank, and the most a node's ranks hold together
    host_mem_bytes: int | None = None
    host_mem_bytes_per_rank: dict[str, int] = Field(default_factory=dict)
    host_mem_per_node_bytes: int | None = None


class RunReport(_Strict):
    """The record of one `autoplan apply` run: its settings, the plan's predictions and the measurements."""

    schema_version: Literal[1] = REPORT_SCHEMA_VERSION
    status: Literal["ok", "failed", "interrupted"]  # ok: every rank finished every step; interrupted: by a signal
    plan: str  # the plan file, as given on the command line
    model: str  # the model that ran: the plan's config (or the factory given), named by what it builds
    model_note: str | None = None  # set when the plan names its model otherwise (an edited model.name)
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    # CUDA: the PYTORCH_CUDA_ALLOC_CONF the ranks ran with (the plan's unless the environment set one); None on the
    # CPU and with torch's default
    allocator_conf: str | None = None
    world_size: int = Field(ge=1)  # ranks that ran, on all nodes
    nodes: int = Field(default=1, ge=1)  # nodes the ranks ran on (torchrun's --nnodes)
    planned_world_size: int = Field(ge=1)  # ranks the plan is for (more on a dry run)
    dry_run: bool  # the plan's decisions on fewer ranks than planned: predictions do not compare directly
    data: str  # the Alpaca JSON file trained on, or "synthetic"
    warmup_steps: int
    steps: int  # timed steps after the warm-up
    micro_batch_size: int  # per rank
    grad_accum_steps: int
    global_batch_size: int  # micro_batch_size * grad_accum_steps * data-parallel ranks (world_size / tp degree)
    seq_len: int
    dtype: str  # the plan's training precision
    optimizer: str
    mem_limit_bytes: int | None  # `--mem-limit`: a rank above it fails as out of memory; None: no limit
    predicted: PredictedRun
    profile: str  # the device profile the plan was costed with
    profile_note: str | None  # set when that profile describes another kind of device than this run's
    measured: MeasuredRun
    launcher_returncode: int  # torch.distributed.run's exit status
    interrupted_by: str | None = None  # the signal that stopped the run (SIGINT, SIGTERM, SIGHUP); None if none did
    failures: list[str]  # one line per rank that did not finish (notes on a teardown hiccup when status is ok)
    # a pipelined plan: per pipeline rank, its stages' predicted peak beside its ranks' measured one
    stages: list[StagePeak] | None = Field(default=None, exclude_if=lambda value: value is None)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunReport":
        return load_report(path)

    def table(self) -> str:
        return format_report(self)

    def __str__(self) -> str:
        return self.table()


def load_report(path: str | os.PathLike) -> RunReport:
    """Read and validate a run report; every failure is an AutoplanError that says what is wrong."""
    data = read_versioned_json(path, "run report", REPORT_SCHEMA_VERSION, AutoplanError, "run the plan again")
    try:
        return RunReport.model_validate(data)
    except ValidationError as exc:
        raise AutoplanError(f"run report {path} is corrupt or incomplete:\n{exc}") from exc


def run_report_json_schema() -> dict:
    return RunReport.model_json_schema()


def predicted_phase_peaks(plan: Plan) -> dict[str, int] | None:
    """The largest predicted timeline point of each phase ("fwd ...", "bwd ...", "optimizer step")."""
    peaks: dict[str, int] = {}
    for point in plan.predicted.timeline:
        phase = phase_of(point.point)
        if phase is not None:
            peaks[phase] = max(peaks.get(phase, 0), point.total_bytes)
    return peaks if set(peaks) == set(PHASES) else None


def profile_note(plan: Plan, device: str) -> str | None:
    """Say so when the plan was costed for another kind of device than the one running it."""
    try:
        profile = load_profile(plan.cluster.profile)
    except AutoplanError:
        return f"profile {plan.cluster.profile!r} is not available here; cannot tell which device it describes"
    if profile.device_type != device:
        return (f"the plan was costed with profile {profile.name} ({profile.source}, {profile.device_type}) "
                f"and this run is on {device}: compare memory, not time")
    return None


def build_report(plan: Plan, plan_path: str, spec: RunSpec, nproc: int, launched: LaunchResult,
                 model: str | None = None, model_note: str | None = None, nodes: int = 1) -> RunReport:
    """The record of a run of `nproc` ranks in all (on `nodes` nodes); `model` names what ran (by default the
    plan's model name), `model_note` says why that differs from the plan's."""
    training = plan.training
    # a tensor- or context-parallel group (and a pipeline's stages) share micro-batches: data-parallel ranks make it
    ranks_per_row = plan.cluster.tp_degree * plan.cluster.cp_degree * plan.cluster.pp_degree
    global_batch = training.micro_batch_size * training.grad_accum_steps * max(nproc // ranks_per_row, 1)
    results = [r for r in launched.ranks.values() if r is not None]
    all_ok = len(results) == nproc and all(r.status == "ok" for r in results)
    return RunReport(
        status="ok" if all_ok else "interrupted" if launched.interrupted else "failed",
        plan=plan_path, model=model or plan.model.name, model_note=model_note, device=spec.device,
        backend="nccl" if spec.device == "cuda" else "gloo", allocator_conf=spec.allocator_conf,
        world_size=nproc, nodes=nodes, planned_world_size=plan.cluster.world_size, dry_run=spec.dry_run,
        data=spec.data_path or "synthetic", warmup_steps=spec.warmup_steps, steps=spec.steps,
        micro_batch_size=training.micro_batch_size, grad_accum_steps=training.grad_accum_steps,
        global_batch_size=global_batch, seq_len=training.seq_len, dtype=training.dtype,
        optimizer=training.optimizer, mem_limit_bytes=spec.mem_limit_bytes, predicted=_predicted(plan),
        profile=plan.cluster.profile, profile_note=profile_note(plan, spec.device),
        measured=_measured(plan, spec.warmup_steps, results, (nproc, nodes), global_batch),
        launcher_returncode=launched.returncode, interrupted_by=launched.interrupted,
        failures=failure_messages(plan, nproc, launched), stages=stage_peaks(plan, results),
    )


def _predicted(plan: Plan) -> PredictedRun:
    predicted = plan.predicted
    return PredictedRun(
        peak_mem_bytes=predicted.peak_mem_bytes, peak_point=predicted.peak_point, step_time_s=predicted.step_time_s,
        throughput_samples_s=predicted.throughput_samples_s, throughput_tokens_s=predicted.throughput_tokens_s,
        phase_peak_bytes=predicted_phase_peaks(plan), host_mem_bytes=predicted.host_mem_bytes,
        host_mem_per_node_bytes=predicted.host_mem_per_node_bytes,
    )


def _measured(plan: Plan, warmup_steps: int, results: list, ranks_and_nodes: tuple[int, int],
              global_batch: int) -> MeasuredRun:
    """What the ranks measured, over the steps every one of the run's ranks finished (none where a rank is
    silent)."""
    nproc, nodes = ranks_and_nodes
    steps_all_ranks = min((r.steps_done for r in results), default=0) if len(results) == nproc else 0
    step_times_s = [max(r.step_times_s[i] for r in results) for i in range(steps_all_ranks)]
    timed_s = step_times_s[warmup_steps:]
    untracked = min((len(r.untracked_step_times_s) for r in results), default=0) if len(results) == nproc else 0
    untracked_s = [max(r.untracked_step_times_s[i] for r in results) for i in range(untracked)]
    if untracked_s:  # CPU: the memory tracker slows the steps it watches; time the ones it did not
        timed_s = untracked_s
    step_time_s = statistics.median(timed_s) if timed_s else None
    return MeasuredRun(
        step_time_s=step_time_s, step_times_s=step_times_s, untracked_step_times_s=untracked_s,
        throughput_samples_s=global_batch / step_time_s if step_time_s else None,
        throughput_tokens_s=global_batch * plan.training.seq_len / step_time_s if step_time_s else None,
        peak_mem_bytes=max((r.peak_mem_bytes for r in results), default=None),
        peak_mem_bytes_per_rank={str(r.rank): r.peak_mem_bytes for r in results},
        peak_mem_bytes_by_step=[max(r.peak_mem_bytes_by_step[i] for r in results) for i in range(steps_all_ranks)],
        # the last step's phases: optimizer states exist from the second step on (a pipeline's schedule interleaves
        # forwards and backwards: its peaks are per stage instead)
        phase_peak_bytes={
            phase: max(r.phase_peak_bytes_by_step[steps_all_ranks - 1][phase] for r in results) for phase in PHASES
        } if steps_all_ranks and plan.pipeline is None else None,
        peak_mem_source=results[0].mem_source if results else None,
        peak_rss_bytes_per_rank={str(r.rank): r.peak_rss_bytes for r in results},
        losses=[statistics.fmean(r.losses[i] for r in results) for i in range(steps_all_ranks)],
        **_measured_host(plan, results, nproc, nodes),
    )


def _measured_host(plan: Plan, results: list, nproc: int, nodes: int) -> dict:
    """The measured host memory of offloaded state: nothing where no unit is offloaded. A node's ranks are
    consecutive (torchrun's static rendezvous: node k runs ranks k * ranks_per_node onwards)."""
    if not any(unit.offload for unit in plan.units) or not results:
        return {}
    per_rank = {r.rank: r.host_state_bytes for r in results}
    per_node = max(nproc // nodes, 1)
    by_node: dict[int, int] = {}
    for rank, nbytes in per_rank.items():
        by_node[rank // per_node] = by_node.get(rank // per_node, 0) + nbytes
    return {"host_mem_bytes": max(per_rank.values()),
            "host_mem_bytes_per_rank": {str(rank): nbytes for rank, nbytes in sorted(per_rank.items())},
            "host_mem_per_node_bytes": max(by_node.values())}


def format_report(report: RunReport) -> str:
    """The predicted-vs-measured table printed at the end of a run."""
    return "\n".join([*_heading(report), *_comparison(report), *_details(report)])


def _heading(r: RunReport) -> list[str]:
    """What ran, and on a dry run why its figures do not compare directly."""
    on_nodes = f" on {r.nodes} nodes" if r.nodes > 1 else ""
    lines = [
        f"autoplan apply: {r.model} on {r.world_size} rank(s){on_nodes} ({r.device}, {r.backend}"
        + (f", {r.allocator_conf}" if r.allocator_conf else "") + "), "
        f"{r.dtype}, {r.optimizer}, micro-batch {r.micro_batch_size} x "
        f"{r.grad_accum_steps} accum x {r.world_size} ranks = global batch "
        f"{r.global_batch_size}, seq {r.seq_len}, data {r.data}",
    ]
    if r.dry_run:
        lines.append(
            f"DRY RUN: the plan is for {r.planned_world_size} ranks; its decisions ran on "
            f"{r.world_size}. Predictions are for {r.planned_world_size} ranks and do not "
            "compare directly (shards are larger, the global batch smaller)."
        )
    return lines


def _comparison(r: RunReport) -> list[str]:
    """The table: each figure predicted, measured and their ratio; host memory where units are offloaded."""
    predicted, measured = r.predicted, r.measured
    rows = [
        ("step time (median)", predicted.step_time_s, measured.step_time_s, _seconds),
        ("throughput, samples/s", predicted.throughput_samples_s, measured.throughput_samples_s, _rate),
        ("throughput, tokens/s", predicted.throughput_tokens_s, measured.throughput_tokens_s, _rate),
        ("peak memory per rank", predicted.peak_mem_bytes, measured.peak_mem_bytes, format_bytes),
    ]
    lines = [f"{'':24}{'predicted':>14}{'measured':>14}{'measured/predicted':>21}"]
    phase_pred, phase_meas = predicted.phase_peak_bytes, measured.phase_peak_bytes
    for phase in PHASES:
        rows.append((f"  in {phase}", getattr(phase_pred, phase, None), getattr(phase_meas, phase, None),
                     format_bytes))
    offloaded = predicted.host_mem_bytes or measured.host_mem_bytes is not None
    if offloaded:  # host memory beside device memory
        rows.append(("host memory per rank", predicted.host_mem_bytes, measured.host_mem_bytes, format_bytes))
        rows.append(("host memory per node", predicted.host_mem_per_node_bytes, measured.host_mem_per_node_bytes,
                     format_bytes))
    for label, pred, meas, fmt in rows:
        ratio = f"{meas / pred:.2f}" if meas is not None and pred else "-"
        lines.append(f"{label:24}{_or_dash(pred, fmt):>14}{_or_dash(meas, fmt):>14}{ratio:>21}")
    lines += format_stage_peaks(r.stages)  # a pipeline: per stage
    if offloaded:
        lines.append("  host memory: offloaded units' parameters, gradients and optimizer states (measured: their "
                     "storages after the last optimizer step)")
        if r.device == "cpu":
            lines.append("  note: on the CPU the host is the device: the offloaded state is in the peak memory too "
                         "(measured, and predicted by a CPU profile); the host rows show its share")
    return lines


def _details(r: RunReport) -> list[str]:
    """Notes, where the peaks were, and the measurements step by step."""
    measured = r.measured
    lines = [f"  note: {note}" for note in (r.profile_note, r.model_note) if note]
    lines.append(f"  predicted peak at: {r.predicted.peak_point}")
    lines.append(f"  measured memory: {measured.peak_mem_source}, max over ranks")
    rss = measured.peak_rss_bytes_per_rank
    if rss:
        lines.append("  peak RSS per rank (for reference): " + ", ".join(
            f"rank {rank} {format_bytes(value)}" for rank, value in rss.items()))
    if measured.peak_mem_bytes_by_step:
        lines.append("  peak memory by step: " + ", ".join(format_bytes(v) for v in measured.peak_mem_bytes_by_step))
    if measured.step_times_s:
        warmup = r.warmup_steps
        lines.append("  step times: " + ", ".join(
            f"{t:.3f}s" + ("*" if i < warmup else "") for i, t in enumerate(measured.step_times_s))
            + ("  (* warm-up, not in the median)" if warmup else ""))
    if measured.untracked_step_times_s:
        lines.append("  step times, memory tracker off (the median's steps): " + ", ".join(
            f"{t:.3f}s" for t in measured.untracked_step_times_s))
    if measured.losses:
        lines.append(f"  loss by step, mean over the {r.world_size} rank(s) (the global batch's loss): "
                     + ", ".join(f"{loss:.4f}" for loss in measured.losses))
    return lines


def _or_dash(value, fmt) -> str:
    return "-" if value is None else fmt(value)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"


def _rate(value: float) -> str:
    return f"{value:,.1f}"


if __name__ == "__main__":
    print(json.dumps(run_report_json_schema(), indent=2, sort_keys=True))
