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
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import write_results

from autoplan.plan.schema import Plan
from autoplan.run.allocator_fit import record_step, replay_events


def needs_by_step(plan: Plan, steps: int) -> list[int]:
    """`plan`'s need (bytes, replay_events') after each of `steps` recorded steps (the first whole step's need
    first)."""
    events, starts = record_step(plan, steps=steps)
    ends = [start for start in starts if start >= 0][1:] + [len(events)]
    return [replay_events(events[:end], plan.cluster.expandable_segments, plan.cluster.max_split_size).needed_bytes
            for end in ends]


def settled_at(needs: list[int]) -> int:
    """The step (1-based) from which the need no longer changes in the recording."""
    step = len(needs)
    while step > 1 and needs[step - 2] == needs[-1]:
        step -= 1
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", type=Path, help="a plans file of `allocator.py --default` (plan key -> plan)")
    parser.add_argument("--steps", type=int, default=10, help="steps recorded per plan (default 10)")
    parser.add_argument("--only", help="the plans whose key contains this")
    parser.add_argument("--out", help="the results file's name under benchmarks/results (default: from the plans')")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (a replay records 3)")
    plans = json.loads(args.plans.read_text())
    gib, rows = 2 ** 30, []
    print(f"{'plan':<34} {'--mem':>6} {'step 3':>7} {'last':>7} {'settled':>7}  need after each step (GiB)")
    for key, data in plans.items():
        if args.only and args.only not in key:
            continue
        plan, began = Plan.model_validate(data), time.process_time()
        needs = needs_by_step(plan, args.steps)
        limit = plan.cluster.mem_limit_bytes
        rows.append({"plan_key": key, "limit_bytes": limit, "needs": needs, "settled_at": settled_at(needs),
                     "steady": needs[-1] == needs[-2], "cpu_s": round(time.process_time() - began, 1)})
        print(f"{key:<34} {limit / gib:6.2f} {needs[2] / gib:7.3f} {needs[-1] / gib:7.3f} {rows[-1]['settled_at']:>7}  "
              + " ".join(f"{need / gib:.3f}" for need in needs), flush=True)
    name = args.out or "allocator_steps_" + args.plans.stem.removeprefix("plans_allocator_")
    print(f"wrote {write_results(name + (f'_{args.only}' if args.only and not args.out else ''), rows)}")


if __name__ == "__main__":
    main()
