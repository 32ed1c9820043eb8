"""Natively, what `max_split_size_mb` would save: each saved default plan's step replayed through the native
allocator model with blocks above a size kept from being split for smaller requests.

Why: natively a step needs more than its live bytes where a small block lands in a large cached segment and the
next large request cannot use it. llama-1b's default plan at 14GB fails so on a GPU: a late activation of the
second step's forward (64 MiB) lands in the first step's fp32 logits segment (2004 MiB), and the loss's backward
then needs a segment more (benchmarks/RESULTS.md section 11b, "Models the bounds were not fitted on"). torch's
`PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N` keeps cached blocks above N MiB whole for requests of their own
size; the replay (cost_models.allocator) models it, and replays a plan made for it under it. This prints, per
plan, the native need (smallest limit plus the kernel workspaces, as `needed`) without it and with it at 256, 512
and 1024 MiB. On an H200 at 256 MiB the GPU needed 0-1% more than these figures (four held-out plans,
benchmarks/RESULTS.md section 9, fourth run). The native bound (cost_models.allocator_margin) does not model it.

`--eager-states` adds another lever: the optimizer's states made before the first step (as zeros, what Adam's
first step makes them), in place of torch's lazy making in the first optimizer step, where they land in the
segments the first step's activations and loss left free and split them for the next step's forward.

    python benchmarks/allocator_max_split.py results/plans_allocator_default_heldout_native.json
    python benchmarks/allocator_max_split.py results/plans_allocator_default_native.json --only llama3-8b
    python benchmarks/allocator_max_split.py results/plans_allocator_default_native.json --eager-states
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from autoplan.plan.schema import Plan
from autoplan.run.allocator_fit import record_step, replay_events

SIZES_MIB = (256, 512, 1024)


def make_adam_states(_module, optimizer: torch.optim.Optimizer) -> None:
    """Adam's and AdamW's states as their first step makes them (torch.optim.adam._init_group, without amsgrad or
    capturable): a step count of 0 and two zero tensors shaped as each parameter."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise SystemExit(f"--eager-states makes Adam's states; this plan's optimizer is {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", type=Path, help="a plans file of `allocator.py --default` (plan key -> plan)")
    parser.add_argument("--only", help="the plans whose key contains this")
    parser.add_argument("--eager-states", action="store_true",
                        help="also the need with the optimizer's states made before the first step")
    args = parser.parse_args()
    plans = json.loads(args.plans.read_text())
    gib = 2 ** 30
    print(f"{'plan':<34} {'needed':>7} " + " ".join(f"{f'split {size}':>10}" for size in SIZES_MIB)
          + (f" {'eager states':>13}" if args.eager_states else "") + "  (GiB)")
    for key, data in plans.items():
        if args.only and args.only not in key:
            continue
        plan = Plan.model_validate(data)
        events, _ = record_step(plan)
        needed = [replay_events(events, False, split).needed_bytes for split in (None, *(s << 20 for s in SIZES_MIB))]
        line = f"{key:<34} {needed[0] / gib:7.2f} " + " ".join(f"{n / gib:10.2f}" for n in needed[1:])
        if args.eager_states:
            eager, _ = record_step(plan, prepare=make_adam_states)
            line += f" {replay_events(eager, False).needed_bytes / gib:13.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
