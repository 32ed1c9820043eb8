"""The allocator bounds' constants (cost_models.allocator_margin) fitted to the replays of benchmarks/allocator.py:
how they were chosen, and how far they can go.

Why: the native bound is, at each time point, each memory category's bytes times a weight plus the slack; the
weights are the smallest that keep every replayed plan's `needed` within its bound. This fits them again from the
results files (benchmarks/results/allocator.json, the grid; allocator_default*.json, the default plans made for each
configuration, every round kept: `default_rows`), as a linear programme (OR-Tools GLOP): weights at least 1,
each replay's bound at its point at least its needed limit x (1 + --margin), the sum of bound/needed the least. A
bound is the highest of a plan's points, so which point must reach the need is a choice: each replay's highest
point under the weights of the round before, from NATIVE's, until the weights settle. `--by-model` fits each
model's replays alone: were the weights known per model, how close would category weights come. `--by-mode`
fits the bound the search plans to (allocator_margin.native_margin): each checkpoint mode's activations weighted by
a base plus a coefficient x what each replay's model strands in a simulation of its forward at its micro-batch and
tensor-parallel layout (cost_models.stranding; the models traced here, a few seconds), the gathered parameters by
1 + a coefficient x the same, the other categories by a weight each; over the replays whose plans' timelines were
recorded split by checkpoint mode (`mode_parts`: the grid's, uniform, and the default plans' since it was
recorded). `--held-out` with it fits again without each model's replays and shows that model's under that fit.
`--fallback` fits NATIVE (with `--expandable`, EXPANDABLE), the
bound of a table whose trace records no storages, over every replay, the held-out models' included, and natively
the GPU kit's grid plans' (allocator_steps.py DIR --kit --conf native).
`--expandable` fits expandable_margin (live bytes x (1 + factor), a coefficient x the model's simulated selective
stranding x the selective units' activations, a slack) to the replays with expandable segments (each at most its
bound / 1.005).

    python benchmarks/allocator.py && python benchmarks/allocator.py --default  # the replays
    python benchmarks/allocator_weights.py [--by-model] [--by-mode [--held-out] [--unseen]] [--expandable]
        [--fallback] [--margin M]
"""

from __future__ import annotations

import argparse
import json
import math

from common import RESULTS
from ortools.linear_solver import pywraplp

from cost_models.allocator import SEGMENT_SLACK
from cost_models.allocator_margin import (
    BY_MODE,
    EXPANDABLE,
    EXPANDABLE_BY_SIZES,
    EXPANDABLE_STRANDING,
    GATHERED_STRANDING,
    NATIVE,
    NATIVE_BY_SIZES,
)
from cost_models.memory import CATEGORIES

NAMES = [c.value for c in CATEGORIES]
OTHER = [name for name in NAMES if name != "activations"]
GROUPS = {"none": ("nothing",), "sel": ("cheap", "alternate"), "full": ("all",)}  # checkpoint modes, as BY_MODE's
MODE_KEYS = [f"act_{group}" for group in GROUPS]
ROUNDS = 10


def timeline_parts(plan) -> list[dict]:
    """The points of `plan`'s predicted timeline, bytes by memory category ("params", ...), that no other point
    equals or passes in every category: the only ones a bound of positive weights per category can peak at."""
    parts = [{k.removesuffix("_bytes"): v for k, v in p.breakdown.model_dump().items()} for p in plan.predicted.timeline]
    unique = [dict(t) for t in dict.fromkeys(tuple(sorted(p.items())) for p in parts)]
    return [p for p in unique if not any(q is not p and all(q[c] >= p[c] for c in p) for q in unique)]


