"""Predicted beside measured: the record of one `autoplan apply` run, and its printed table.

Measured step time is the median over the timed steps (after warm-up) of the slowest rank's step;
peak memory is the largest over ranks; the loss of a step is the mean over ranks (each rank's loss is
the mean over its equal share of the global batch, so this is the global batch's loss).
"""

from __future__ import annotations

import statistics

from autoplan.errors import AutoplanError
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile
from autoplan.run.launch import LaunchResult
from autoplan.run.worker import RunSpec
from autoplan.sizes import format_bytes

REPORT_VERSION = 1
PHASES = ("forward", "backward", "optimizer")
_PHASE_OF_POINT = {"fwd": "forward", "bwd": "backward", "optimizer": "optimizer"}


def predicted_phase_peaks(plan: Plan) -> dict[str, int] | None:
    """The largest predicted timeline point of each phase ("fwd ...", "bwd ...", "optimizer step")."""
    peaks: dict[str, int] = {}
    for point in plan.predicted.timeline:
        phase = _PHASE_OF_POINT.get(point.point.split(" ", 1)[0])
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


def build_report(plan: Plan, plan_path: str, spec: RunSpec, nproc: int, launched: LaunchResult) -> dict:
    training = plan.training
    ranks = launched.ranks
    global_batch = training.micro_batch_size * training.grad_accum_steps * nproc
    results = [r for r in ranks.values() if r is not None]
    all_ok = len(results) == nproc and all(r.status == "ok" for r in results)

    steps_all_ranks = min((r.steps_done for r in results), default=0) if len(results) == nproc else 0
    step_times_s = [max(r.step_times_s[i] for r in results) for i in range(steps_all_ranks)]
    losses = [statistics.fmean(r.losses[i] for r in results) for i in range(steps_all_ranks)]
    timed_s = step_times_s[spec.warmup_steps:]
    untracked = min((len(r.untracked_step_times_s) for r in results), default=0) if len(results) == nproc else 0
    untracked_s = [max(r.untracked_step_times_s[i] for r in results) for i in range(untracked)]
    if untracked_s:  # CPU: the memory tracker slows the steps it watches; time the ones it did not
        timed_s = untracked_s
    step_time_s = statistics.median(timed_s) if timed_s else None

    measured = {
        "step_time_s": step_time_s,
        "step_times_s": step_times_s,
        "untracked_step_times_s": untracked_s,
        "throughput_samples_s": global_batch / step_time_s if step_time_s else None,
        "throughput_tokens_s": global_batch * training.seq_len / step_time_s if step_time_s else None,
        "peak_mem_bytes": max((r.peak_mem_bytes for r in results), default=None),
        "peak_mem_bytes_per_rank": {str(r.rank): r.peak_mem_bytes for r in results},
        "peak_mem_bytes_by_step": [max(r.peak_mem_bytes_by_step[i] for r in results) for i in range(steps_all_ranks)],
        # the last step's phases: optimizer states exist from the second step on
        "phase_peak_bytes": {
            phase: max(r.phase_peak_bytes_by_step[steps_all_ranks - 1][phase] for r in results) for phase in PHASES
        } if steps_all_ranks else None,
        "peak_mem_source": results[0].mem_source if results else None,
        "peak_rss_bytes_per_rank": {str(r.rank): r.peak_rss_bytes for r in results},
        "losses": losses,
    }
    predicted = plan.predicted
    return {
        "report_version": REPORT_VERSION,
        "status": "ok" if all_ok else "failed",
        "plan": plan_path,
        "model": plan.model.name,
        "device": spec.device,
        "backend": "nccl" if spec.device == "cuda" else "gloo",
        "world_size": nproc,
        "planned_world_size": plan.cluster.world_size,
        "dry_run": spec.dry_run,
        "data": spec.data_path or "synthetic",
        "warmup_steps": spec.warmup_steps,
        "steps": spec.steps,
        "micro_batch_size": training.micro_batch_size,
        "grad_accum_steps": training.grad_accum_steps,
        "global_batch_size": global_batch,
        "seq_len": training.seq_len,
        "dtype": training.dtype,
        "optimizer": training.optimizer,
        "mem_limit_bytes": spec.mem_limit_bytes,
        "predicted": {
            "peak_mem_bytes": predicted.peak_mem_bytes,
            "peak_point": predicted.peak_point,
            "step_time_s": predicted.step_time_s,
            "throughput_samples_s": predicted.throughput_samples_s,
            "throughput_tokens_s": predicted.throughput_tokens_s,
            "phase_peak_bytes": predicted_phase_peaks(plan),
        },
        "profile": plan.cluster.profile,
        "profile_note": profile_note(plan, spec.device),
        "measured": measured,
        "launcher_returncode": launched.returncode,
        "failures": failure_messages(plan, nproc, launched),
    }


