"""The allocator bounds' constants (cost_models.allocator_margin) fitted to the replays of benchmarks/allocator.py:
how they were chosen, and how far they can go.

Why: the native bound is, at each time point, each memory category's bytes times a weight plus the slack; the
weights are the smallest that keep every replayed plan's `needed` within its bound. This fits them again from the
results files (benchmarks/results/allocator.json, the grid; allocator_default*.json, the default plans made for the
native configuration, every round kept: `default_rows`), as a linear programme (OR-Tools GLOP): weights at least 1,
each replay's bound at its point at least its needed limit x (1 + --margin), the sum of bound/needed the least. A
bound is the highest of a plan's points, so which point must reach the need is a choice: each replay's highest
point under the weights of the round before, from NATIVE's, until the weights settle. `--by-model` fits each
model's replays alone: were the weights known per model, how close would category weights come. `--stranding`
fits the bound the search plans to (allocator_margin.native_margin): the activations weighted by a base plus a
coefficient x what each replay's model strands in a simulation of its forward at its micro-batch and
tensor-parallel layout (cost_models.stranding; the models traced here, a few seconds), fitted with the weights.
`--expandable` fits expandable_margin (live bytes x (1 + factor), a coefficient x the model's simulated selective
stranding x the selective units' activations, a slack) to the replays with expandable segments (each at most its
bound / 1.005).

    python benchmarks/allocator.py && python benchmarks/allocator.py --default  # the replays
    python benchmarks/allocator_weights.py [--by-model] [--stranding] [--expandable] [--margin M]
"""

from __future__ import annotations

import argparse
import json
import math

from common import RESULTS
from ortools.linear_solver import pywraplp

from cost_models.allocator import SEGMENT_SLACK
from cost_models.allocator_margin import (
    EXPANDABLE,
    EXPANDABLE_BY_SIZES,
    EXPANDABLE_STRANDING,
    NATIVE,
    NATIVE_BY_SIZES,
    STRANDING,
)
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
                     "seq_len": row["seq_len"], "micro_batch": row["micro_batch"], "parts": unpacked(row["parts"]),
                     "needed": row["needed_limit_bytes"], **grid_tp(row)})
    for row in default_rows():
        if row.get("allocator_conf") == "expandable_segments:False" and "parts" in row:
            rows.append({"label": f"{row['model']} default @ {row['limit']}", "model": row["model"],
                         "seq_len": row["seq_len"], "micro_batch": row["micro_batch"], "parts": unpacked(row["parts"]),
                         "needed": row["needed_bytes"], **default_tp(row)})
    return rows


def grid_tp(row: dict) -> dict:
    """A grid plan's tensor-parallel degree (its label's "tpN"; sequence parallelism off, as the grid makes them)."""
    degree = next((int(word[2:]) for word in row["plan"].split() if word.startswith("tp")), 1)
    return {"tp": degree, "sp": False} if degree > 1 else {}


def default_tp(row: dict) -> dict:
    """A default plan's tensor-parallel degree and sequence parallelism (where its run recorded it)."""
    return {key: row[key] for key in ("tp", "sp") if key in row}


def default_rows() -> list[dict]:
    """The default plans' replays of every round kept: the plans made under the bound before the simulated
    stranding (allocator_default_prior.json), the rounds made while fitting it (allocator_default_round*.json) and
    the last run (allocator_default.json)."""
    files = [RESULTS / "allocator_default_prior.json", *sorted(RESULTS.glob("allocator_default_round*.json")),
             RESULTS / "allocator_default.json"]
    rows = [row for path in files if path.exists() for row in json.loads(path.read_text())["rows"]]
    unique = {(r["model"], r.get("limit"), r.get("allocator_conf"), r.get("peak_bytes"), r.get("needed_bytes")): r
              for r in rows}  # a plan replayed again: once
    return list(unique.values())


def unpacked(lines: list[str]) -> list[dict]:
    """A results file's timeline parts (benchmarks/allocator.py's `packed`): bytes by category per point."""
    return [dict(zip(NAMES, map(int, line.split()))) for line in lines]


def bound(parts: list[dict], weights: dict[str, float]) -> float:
    return max(sum(p[c] * weights[c] for c in NAMES) for p in parts) + SEGMENT_SLACK


