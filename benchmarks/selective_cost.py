"""What a selectively checkpointed block cost beyond its prediction in a GPU kit run, read from its results.

Why: the kit runs each model at each micro-batch under three plans, all-shard (no block checkpointed), all-shard +
full checkpointing, and the solver's, which mixes the modes. Taking the first two plans' misses (measured -
predicted compute, collectives free) as their blocks' share, what is left of the solver's plan's miss, divided by
its selectively checkpointed blocks, is what one such block cost beyond the step model's figure. The per-unit
overhead the step model adds is the same for every mode, so it cancels (benchmarks/RESULTS.md section 9, fifth
run).

    python benchmarks/selective_cost.py benchmarks/results/gpu_truth_cuda_run4 benchmarks/results/gpu_truth_cuda_run5

It prints first each kind of plan's compute-time error (predicted / measured - 1): range and median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path


def selective_costs(folder: Path) -> list[tuple[str, int, int, float]]:
    """(the solver's plan, its selective blocks, its blocks, ms a selective block cost beyond its prediction) of
    each row of the kit run in `folder` whose plan has selective blocks."""
    grid = json.loads((folder / "gpu_truth.json").read_text())["stages"]["grid"]["rows"]
    plans = json.loads((folder / "plans.json").read_text())
    misses, modes = {}, {}
    for row in grid:
        if row.get("status") == "ok" and row["plan_key"] in plans:
            misses[row["plan_key"]] = row["measured_compute_s"] - row["predicted_compute_s"]
            modes[row["plan_key"]] = Counter(unit["checkpoint"] for unit in plans[row["plan_key"]]["units"]
                                             if unit["module"].split(".")[-1].isdigit())
    out = []
    for key, count in modes.items():
        base = key.removesuffix("autoplan")
        if base == key or not count["selective"] or base + "all-shard" not in misses \
                or base + "all-shard+ckpt" not in misses:
            continue
        blocks = sum(count.values())
        rest = (count["full"] * misses[base + "all-shard+ckpt"] + count["none"] * misses[base + "all-shard"]) / blocks
        out.append((key, count["selective"], blocks, (misses[key] - rest) / count["selective"] * 1e3))
    return out


def errors_by_plan(folder: Path) -> dict[str, list[float]]:
    """Each kind of grid plan's compute-time errors (predicted / measured - 1) in the kit run in `folder`."""
    grid = json.loads((folder / "gpu_truth.json").read_text())["stages"]["grid"]["rows"]
    kinds: dict[str, list[float]] = {}
    for row in grid:
        if row.get("status") == "ok" and row.get("measured_compute_s"):
            kind = row["plan"].split("@")[0]  # all-shard@tp2 is an all-shard plan
            kinds.setdefault(kind, []).append(row["predicted_compute_s"] / row["measured_compute_s"] - 1)
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+", help="GPU kit runs (gpu_truth.py --out folders)")
    args = parser.parse_args()
    for folder in args.folders:
        print(folder)
        for kind, errors in errors_by_plan(folder).items():
            print(f"  {kind:<16} {len(errors):2d} rows: compute time {min(errors):+.1%} to {max(errors):+.1%}, "
                  f"median {statistics.median(errors):+.1%}")
        for key, selective, blocks, ms in selective_costs(folder):
            print(f"  {key:<34} {selective:2d} of {blocks:2d} blocks selective: {ms:+5.1f} ms a selective block")


if __name__ == "__main__":
    main()