def failure_messages(plan: Plan, nproc: int, launched: LaunchResult) -> list[str]:
    """One line per rank that did not finish: which rank, what happened, predicted and measured memory.

    Causes come before consequences: a rank killed by a signal first (its peers' collectives fail
    because it is gone), then ranks out of memory, ranks with an error, and last the ranks the
    launcher stopped (SIGTERM) once another had failed.
    """
    predicted_mem = format_bytes(plan.predicted.peak_mem_bytes)
    first = launched.first_failed_rank
    entries: list[tuple[int, int, str]] = []  # (order, rank, message)
    for rank in range(nproc):
        result, failure = launched.ranks.get(rank), launched.failures.get(rank)
        if result is not None and result.status == "ok":
            if failure is not None:
                entries.append((4, rank, f"rank {rank} finished and wrote its results, then exited with status "
                                         f"{failure.exitcode} ({failure.signal or 'no signal'}) while shutting down"))
            continue
        where = "while starting" if result is None or result.phase == "starting" else f"at step {result.steps_done + 1}"
        measured = (f"measured peak so far {format_bytes(result.peak_mem_bytes)} ({result.mem_source})"
                    if result is not None else "nothing measured")
        stopped = failure is None or (failure.signal == "SIGTERM" and first is not None and first != rank)
        if result is not None and result.status == "oom":
            entries.append((1, rank, f"rank {rank} ran out of memory {where}: {result.error}; "
                                     f"predicted peak {predicted_mem}, {measured}"))
        elif result is not None and result.status == "failed":
            entries.append((2, rank, f"rank {rank} failed {where}: {result.error}; predicted peak {predicted_mem}, {measured}"))
        elif not stopped:
            how = f"was killed by {failure.signal}" if failure.signal else f"exited with status {failure.exitcode}"
            entries.append((0, rank, f"rank {rank} died {where}: it {how}; predicted peak {predicted_mem}, {measured}"))
        else:
            entries.append((3, rank, f"rank {rank} was stopped by the launcher {where}, after another rank failed; {measured}"))
    messages = [message for _, _, message in sorted(entries)]
    if not messages and launched.returncode != 0:
        messages.append(f"every rank finished and wrote its results, but the launcher exited with status {launched.returncode}")
    return messages


def format_report(report: dict) -> str:
    """The predicted-vs-measured table printed at the end of a run."""
    predicted, measured = report["predicted"], report["measured"]
    lines = [
        f"autoplan apply: {report['model']} on {report['world_size']} rank(s) ({report['device']}, {report['backend']}), "
        f"{report['dtype']}, {report['optimizer']}, micro-batch {report['micro_batch_size']} x "
        f"{report['grad_accum_steps']} accum x {report['world_size']} ranks = global batch "
        f"{report['global_batch_size']}, seq {report['seq_len']}, data {report['data']}",
    ]
    if report["dry_run"]:
        lines.append(
            f"DRY RUN: the plan is for {report['planned_world_size']} ranks; its decisions ran on "
            f"{report['world_size']}. Predictions are for {report['planned_world_size']} ranks and do not "
            "compare directly (shards are larger, the global batch smaller)."
        )
    rows = [
        ("step time (median)", predicted["step_time_s"], measured["step_time_s"], _seconds),
        ("throughput, samples/s", predicted["throughput_samples_s"], measured["throughput_samples_s"], _rate),
        ("throughput, tokens/s", predicted["throughput_tokens_s"], measured["throughput_tokens_s"], _rate),
        ("peak memory per rank", predicted["peak_mem_bytes"], measured["peak_mem_bytes"], format_bytes),
    ]
    lines.append(f"{'':24}{'predicted':>14}{'measured':>14}{'measured/predicted':>21}")
    phase_pred, phase_meas = predicted["phase_peak_bytes"] or {}, measured["phase_peak_bytes"] or {}
    for phase in PHASES:
        rows.append((f"  in {phase}", phase_pred.get(phase), phase_meas.get(phase), format_bytes))
    for label, pred, meas, fmt in rows:
        ratio = f"{meas / pred:.2f}" if meas is not None and pred else "-"
        lines.append(f"{label:24}{_or_dash(pred, fmt):>14}{_or_dash(meas, fmt):>14}{ratio:>21}")
    if report["profile_note"]:
        lines.append(f"  note: {report['profile_note']}")
    lines.append(f"  predicted peak at: {predicted['peak_point']}")
    lines.append(f"  measured memory: {measured['peak_mem_source']}, max over ranks")
    rss = measured["peak_rss_bytes_per_rank"]
    if rss:
        lines.append("  peak RSS per rank (for reference): " + ", ".join(
            f"rank {rank} {format_bytes(value)}" for rank, value in rss.items()))
    if measured["peak_mem_bytes_by_step"]:
        lines.append("  peak memory by step: " + ", ".join(format_bytes(v) for v in measured["peak_mem_bytes_by_step"]))
    if measured["step_times_s"]:
        warmup = report["warmup_steps"]
        lines.append("  step times: " + ", ".join(
            f"{t:.3f}s" + ("*" if i < warmup else "") for i, t in enumerate(measured["step_times_s"]))
            + ("  (* warm-up, not in the median)" if warmup else ""))
    if measured.get("untracked_step_times_s"):
        lines.append("  step times, memory tracker off (the median's steps): " + ", ".join(
            f"{t:.3f}s" for t in measured["untracked_step_times_s"]))
    if measured["losses"]:
        lines.append("  loss by step: " + ", ".join(f"{loss:.4f}" for loss in measured["losses"]))
    return "\n".join(lines)


def _or_dash(value, fmt) -> str:
    return "-" if value is None else fmt(value)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"


def _rate(value: float) -> str:
    return f"{value:,.1f}"
