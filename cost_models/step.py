"""Step time: per unit, FSDP2 overlaps communication with compute, so each unit's forward costs
max(compute, all-gather) and its backward max(compute [+ recompute], all-gather + reduce-scatter
[+ all-reduce]). The root unit's collectives have nothing to hide behind (its all-gather opens the
forward, its reduction closes the backward) and are exposed. Each micro-batch repeats this; the
optimizer step runs once per step over the local shard (replicated units cost N times more)."""

from __future__ import annotations

from dataclasses import dataclass

from .algebra import Algebra
from .memory import _sum, _values
from .table import CostTable


@dataclass
class StepTime:
    micro_batch_s: object
    optimizer_s: object
    step_s: object


def step_time(table: CostTable, alg: Algebra) -> StepTime:
    unit_times = []
    for unit in range(len(table.units)):
        def pick(field: str):
            return alg.pick_time(unit, _values(table, unit, field))

        if unit == table.root:
            unit_times += [pick("fwd_s"), pick("bwd_s")]
        else:
            unit_times.append(alg.maximum([pick("fwd_s"), pick("comm_fwd_s")], f"t_fwd_{unit}"))
            unit_times.append(alg.maximum([pick("bwd_s"), pick("comm_bwd_s")], f"t_bwd_{unit}"))
    root = table.root
    exposed = alg.pick_time(root, _values(table, root, "comm_fwd_s")) + alg.pick_time(
        root, _values(table, root, "comm_bwd_s"))
    micro = _sum(unit_times) + exposed
    optimizer = _sum([alg.pick_time(u, _values(table, u, "optimizer_s")) for u in range(len(table.units))])
    return StepTime(micro, optimizer, micro * table.grad_accum_steps + optimizer)


def lower_bound_step_s(table: CostTable) -> float:
    """The step time with no memory limit. The step time is a sum of per-unit terms, each depending
    only on that unit's option, so the unconstrained optimum is each unit's best option: an exact
    lower bound for any memory-limited plan at this micro-batch size."""
    best_total = 0.0
    for unit in range(len(table.units)):
        best = float("inf")
        for choice in range(len(table.options[unit])):
            cost = table.costs[unit][choice]
            if unit == table.root:
                per_micro = cost.fwd_s + cost.bwd_s + cost.comm_fwd_s + cost.comm_bwd_s
            else:
                per_micro = max(cost.fwd_s, cost.comm_fwd_s) + max(cost.bwd_s, cost.comm_bwd_s)
            best = min(best, per_micro * table.grad_accum_steps + cost.optimizer_s)
        best_total += best
    return best_total