def mode_parts(plan) -> list[dict]:
    """The points of `plan`'s timeline as timeline_parts gives them, with the activations also split by checkpoint
    mode (MODE_KEYS: each group of GROUPS), from the plan's own cost table (rebuilt as `autoplan estimate --plan`
    does); the points no other equals or passes in every one of these figures."""
    from dataclasses import replace

    from autoplan.api.estimate import request_table
    from autoplan.api.prepare import prepare
    from autoplan.settings import EstimateSettings
    from cost_models.algebra import NumericAlgebra
    from cost_models.allocator_margin import PointMargin
    from cost_models.memory import timeline

    request = prepare(EstimateSettings.create(plan=plan), plan, None)
    table, choices = request_table(request, plan)
    points = timeline(replace(table, allocator=None), NumericAlgebra(choices))
    rows = [{c.value: int(p.parts[c]) for c in CATEGORIES} for p in points]
    for group, modes in GROUPS.items():
        only = PointMargin({name: 1.0 for name in NAMES}, 0, by_mode={m: float(m in modes) for m in BY_MODE})
        for row, point in zip(rows, timeline(replace(table, allocator=only), NumericAlgebra(choices))):
            row[f"act_{group}"] = int(point.fitted_activations or 0)
    unique = [dict(t) for t in dict.fromkeys(tuple(sorted(p.items())) for p in rows)]
    return [p for p in unique if not any(q is not p and all(q[c] >= p[c] for c in p) for q in unique)]


def packed(parts: list[dict]) -> list[str]:
    """Timeline parts as the results files keep them: a line of bytes per point, in CATEGORIES' order (then
    MODE_KEYS' where the parts split the activations by checkpoint mode)."""
    return [" ".join(str(p[key]) for key in NAMES + [k for k in MODE_KEYS if k in p]) for p in parts]


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
                     "seq_len": row["seq_len"], "micro_batch": row["micro_batch"], "parts": grid_modes(row),
                     "needed": row["needed_limit_bytes"], **grid_tp(row)})
    for row in default_rows():
        if row.get("allocator_conf") == "expandable_segments:False" and "parts" in row:
            rows.append({"label": f"{row['model']} default @ {row['limit']}", "model": row["model"],
                         "seq_len": row["seq_len"], "micro_batch": row["micro_batch"], "parts": unpacked(row["parts"]),
                         "needed": row["needed_bytes"], "limit_bytes": row["limit_bytes"], **default_tp(row)})
    return rows


def unseen_replays() -> list[dict]:
    """The native replays of the default plans of models the constants were not fitted on (allocator.py --default
    --held-out --conf native, the last run and the rounds kept before it), as `replays()` gives the others."""
    paths = [*sorted(RESULTS.glob("allocator_default_heldout_steady_round*_native.json")),
             RESULTS / "allocator_default_heldout_native.json"]  # the rounds before the last run, and the last
    unique = {(row["model"], row["limit"], row["peak_bytes"], row["needed_bytes"]): row
              for path in paths for row in json.loads(path.read_text())["rows"] if "parts" in row}
    return [{"label": f"{row['model']} unseen @ {row['limit']}", "model": row["model"], "seq_len": row["seq_len"],
             "micro_batch": row["micro_batch"], "parts": unpacked(row["parts"]), "needed": row["needed_bytes"],
             "limit_bytes": row["limit_bytes"], **default_tp(row)} for row in unique.values()]


def grid_modes(row: dict) -> list[dict]:
    """A grid plan's timeline parts, its activations all of its one checkpoint mode (its label's)."""
    group = "full" if "full ckpt" in row["plan"] else "sel" if "selective" in row["plan"] else "none"
    return [{**p, **{f"act_{g}": p["activations"] if g == group else 0 for g in GROUPS}}
            for p in unpacked(row["parts"])]


def grid_tp(row: dict) -> dict:
    """A grid plan's tensor-parallel degree (its label's "tpN"; sequence parallelism off, as the grid makes them)."""
    degree = next((int(word[2:]) for word in row["plan"].split() if word.startswith("tp")), 1)
    return {"tp": degree, "sp": False} if degree > 1 else {}


