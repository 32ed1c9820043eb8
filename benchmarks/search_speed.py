"""Search speed: solver time and whole-command time for planning problems of growing size.

    python benchmarks/search_speed.py            # prints the table, writes benchmarks/results/search_speed.json

Whole-command time is `autoplan search` run as a subprocess (imports, tracing, solving, writing).
Targets (issue 5): solver <= 0.5 s for gpt2-1.5b, 2 s for 70B, 5 s for the 405B-class model,
30 s for 500+ units, with the optimality gap reported when a time limit stops it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = [
    ("gpt2-1.5b, 8 GB, 8 GPUs", 0.5, ["--model", "gpt2-1.5b", "--mem", "8GB"]),
    ("llama2-70b, 80 GB, 64 GPUs", 2.0,
     ["--model", "llama2-70b", "--mem", "80GB", "--nodes", "8", "--gpus-per-node", "8"]),
    ("llama3-405b (126 layers), 80 GB, 256 H100s, seq 2048", 5.0,
     ["--model", "llama3-405b", "--mem", "80GB", "--nodes", "32", "--gpus-per-node", "8",
      "--profile", "h100-sxm-80gb", "--seq-len", "2048"]),
    ("llama2-70b leaf units (every Linear/norm), 80 GB, 64 GPUs, seq 1024", 30.0,
     ["--model", "llama2-70b", "--mem", "80GB", "--nodes", "8", "--gpus-per-node", "8",
      "--granularity", "leaf", "--seq-len", "1024"]),
]


def run_case(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "plan.json"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "autoplan", "search", *args, "-o", str(out)],
                              cwd=REPO, capture_output=True, text=True)
        command_s = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"autoplan search {' '.join(args)} failed:\n{proc.stderr}")
        plan = json.loads(out.read_text())
    solver = plan["solver"]
    gap = (solver["objective_s"] - solver["bound_s"]) / solver["objective_s"]
    return {"units": len(plan["units"]), "solver_s": solver["wall_time_s"], "command_s": command_s,
            "status": solver["status"], "gap": gap, "micro_batch": plan["training"]["micro_batch_size"],
            "sweep": [(e["micro_batch_size"], e["status"]) for e in solver["micro_batch_sweep"]]}


def main() -> None:
    rows = []
    print(f"{'case':<70} {'units':>5} {'solver s':>9} {'target':>7} {'command s':>10} {'status':>9} {'gap':>8}")
    for name, target_s, args in CASES:
        result = run_case(args)
        result.update(case=name, target_solver_s=target_s, met=result["solver_s"] <= target_s)
        rows.append(result)
        print(f"{name:<70} {result['units']:>5} {result['solver_s']:>9.2f} {target_s:>7.1f} "
              f"{result['command_s']:>10.1f} {result['status']:>9} {100 * result['gap']:>7.3f}%"
              f"{'' if result['met'] else '  MISSED'}")
    out = REPO / "benchmarks" / "results" / "search_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"written to {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
