"""The native allocator bound's category weights (cost_models.allocator_margin.NATIVE) fitted to the replays of
benchmarks/allocator.py: how they were chosen, and how far category weights can go.

Why: the native bound is, at each time point, each memory category's bytes times a weight plus the slack; the
weights are the smallest that keep every replayed plan's `needed` within its bound. This fits them again from the
results files (benchmarks/results/allocator.json, the grid; allocator_default.json, the default plans made for the
native configuration), as a linear programme (OR-Tools GLOP): weights at least 1, each replay's bound at its point
at least its needed limit x (1 + --margin), the sum of bound/needed the least. A bound is the highest of a plan's
points, so which point must reach the need is a choice: each replay's highest point under the weights of the
round before, from NATIVE's, until the weights settle. `--by-model` fits each model's replays alone: were the
weights known per model, how close would category weights come.

    python benchmarks/allocator.py && python benchmarks/allocator.py --default --conf native  # the replays
    python benchmarks/allocator_weights.py [--by-model] [--margin 0.01]
"""

from __future__ import annotations

import argparse
import json
import math

from common import RESULTS
from ortools.linear_solver import pywraplp

from cost_models.allocator import SEGMENT_SLACK
from cost_models.allocator_margin import NATIVE
from cost_models.memory import CATEGORIES

NAMES = [c.value for c in CATEGORIES]
ROUNDS = 10


def timeline_parts(plan) -> list[dict]:
    """The points of `plan`'s predicted timeline, bytes by memory category ("params", ...), that no other point
    equals or passes in every category: the only ones a bound of positive weights per category can peak at."""
    parts = [{k.removesuffix("_bytes"): v for k, v in p.breakdown.model_dump().items()} for p in plan.predicted.timeline]
    unique = [dict(t) for t in dict.fromkeys(tuple(sorted(p.items())) for p in parts)]
    return [p for p in unique if not any(q is not p and all(q[c] >= p[c] for c in p) for q in unique)]


def packed(parts: list[dict]) -> list[str]:
    """Timeline parts as the results files keep them: a line of bytes per point, in CATEGORIES' order."""
    return [" ".join(str(p[c.value]) for c in CATEGORIES) for p in parts]


def stranded_text(where) -> str:
    """Where a limit 2 MiB under the need fails: the free bytes live blocks keep, by segment size (the largest)."""
    mib, gib = 2 ** 20, 2 ** 30
    top = sorted(where.by_segment.items(), key=lambda item: -item[1])[:4]
    return (f"stranded {where.total / gib:.2f} GiB at a {where.request / mib:.0f} MiB request (event {where.event}): "
            + ", ".join(f"{free / mib:.0f} MiB in {size / mib:.0f} MiB segments" for size, free in top))


def replays() -> list[dict]:
    """(label, model, timeline parts, needed limit with the slack) of every native replay in the results files."""
    rows = []
    for row in json.loads((RESULTS / "allocator.json").read_text())["rows"]:
        rows.append({"label": f"{row['plan']} mb{row['micro_batch']}", "model": row["model"],
                     "parts": unpacked(row["parts"]), "needed": row["needed_limit_bytes"]})
    for row in json.loads((RESULTS / "allocator_default.json").read_text())["rows"]:
        if row.get("allocator_conf") == "expandable_segments:False" and "parts" in row:
            rows.append({"label": f"{row['model']} default @ {row['limit']}", "model": row["model"],
                         "parts": unpacked(row["parts"]), "needed": row["needed_bytes"]})
    return rows


def unpacked(lines: list[str]) -> list[dict]:
    """A results file's timeline parts (benchmarks/allocator.py's `packed`): bytes by category per point."""
    return [dict(zip(NAMES, map(int, line.split()))) for line in lines]


def bound(parts: list[dict], weights: dict[str, float]) -> float:
    return max(sum(p[c] * weights[c] for c in NAMES) for p in parts) + SEGMENT_SLACK


def fit(rows: list[dict], margin: float) -> dict[str, float]:
    """The least weights (at least 1) whose bound reaches every replay's need x (1 + margin)."""
    weights = dict(NATIVE.weights)
    for _ in range(ROUNDS):
        solver = pywraplp.Solver.CreateSolver("GLOP")
        w = {c: solver.NumVar(1.0, 4.0, c) for c in NAMES}
        gib, objective = 2 ** 30, 0
        for row in rows:
            point = max(row["parts"], key=lambda p: sum(p[c] * weights[c] for c in NAMES))
            expr = sum(point[c] / gib * w[c] for c in NAMES) + SEGMENT_SLACK / gib
            solver.Add(expr >= row["needed"] * (1 + margin) / gib)
            objective += expr * (gib / row["needed"])
        solver.Minimize(objective)
        if solver.Solve() != pywraplp.Solver.OPTIMAL:
            raise SystemExit("no weights at least 1 bound every replay")
        new = {c: w[c].solution_value() for c in NAMES}
        settled = all(math.isclose(new[c], weights[c], abs_tol=1e-6) for c in NAMES)
        weights = new
        if settled:
            break
    return weights


def show(title: str, rows: list[dict], weights: dict[str, float]) -> None:
    print(f"{title}: " + ", ".join(f"{c} {weights[c]:.3f}" for c in NAMES))
    for row in rows:
        print(f"  {row['label']:<48} needed {row['needed'] / 2 ** 30:6.2f} GiB  bound/needed: NATIVE "
              f"{bound(row['parts'], NATIVE.weights) / row['needed']:.3f}, fitted {bound(row['parts'], weights) / row['needed']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--by-model", action="store_true", help="fit each model's replays alone as well")
    parser.add_argument("--margin", type=float, default=0.01, help="each bound at least needed x (1 + this)")
    args = parser.parse_args()
    rows = replays()
    show(f"all {len(rows)} replays", rows, fit(rows, args.margin))
    if args.by_model:
        for model in sorted({row["model"] for row in rows}):
            mine = [row for row in rows if row["model"] == model]
            show(f"{model} alone ({len(mine)} replays)", mine, fit(mine, args.margin))


if __name__ == "__main__":
    main()