def add_stranding(rows: list[dict], expandable: bool = False) -> None:
    """Each replay's `stranding`: what its model strands in a simulation of its forward at its micro-batch and
    tensor-parallel layout, as the search finds it (autoplan.solve.request.model_stranding; `expandable`: with
    expandable segments). A tensor-parallel default plan of a run that did not record its sequence parallelism
    takes the lesser of the two (the bound it is fitted to is then at most the search's)."""
    from autoplan.api.estimate import request_layout
    from autoplan.api.prepare import prepare
    from autoplan.settings import EstimateSettings
    from autoplan.solve.expert_tables import mesh_source
    from autoplan.solve.request import model_stranding

    sources = {}
    for row in rows:
        tp = row.get("tp", 1)
        found = []
        for sp in (["on" if row["sp"] else "off"] if "sp" in row else ["off", "on"]) if tp > 1 else [None]:
            key = (row["model"], row["seq_len"], tp, sp)
            if key not in sources:
                settings = EstimateSettings(model=row["model"], seq_len=row["seq_len"], gpus=8,
                                            profile="h100-sxm-80gb", tp=tp, sequence_parallel=sp)
                request = prepare(settings)
                sources[key] = mesh_source(request, request.meshes[0], request_layout(request))
            found.append(model_stranding(sources[key], row["micro_batch"], expandable))
        row["stranding"] = min(found)


def with_stranding(weights: dict[str, float], row: dict) -> dict[str, float]:
    """The weights for one replay: the activations' plus the coefficient (key "stranding") x its model's
    stranding (none where the weights have no coefficient)."""
    coefficient = weights.get("stranding", 0.0)
    return {c: weights[c] + (coefficient * row["stranding"] if c == "activations" else 0.0) for c in NAMES}


def fit(rows: list[dict], margin: float, stranding: bool = False) -> dict[str, float]:
    """The least weights (at least 1) whose bound reaches every replay's need x (1 + margin); `stranding`: with
    the activations' coefficient per unit of the replay's simulated stranding (the rows' "stranding")."""
    weights = dict(NATIVE_BY_SIZES, stranding=STRANDING) if stranding else dict(NATIVE.weights)
    for _ in range(ROUNDS):
        solver = pywraplp.Solver.CreateSolver("GLOP")
        w = {c: solver.NumVar(1.0, 4.0, c) for c in NAMES}
        if stranding:
            w["stranding"] = solver.NumVar(0.0, 10.0, "stranding")
        gib, objective = 2 ** 30, 0
        for row in rows:
            mine = with_stranding(weights, row)
            point = max(row["parts"], key=lambda p: sum(p[c] * mine[c] for c in NAMES))
            expr = sum(point[c] / gib * w[c] for c in NAMES) + SEGMENT_SLACK / gib
            if stranding:
                expr += point["activations"] * row["stranding"] / gib * w["stranding"]
            solver.Add(expr >= row["needed"] * (1 + margin) / gib)
            objective += expr * (gib / row["needed"])
        solver.Minimize(objective)
        if solver.Solve() != pywraplp.Solver.OPTIMAL:
            raise SystemExit("no weights at least 1 bound every replay")
        new = {c: var.solution_value() for c, var in w.items()}
        settled = all(math.isclose(new[c], weights[c], abs_tol=1e-6) for c in new)
        weights = new
        if settled:
            break
    return weights


def show(title: str, rows: list[dict], weights: dict[str, float]) -> None:
    print(f"{title}: " + ", ".join(f"{c} {value:.3f}" for c, value in weights.items()))
    for row in rows:
        shipped = ""
        if "stranding" in row:
            searched = with_stranding(dict(NATIVE_BY_SIZES, stranding=STRANDING), row)
            shipped = (f"native_margin {bound(row['parts'], searched) / row['needed']:.3f} "
                       f"(stranding {row['stranding']:.3f}), ")
        print(f"  {row['label']:<48} needed {row['needed'] / 2 ** 30:6.2f} GiB  bound/needed: NATIVE "
              f"{bound(row['parts'], NATIVE.weights) / row['needed']:.3f}, {shipped}"
              f"fitted {bound(row['parts'], with_stranding(weights, row)) / row['needed']:.3f}")