def default_tp(row: dict) -> dict:
    """A default plan's tensor-parallel degree and sequence parallelism (where its run recorded it)."""
    return {key: row[key] for key in ("tp", "sp") if key in row}


def default_rows() -> list[dict]:
    """The default plans' replays of every round kept whose need is the settled cache's (the runs since replays
    carry the recorded steps on, cost_models.steady_steps: rows with `needed_recorded_bytes`): the plans made
    under the bound before the simulated stranding (allocator_default_prior.json), the rounds made while fitting
    it (allocator_default_round*.json, allocator_default_steady_round*.json: the first under the bound fitted to
    three steps) and the last runs (allocator_default*.json). The rounds before recorded the need of three steps, up
    to 3% short of the settled one."""
    files = [RESULTS / "allocator_default_prior.json", *sorted(RESULTS.glob("allocator_default_round*.json")),
             *sorted(RESULTS.glob("allocator_default_steady_round*.json")),
             RESULTS / "allocator_default.json", *sorted(RESULTS.glob("allocator_default_native*.json")),
             *sorted(RESULTS.glob("allocator_default_expandable*.json"))]
    rows = [row for path in files if path.exists() for row in json.loads(path.read_text())["rows"]
            if "needed_recorded_bytes" in row]
    unique: dict[tuple, dict] = {}
    for row in rows:  # a plan replayed again: once, the row that records its checkpoint modes if one does
        key = (row["model"], row.get("limit"), row.get("allocator_conf"), row.get("peak_bytes"), row.get("needed_bytes"))
        if key not in unique or _columns(row) >= _columns(unique[key]):
            unique[key] = row
    return list(unique.values())


def _columns(row: dict) -> int:
    """How many figures a results row records per timeline point (more where split by checkpoint mode)."""
    return len(row.get("parts", [""])[0].split())


def kit_replays() -> list[dict]:
    """The native replays of the GPU kit's grid plans (allocator_steps.py DIR --kit --conf native: made for
    expandable segments, recorded for several steps, the need after the last), each with what the GPU did under
    the bound the kit capped it at, as `replays()` gives the others."""
    return [{"label": f"{row['model']} kit {row['plan_key'].split('-')[-1]} mb{row['micro_batch']}",
             "model": row["model"], "seq_len": row["seq_len"], "micro_batch": row["micro_batch"],
             "parts": unpacked(row["parts"]), "needed": row["needs"][-1], "gpu_status": row.get("gpu_status"),
             "gpu_bound_bytes": row.get("gpu_bound_bytes")}
            for path in sorted(RESULTS.glob("allocator_steps_kit_*_native.json"))
            for row in json.loads(path.read_text()) if row.get("parts")]


def unpacked(lines: list[str]) -> list[dict]:
    """A results file's timeline parts (benchmarks/allocator.py's `packed`): bytes by category per point, and by
    checkpoint mode where recorded."""
    return [dict(zip(NAMES + MODE_KEYS, map(int, line.split()))) for line in lines]


def bound(parts: list[dict], weights: dict[str, float]) -> float:
    return max(sum(p[c] * weights[c] for c in NAMES) for p in parts) + NATIVE.slack


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


def shipped_weights() -> dict[str, float]:
    """native_margin's constants as `fit(..., by_mode=True)` names them."""
    weights = {c: NATIVE_BY_SIZES[c] for c in OTHER}
    weights["b_gathered"] = GATHERED_STRANDING
    for group, modes in GROUPS.items():
        weights[f"a_{group}"], weights[f"b_{group}"] = BY_MODE[modes[0]]
    return weights


