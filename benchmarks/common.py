"""Shared by the benchmark scripts: make plans with `autoplan search`, execute many of them in one
torchrun launch (multi_worker.py: the training loop and measurement of `autoplan apply`'s ranks),
and compare predicted with measured."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autoplan.run.worker import RankResult, RunSpec

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROFILE = "cpu-gloo-2"  # measured on this machine type: CPU, gloo, 2 ranks
WARMUP_STEPS, TIMED_STEPS = 2, 5
# every plan is run this many times, one round after the other in the same launch, and its fastest
# round kept: a burst of load from a neighbour on this shared machine only ever slows a round down
# (the profile's calibration steps are measured the same way)
ROUNDS = 3
UNIFORM = {  # plan kind -> search flags that fix every unit's option
    "all-shard": ["--strategy", "shard"],
    "all-shard+ckpt": ["--strategy", "shard", "--checkpoint"],
    "all-shard_keep": ["--strategy", "shard_keep"],
    "all-replicate": ["--strategy", "replicate"],
    "all-replicate+ckpt": ["--strategy", "replicate", "--checkpoint"],
}


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def make_plan(model: str, mem: str, batch_size: int, seq_len: int, kind: str, extra: list[str] = ()) -> dict | None:
    """A plan from the solver (kind "autoplan") or a uniform one; None when it does not fit."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "plan.json"
        flags = [] if kind == "autoplan" else UNIFORM[kind]
        proc = cli("search", "--model", model, "--mem", mem, "--gpus", "2", "--seq-len", str(seq_len),
                   "--batch-size", str(batch_size), "--profile", PROFILE, *flags, *extra, "-o", str(out),
                   "--allow-over-device-mem")  # "100GB" on the CPU profile: the unconstrained peak
        if proc.returncode == 3:
            return None
        if proc.returncode != 0:
            raise RuntimeError(f"search failed for {model} {kind}: {proc.stderr}")
        return json.loads(out.read_text())


def rel_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def summarize(errors: list[float]) -> tuple[float, float]:
    """(median |error|, worst |error|)."""
    magnitudes = [abs(e) for e in errors]
    return statistics.median(magnitudes), max(magnitudes)


def compared(plan: dict, measured: dict) -> dict:
    """One executed plan's predicted and measured peak and step time, with their relative errors."""
    predicted = plan["predicted"]
    return dict(predicted_peak_bytes=predicted["peak_mem_bytes"], measured_peak_bytes=measured["peak_mem_bytes"],
                predicted_step_s=predicted["step_time_s"], measured_step_s=measured["step_time_s"],
                mem_error=rel_error(predicted["peak_mem_bytes"], measured["peak_mem_bytes"]),
                time_error=rel_error(predicted["step_time_s"], measured["step_time_s"]))


def compared_text(row: dict, mb_digits: int = 1) -> str:
    """A `compared` row's columns: peak predicted and measured (MB) and error, step predicted and measured (ms)
    and error."""
    return (f"{row['predicted_peak_bytes'] / 1e6:>12.{mb_digits}f} {row['measured_peak_bytes'] / 1e6:>9.{mb_digits}f} "
            f"{100 * row['mem_error']:>6.1f}% {row['predicted_step_s'] * 1e3:>12.1f} "
            f"{row['measured_step_s'] * 1e3:>9.1f} {100 * row['time_error']:>6.1f}%")


def group_summary(group: list[dict]) -> dict:
    """Of `compared` rows: how many, and the median and worst |error| of memory and of step time."""
    mem_median, mem_worst = summarize([r["mem_error"] for r in group])
    time_median, time_worst = summarize([r["time_error"] for r in group])
    return dict(n=len(group), mem_median=mem_median, mem_worst=mem_worst, time_median=time_median,
                time_worst=time_worst)