def expandable_replays() -> list[dict]:
    """Every replay with expandable segments in the results files, with the activations its selectively
    checkpointed units save: the grid's (a uniform selective plan's: its activations at their highest) and the
    default plans' made for that configuration (their `selective_bytes`; runs before it was recorded are left out)."""
    rows = []
    for row in json.loads((RESULTS / "allocator.json").read_text())["rows"]:
        parts = unpacked(row["parts"])
        selective = max(p["activations"] for p in parts) if "selective" in row["plan"] else 0
        rows.append({"label": f"{row['plan']} mb{row['micro_batch']}", "model": row["model"],
                     "seq_len": row["seq_len"], "micro_batch": row["micro_batch"], "parts": parts,
                     "needed": row["expandable_needed_bytes"], "selective": selective, **grid_tp(row)})
    for row in default_rows():
        if row.get("allocator_conf") == "expandable_segments:True" and "selective_bytes" in row:
            rows.append({"label": f"{row['model']} default @ {row['limit']}", "model": row["model"],
                         "seq_len": row["seq_len"], "micro_batch": row["micro_batch"], "parts": unpacked(row["parts"]),
                         "needed": row["needed_bytes"], "selective": row["selective_bytes"], **default_tp(row)})
    return rows


def expandable_bound(row: dict, fitted: dict[str, float]) -> float:
    """The expandable bound of one replay: its highest point x (1 + factor), plus the selective coefficient x its
    model's simulated stranding x its selective units' activations, plus the slack and the kernel workspaces."""
    top = max(sum(p.values()) for p in row["parts"])
    return (top * (1 + fitted["factor"]) + fitted["selective"] * row["stranding"] * row["selective"]
            + fitted["slack"] + SEGMENT_SLACK)


def fit_expandable(rows: list[dict], margin: float) -> dict[str, float]:
    """The least (factor, selective, slack) whose expandable bound reaches every replay's need x (1 + margin)."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    gib = 2 ** 30
    factor, selective, slack = (solver.NumVar(0.0, 1.0, "factor"), solver.NumVar(0.0, 100.0, "selective"),
                                solver.NumVar(0.0, 4.0, "slack"))
    objective = 0
    for row in rows:
        top = max(sum(p.values()) for p in row["parts"]) / gib
        expr = top + top * factor + row["stranding"] * row["selective"] / gib * selective + slack + SEGMENT_SLACK / gib
        solver.Add(expr >= row["needed"] * (1 + margin) / gib)
        objective += expr * (gib / row["needed"])
    solver.Minimize(objective)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        raise SystemExit("no expandable bound covers every replay")
    return {"factor": factor.solution_value(), "selective": selective.solution_value(),
            "slack": slack.solution_value() * gib}


def show_expandable(rows: list[dict], fitted: dict[str, float]) -> None:
    shipped = {"factor": EXPANDABLE_BY_SIZES.weights["params"] - 1, "selective": EXPANDABLE_STRANDING,
               "slack": EXPANDABLE_BY_SIZES.slack - SEGMENT_SLACK}
    print(f"expandable, {len(rows)} replays: factor {fitted['factor']:.4f}, selective {fitted['selective']:.3f} x "
          f"stranding, slack {fitted['slack'] / 2 ** 20:.0f} MiB")
    for row in rows:
        flat = max(sum(p.values()) for p in row["parts"]) * (1 + EXPANDABLE.weights["params"] - 1) + \
            EXPANDABLE.selective * row["selective"] + EXPANDABLE.slack
        print(f"  {row['label']:<48} needed {row['needed'] / 2 ** 30:6.2f} GiB  stranding {row['stranding']:.4f}  "
              f"bound/needed: EXPANDABLE {flat / row['needed']:.3f}, expandable_margin "
              f"{expandable_bound(row, shipped) / row['needed']:.3f}, "
              f"fitted {expandable_bound(row, fitted) / row['needed']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--by-model", action="store_true", help="fit each model's replays alone as well")
    parser.add_argument("--margin", type=float, help="each bound at least needed x (1 + this); default 0.01, with "
                        "--expandable 0.005")
    parser.add_argument("--stranding", action="store_true",
                        help="fit native_margin's weights and coefficient of the simulated stranding")
    parser.add_argument("--expandable", action="store_true",
                        help="fit expandable_margin's factor, slack and coefficient of the simulated stranding")
    args = parser.parse_args()
    if args.expandable:
        rows = expandable_replays()
        add_stranding(rows, expandable=True)
        show_expandable(rows, fit_expandable(rows, 0.005 if args.margin is None else args.margin))
        return
    args.margin = 0.01 if args.margin is None else args.margin
    rows = replays()
    if args.stranding:
        add_stranding(rows)
    show(f"all {len(rows)} replays", rows, fit(rows, args.margin, args.stranding))
    if args.by_model:
        for model in sorted({row["model"] for row in rows}):
            mine = [row for row in rows if row["model"] == model]
            show(f"{model} alone ({len(mine)} replays)", mine, fit(mine, args.margin, args.stranding))


if __name__ == "__main__":
    main()