def point_bound(point: dict, weights: dict[str, float], stranding: float) -> float:
    """One point's bound (less the slack): by category, where the weights have no per-mode constants (NATIVE's);
    else the gathered parameters' weight plus its coefficient x the model's stranding, and the activations per
    checkpoint mode, each its base plus its coefficient x the model's stranding."""
    if "a_none" not in weights:
        return sum(point[c] * weights[c] for c in NAMES)
    return (sum(point[c] * weights[c] for c in OTHER) + point["gathered"] * weights["b_gathered"] * stranding
            + sum(point[f"act_{g}"] * (weights[f"a_{g}"] + weights[f"b_{g}"] * stranding) for g in GROUPS))


def row_bound(row: dict, weights: dict[str, float]) -> float:
    return max(point_bound(p, weights, row.get("stranding", 0.0)) for p in row["parts"]) + NATIVE.slack


def fit(rows: list[dict], margin: float, by_mode: bool = False) -> dict[str, float]:
    """The least weights (at least 1) whose bound reaches every replay's need x (1 + margin); `by_mode`: the
    activations weighted per checkpoint mode, a base and a coefficient of the replay's simulated stranding (the
    rows' "stranding") each, as native_margin's."""
    weights = shipped_weights() if by_mode else dict(NATIVE.weights)
    for _ in range(ROUNDS):
        solver = pywraplp.Solver.CreateSolver("GLOP")
        w = {c: solver.NumVar(1.0, 4.0, c) for c in (OTHER if by_mode else NAMES)}
        if by_mode:
            w["b_gathered"] = solver.NumVar(0.0, 10.0, "b_gathered")
        for group in GROUPS if by_mode else ():
            w[f"a_{group}"] = solver.NumVar(1.0, 4.0, f"a_{group}")
            w[f"b_{group}"] = solver.NumVar(0.0, 10.0, f"b_{group}")
        gib, objective = 2 ** 30, 0
        for row in rows:
            point = max(row["parts"], key=lambda p: point_bound(p, weights, row.get("stranding", 0.0)))
            expr = sum(point[c] / gib * w[c] for c in (OTHER if by_mode else NAMES)) + NATIVE.slack / gib
            if by_mode:
                expr += point["gathered"] * row["stranding"] / gib * w["b_gathered"]
            for group in GROUPS if by_mode else ():
                expr += point[f"act_{group}"] / gib * (w[f"a_{group}"] + row["stranding"] * w[f"b_{group}"])
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
    print(f"{title}: " + ", ".join(f"{c} {value:.4f}" for c, value in weights.items()))
    for row in rows:
        shipped = ""
        if "stranding" in row:
            shipped = (f"native_margin {row_bound(row, shipped_weights()) / row['needed']:.3f} "
                       f"(stranding {row['stranding']:.3f}), ")
        used = f"  bound/--mem {row_bound(row, weights) / row['limit_bytes']:.3f}" if "limit_bytes" in row else ""
        if row.get("gpu_status"):  # the kit's plans: the GPU capped at the bound NATIVE gave it then
            used += f"  GPU {row['gpu_status']} at {row['gpu_bound_bytes'] / row['needed']:.3f} x needed"
        print(f"  {row['label']:<48} needed {row['needed'] / 2 ** 30:6.2f} GiB  bound/needed: NATIVE "
              f"{row_bound(row, NATIVE.weights) / row['needed']:.3f}, {shipped}"
              f"fitted {row_bound(row, weights) / row['needed']:.3f}{used}")


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


def heldout_expandable_replays() -> list[dict]:
    """The replays with expandable segments of the default plans of models no bound was fitted on (allocator.py
    --default --held-out --conf expandable), those that record the settled need, as `expandable_replays` gives them."""
    path = RESULTS / "allocator_default_heldout_expandable.json"
    return [{"label": f"{row['model']} unseen @ {row['limit']}", "model": row["model"], "seq_len": row["seq_len"],
             "micro_batch": row["micro_batch"], "parts": unpacked(row["parts"]), "needed": row["needed_bytes"],
             "selective": row["selective_bytes"], **default_tp(row)}
            for row in json.loads(path.read_text())["rows"] if "needed_recorded_bytes" in row and "parts" in row]