def summary_text(name: str, width: int, summary: dict) -> str:
    return (f"{name:<{width}} {summary['n']:>3} {100 * summary['mem_median']:>10.1f}% "
            f"{100 * summary['mem_worst']:>9.1f}% {100 * summary['time_median']:>11.1f}% "
            f"{100 * summary['time_worst']:>10.1f}%")


def write_results(name: str, data) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def decisions(plan: dict) -> tuple:
    """What makes two plans run differently: the micro-batch, the mesh and every unit's options."""
    cluster = plan["cluster"]
    return (plan["training"]["micro_batch_size"], cluster.get("tp_degree", 1), cluster.get("sequence_parallel", False),
            tuple((u["module"], u["sharding"], u["checkpoint"], u.get("offload", False), u["reshard_after_forward"],
                   u.get("tp")) for u in plan["units"]))


def execute_many(plans: list[dict], rounds: int = ROUNDS) -> list[dict | None]:
    """Run every distinct plan `rounds` times in one torchrun launch; per plan: measured step time (fastest
    round) and peak (highest round); None: failed. Plans with the same decisions are run once."""
    first: dict[tuple, dict] = {}
    for plan in plans:
        first.setdefault(decisions(plan), plan)
    distinct = list(first)
    runs = _execute_once([first[key] for _ in range(rounds) for key in distinct])
    measured = {}
    for index, key in enumerate(distinct):
        mine = [runs[r * len(distinct) + index] for r in range(rounds)]
        if any(m is None for m in mine):
            measured[key] = None
            continue
        measured[key] = {"step_time_s": min(m["step_time_s"] for m in mine),
                         "peak_mem_bytes": max(m["peak_mem_bytes"] for m in mine),
                         "phase_peak_bytes": {phase: max(m["phase_peak_bytes"][phase] for m in mine)
                                              for phase in mine[0]["phase_peak_bytes"]}}
    return [measured[decisions(plan)] for plan in plans]


def _execute_once(plans: list[dict]) -> list[dict | None]:
    """Run every plan in one torchrun launch; per plan: measured step time and peak (None: failed)."""
    with tempfile.TemporaryDirectory() as scratch:
        specs = []
        for index, plan in enumerate(plans):
            plan_path = Path(scratch) / f"plan{index}.json"
            plan_path.write_text(json.dumps(plan))
            run_dir = Path(scratch) / f"run{index}"
            run_dir.mkdir()
            specs.append(RunSpec(plan_path=str(plan_path), run_dir=str(run_dir), device="cpu",
                                 steps=TIMED_STEPS, warmup_steps=WARMUP_STEPS, dry_run=False).__dict__)
        spec_path = Path(scratch) / "specs.json"
        spec_path.write_text(json.dumps(specs))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(REPO / "benchmarks" / "multi_worker.py"), str(spec_path)],
                              cwd=REPO, capture_output=True, text=True, timeout=3600)
        measured = []
        for spec in specs:
            ranks = [RankResult.load(spec["run_dir"], rank) for rank in (0, 1)]
            if any(r is None or r.status != "ok" for r in ranks):
                error = next((r.error for r in ranks if r is not None and r.error), proc.stderr[-500:])
                print(f"  a plan failed: {error}", file=sys.stderr)
                measured.append(None)
                continue
            # on the CPU the worker times extra steps with the memory tracker off: those are the step times
            untracked = all(r.untracked_step_times_s for r in ranks)
            times = [r.untracked_step_times_s if untracked else r.step_times_s[WARMUP_STEPS:] for r in ranks]
            steps = [max(t[i] for t in times) for i in range(min(map(len, times)))]
            last = min(len(r.phase_peak_bytes_by_step) for r in ranks) - 1  # optimizer states exist from step 2
            measured.append({"step_time_s": statistics.median(steps),
                             "peak_mem_bytes": max(r.peak_mem_bytes for r in ranks),
                             "phase_peak_bytes": {phase: max(r.phase_peak_bytes_by_step[last][phase] for r in ranks)
                                                  for phase in ranks[0].phase_peak_bytes_by_step[last]}})
        return measured
