"""How many training steps a replay must record: each saved plan's need under its allocator configuration after
each step of a longer recording.

Why: a replay (autoplan.run.allocator_fit.record_step) records three steps, the warm-up that makes the optimizer's
states and two more, and the GPU kit runs the same three; a training run takes thousands. Natively the segments a
step leaves cached decide where the next step's blocks land, so what is stranded can grow from one step to the
next until the cache's layout repeats: a need measured at step three is the steady need only where it has stopped
growing by then. This records `--steps` steps once per plan and replays every prefix of whole steps (the smallest
limit each runs in, plus the kernel workspaces, as `needed`), printing the need after each step and the step from
which it no longer changes.

    python benchmarks/allocator_steps.py results/plans_allocator_default_native.json --steps 10
    python benchmarks/allocator_steps.py results/plans_allocator_default_heldout_native.json --only llama-1b
    python benchmarks/allocator_steps.py results/gpu_truth_cuda_run5 --kit --conf native --steps 8

`--kit`: the GPU kit's grid plans (a gpu_truth.py --out folder, its plans.json), replayed under `--conf` (the kit
made them for expandable segments and ran each under both configurations, capped at its bound), each row beside
what the GPU did under that configuration and with the plan's timeline parts, so allocator_weights.py --fallback
can fit NATIVE to them as well (results/allocator_steps_kit_<folder>_<conf>.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from allocator_weights import packed, timeline_parts
from common import write_results
from gpu_truth import load_kit_plan

from autoplan.plan.schema import Plan
from autoplan.run.allocator_fit import record_step, replay_events
from cost_models.allocator_conf import modelled_options

CONFS = {"native": "expandable_segments:False", "expandable": "expandable_segments:True"}


def needs_by_step(plan: Plan, steps: int, conf: str | None = None) -> list[int]:
    """`plan`'s need (bytes, replay_events') after each of `steps` recorded steps (the first whole step's need
    first), under the allocator configuration `conf` (None: the plan's own)."""
    events, starts = record_step(plan, steps=steps)
    ends = [start for start in starts if start >= 0][1:] + [len(events)]
    options = modelled_options(conf) if conf else (plan.cluster.expandable_segments, plan.cluster.max_split_size)
    return [replay_events(events[:end], *options).needed_bytes for end in ends]


def settled_at(needs: list[int]) -> int:
    """The step (1-based) from which the need no longer changes in the recording."""
    step = len(needs)
    while step > 1 and needs[step - 2] == needs[-1]:
        step -= 1
    return step


def kit_plans(folder: Path, conf: str) -> dict[str, tuple[Plan, dict]]:
    """The GPU kit's grid plans in `folder` by key, each with what the kit recorded of it: its model, sequence and
    micro-batch, and under `conf` the bound the GPU was capped at and whether the step ran there."""
    saved = json.loads((folder / "plans.json").read_text())
    grid = json.loads((folder / "gpu_truth.json").read_text()).get("stages", {}).get("grid", {}).get("rows", [])
    plans = {}
    for row in grid:
        if row.get("plan_key") in saved:
            gpu = row.get("allocator", {}).get(conf, {})
            plans[row["plan_key"]] = (load_kit_plan(folder, saved[row["plan_key"]]), {
                "model": row["model"], "seq_len": row["seq_len"], "micro_batch": row["micro_batch"],
                "gpu_bound_bytes": gpu.get("needed_bound_bytes"), "gpu_status": gpu.get("status")})
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", type=Path, help="a plans file of `allocator.py --default` (plan key -> plan); with "
                        "--kit, the GPU kit's --out folder")
    parser.add_argument("--steps", type=int, default=10, help="steps recorded per plan (default 10)")
    parser.add_argument("--only", help="the plans whose key contains this")
    parser.add_argument("--kit", action="store_true", help="the GPU kit's grid plans (PLANS is its --out folder)")
    parser.add_argument("--conf", choices=tuple(CONFS), help="replay under this configuration (default: the plan's)")
    parser.add_argument("--out", help="the results file's name under benchmarks/results (default: from the plans')")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (a replay records 3)")
    conf = CONFS[args.conf] if args.conf else None
    if args.kit:
        plans = kit_plans(args.plans, conf or CONFS["expandable"])
    else:
        plans = {key: (Plan.model_validate(data), {}) for key, data in json.loads(args.plans.read_text()).items()}
    gib, rows = 2 ** 30, []
    print(f"{'plan':<34} {'--mem':>6} {'step 3':>7} {'last':>7} {'settled':>7}  need after each step (GiB)")
    for key, (plan, kit) in plans.items():
        if args.only and args.only not in key:
            continue
        began = time.process_time()
        needs = needs_by_step(plan, args.steps, conf)
        limit = plan.cluster.mem_limit_bytes
        rows.append({"plan_key": key, "limit_bytes": limit, "needs": needs, "settled_at": settled_at(needs),
                     "steady": needs[-1] == needs[-2], "cpu_s": round(time.process_time() - began, 1), **kit})
        if args.kit:  # what allocator_weights.py fits NATIVE to
            rows[-1].update(allocator_conf=conf, parts=packed(timeline_parts(plan)))
        print(f"{key:<34} {limit / gib:6.2f} {needs[2] / gib:7.3f} {needs[-1] / gib:7.3f} {rows[-1]['settled_at']:>7}  "
              + " ".join(f"{need / gib:.3f}" for need in needs)
              + (f"  GPU {kit['gpu_status']} at {kit['gpu_bound_bytes'] / gib:.3f}" if kit.get("gpu_status") else ""),
              flush=True)
    default = f"kit_{args.plans.name}_{args.conf or 'own'}" if args.kit \
        else args.plans.stem.removeprefix("plans_allocator_")
    name = args.out or "allocator_steps_" + default
    print(f"wrote {write_results(name + (f'_{args.only}' if args.only and not args.out else ''), rows)}")

if __name__ == "__main__":
    main()