def show_expandable(rows: list[dict], fitted: dict[str, float], fallback: bool = False) -> None:
    shipped = {"factor": EXPANDABLE_BY_SIZES.weights["params"] - 1, "selective": EXPANDABLE_STRANDING,
               "slack": EXPANDABLE_BY_SIZES.slack - SEGMENT_SLACK}
    if fallback:  # EXPANDABLE's: its selective term is per selective activation byte (the rows' stranding 1)
        shipped = {"factor": EXPANDABLE.weights["params"] - 1, "selective": EXPANDABLE.selective,
                   "slack": EXPANDABLE.slack - SEGMENT_SLACK}
    print(f"expandable{' fallback' if fallback else ''}, {len(rows)} replays: factor {fitted['factor']:.4f}, "
          f"selective {fitted['selective']:.3f} x stranding, slack {fitted['slack'] / 2 ** 20:.0f} MiB")
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
    parser.add_argument("--by-mode", action="store_true",
                        help="fit native_margin: weights, and per checkpoint mode a base and a coefficient of the "
                        "simulated stranding (the replays whose plans' modes are recorded)")
    parser.add_argument("--held-out", action="store_true",
                        help="with --by-mode: fit again without each model's replays, and show that model's")
    parser.add_argument("--expandable", action="store_true",
                        help="fit expandable_margin's factor, slack and coefficient of the simulated stranding")
    parser.add_argument("--fallback", action="store_true",
                        help="fit NATIVE (or with --expandable, EXPANDABLE): the bound of a table whose trace "
                        "records no storages, without the simulated stranding, over every replay, the held-out "
                        "models' included")
    parser.add_argument("--unseen", action="store_true",
                        help="with --by-mode: the default plans of models outside the fit (allocator.py --default "
                        "--held-out, native) under the shipped constants, and under a fit with them in")
    args = parser.parse_args()
    if args.expandable:
        rows = expandable_replays() + (heldout_expandable_replays() if args.fallback else [])
        if args.fallback:  # the selective term per activation byte of the selective units, whatever the model
            for row in rows:
                row["stranding"] = 1.0
        else:
            add_stranding(rows, expandable=True)
        show_expandable(rows, fit_expandable(rows, 0.005 if args.margin is None else args.margin), args.fallback)
        return
    args.margin = 0.01 if args.margin is None else args.margin
    rows = replays()
    if args.fallback:
        rows += unseen_replays() + kit_replays()
        show(f"NATIVE over all {len(rows)} replays, the held-out models' and the GPU kit's included", rows,
             fit(rows, args.margin))
        return
    if args.by_mode:
        left = [row["label"] for row in rows if MODE_KEYS[0] not in row["parts"][0]]
        print(f"{len(left)} replays whose plans' checkpoint modes were not recorded left out")
        rows = [row for row in rows if MODE_KEYS[0] in row["parts"][0]]
        add_stranding(rows)
    show(f"all {len(rows)} replays", rows, fit(rows, args.margin, args.by_mode))
    if args.unseen:
        unseen = unseen_replays()
        add_stranding(unseen)
        show(f"{len(unseen)} default plans of models outside the fit, under the shipped constants", unseen,
             shipped_weights())
        both = fit(rows + unseen, args.margin, True)
        show(f"fitted with them in ({len(rows)} + {len(unseen)} replays), the fit's own", rows, both)
        show("and theirs", unseen, both)
    for model in sorted({row["model"] for row in rows}) if args.by_model or args.held_out else ():
        mine = [row for row in rows if row["model"] == model]
        if args.held_out:
            others = [row for row in rows if row["model"] != model]
            show(f"fitted without {model} ({len(others)} replays), {model}'s", mine, fit(others, args.margin, True))
        else:
            show(f"{model} alone ({len(mine)} replays)", mine, fit(mine, args.margin, args.by_mode))


if __name__ == "__main__":
    main()
