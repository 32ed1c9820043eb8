"""Shared by the benchmark scripts: make plans with `autoplan search`, execute them with
`autoplan apply`, and collect predicted beside measured."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROFILE = "cpu-gloo-2"  # measured on this machine type: CPU, gloo, 2 ranks
UNIFORM = {  # plan kind -> search flags that fix every unit's option
    "all-shard": ["--strategy", "shard"],
    "all-shard+ckpt": ["--strategy", "shard", "--checkpoint"],
    "all-shard_keep": ["--strategy", "shard_keep"],
    "all-replicate": ["--strategy", "replicate"],
    "all-replicate+ckpt": ["--strategy", "replicate", "--checkpoint"],
}


@dataclass
class Run:
    kind: str
    plan: dict
    report: dict | None
    error: str | None = None

    @property
    def predicted_peak(self) -> int:
        return self.plan["predicted"]["peak_mem_bytes"]

    @property
    def measured_peak(self) -> int:
        return self.report["measured"]["peak_mem_bytes"]

    @property
    def predicted_step_s(self) -> float:
        return self.plan["predicted"]["step_time_s"]

    @property
    def measured_step_s(self) -> float:
        return self.report["measured"]["step_time_s"]

    @property
    def measured_throughput(self) -> float:
        return self.plan["training"]["global_batch_size"] / self.measured_step_s


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def make_plan(model: str, mem: str, batch_size: int, seq_len: int, kind: str, extra: list[str] = ()) -> dict | None:
    """A plan from the solver (kind "autoplan") or a uniform one; None when it does not fit."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "plan.json"
        flags = [] if kind == "autoplan" else UNIFORM[kind]
        proc = cli("search", "--model", model, "--mem", mem, "--gpus", "2", "--seq-len", str(seq_len),
                   "--batch-size", str(batch_size), "--profile", PROFILE, *flags, *extra, "-o", str(out))
        if proc.returncode == 3:
            return None
        if proc.returncode != 0:
            raise RuntimeError(f"search failed for {model} {kind}: {proc.stderr}")
        return json.loads(out.read_text())


def execute(plan: dict, kind: str, steps: int = 5) -> Run:
    with tempfile.TemporaryDirectory() as scratch:
        plan_path, report_path = Path(scratch) / "plan.json", Path(scratch) / "report.json"
        plan_path.write_text(json.dumps(plan))
        proc = cli("apply", str(plan_path), "--steps", str(steps), "--report", str(report_path))
        if proc.returncode != 0 or not report_path.exists():
            return Run(kind, plan, None, (proc.stderr or proc.stdout)[-2000:])
        return Run(kind, plan, json.loads(report_path.read_text()))


def rel_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def summarize(errors: list[float]) -> tuple[float, float]:
    """(median |error|, worst |error|)."""
    magnitudes = [abs(e) for e in errors]
    return statistics.median(magnitudes), max(magnitudes)


def write_results(name: str, data) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
