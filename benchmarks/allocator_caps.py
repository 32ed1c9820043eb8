"""Whether a replayed step runs under every cap between its smallest limit and its --mem: the limits natively
failing above one the step runs in (benchmarks/RESULTS.md section 11b, "A step that fails above its smallest
limit").

Why: natively a limit that makes the allocator free its cache at another moment leaves other blocks in other
segments, so a step can fail under a limit above one it runs in. A bisection alone would end below such limits;
cost_models.allocator_replay.run_and_min_limit tries a grid above where it ends. This prints, per saved plan, the
bisection's answer alone (`above=0`), the caps on an even grid from it to the plan's --mem (less the kernel
workspaces) at which the replay fails, and the figure the replay now gives (every limit of its grid above runs).

    python benchmarks/allocator_caps.py results/plans_allocator_default_heldout_native.json
    python benchmarks/allocator_caps.py results/plans_allocator_default_native.json --caps 40
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autoplan.plan.schema import Plan
from autoplan.run.allocator_fit import record_step
from cost_models.allocator import ROUND_LARGE, SEGMENT_SLACK, OutOfMemory
from cost_models.allocator_replay import replay, run_and_min_limit


def failing_caps(events, low: int, high: int, caps: int, expandable: bool) -> list[int]:
    """The caps of an even grid of `caps` steps from `low` to `high` (each to 2 MiB) the events fail under."""
    failing = []
    for i in range(caps + 1):
        cap = low + (high - low) * i // caps
        cap -= cap % ROUND_LARGE
        try:
            replay(events, cap, expandable=expandable)
        except OutOfMemory:
            failing.append(cap)
    return failing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", type=Path, help="a plans file of `allocator.py --default` (plan key -> plan)")
    parser.add_argument("--caps", type=int, default=40, help="grid steps from the bisection's answer to --mem")
    args = parser.parse_args()
    gib = 2 ** 30
    for key, data in json.loads(args.plans.read_text()).items():
        plan = Plan.model_validate(data)
        expandable = plan.cluster.expandable_segments
        events, _ = record_step(plan)
        _, bisected = run_and_min_limit(events, expandable=expandable, above=0)
        _, threshold = run_and_min_limit(events, expandable=expandable)
        top = plan.cluster.mem_limit_bytes - SEGMENT_SLACK
        failing = failing_caps(events, bisected, top, args.caps, expandable) if top > bisected else []
        print(f"{key}: bisection {bisected / gib:.3f} GiB, threshold {threshold / gib:.3f}, --mem less workspaces "
              f"{top / gib:.3f}; failing caps between: {', '.join(f'{c / gib:.3f}' for c in failing) or 'none'}",
              flush=True)


if __name__ == "__main__":
    main()
