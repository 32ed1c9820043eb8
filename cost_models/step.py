"""Step time: per unit, FSDP2 overlaps communication with compute. It prefetches one unit ahead: the
next unit's all-gather runs while this one computes (forward and backward), and in the backward the
previous unit's reduce-scatter too. Summed over a chain of like units (transformer blocks) that is each
unit's own collectives beside its own compute, which keeps every term one unit's: its forward costs
max(compute, all-gather) and its backward max(compute [+ recompute], all-gather + reduce-scatter
[+ all-reduce]). While a collective runs, NCCL's kernels hold some of the SMs (their CTAs share no SM with
compute kernels; profile.overlap.comm_sm_fraction f), so compute runs at 1 - f for the collective's
duration: a direction costs max(comm, compute + f x comm) (compute c done at rate 1 - f during comm m,
the rest after it). The root unit's collectives have nothing to hide behind (its all-gather opens the
forward, its reduction closes the backward) and are exposed; a unit whose compute is small against its
collectives (an embedding) exposes them the same way. Where the profile says FSDP2 does not
overlap (CPU + gloo: no streams), every unit's compute and collectives add up. Each unit also costs
FSDP2's fixed per-unit overhead (hooks, copy-in/out) and each of its collective calls a fixed cost
inside a step, in its forward and backward, exposed either way; op times are scaled to how they run
inside a step (all three fitted on whole training steps, see autoplan/profiling/calibration.py).
Each micro-batch repeats this; the
optimizer step runs once per step over the local shard (replicated units cost N times more).

Every term depends on one unit's option only, so the step time is a sum of per-unit, per-option
constants: with one option chosen per unit, max(sum_o x_o a_o, sum_o x_o b_o) = sum_o x_o max(a_o, b_o),
which keeps the solver's objective linear in the choice variables (no auxiliary max variables).
"""

from __future__ import annotations

from dataclasses import dataclass

from .algebra import Algebra, NumericAlgebra, add_all
from .option_cost import OptionCost
from .table import CostTable


@dataclass
class StepTime:
    micro_batch_s: object
    optimizer_s: object
    step_s: object


def overlapped_s(compute_s: float, comm_s: float, sm_fraction: float = 0.0) -> float:
    """Compute and a collective running together, the collective's kernels holding `sm_fraction` of the SMs."""
    return max(comm_s, compute_s + sm_fraction * comm_s)


def micro_batch_s(cost: OptionCost, is_root: bool, overlap: bool = True, sm_fraction: float = 0.0) -> float:
    """One unit's share of a micro-batch's forward + backward under one option."""
    overhead = cost.overhead_fwd_s + cost.overhead_bwd_s
    if is_root or not overlap:
        return cost.fwd_s + cost.bwd_s + cost.comm_fwd_s + cost.comm_bwd_s + overhead
    return (overlapped_s(cost.fwd_s, cost.comm_fwd_s, sm_fraction)
            + overlapped_s(cost.bwd_s, cost.comm_bwd_s, sm_fraction) + overhead)


def _micro(table: CostTable, cost: OptionCost, is_root: bool) -> float:
    return micro_batch_s(cost, is_root, table.overlap_enabled, table.comm_sm_fraction)


def unit_step_s(table: CostTable, unit: int) -> list[float]:
    """Per option: the unit's contribution to the step (all micro-batches plus its optimizer step)."""
    is_root = unit == table.root
    return [_micro(table, cost, is_root) * table.grad_accum_steps + cost.optimizer_s for cost in table.costs[unit]]


def step_time(table: CostTable, alg: Algebra) -> StepTime:
    micro, optimizer, step = [], [], []  # summed at the end: in time linear in the units (algebra.add_all)
    chosen = alg.choices if isinstance(alg, NumericAlgebra) else None
    for unit in range(len(table.units)):
        is_root = unit == table.root
        if chosen is not None:  # one plan: its options' times alone, as alg.pick_time would pick them
            cost = table.costs[unit][chosen[unit]]
            micro.append(_micro(table, cost, is_root))
            optimizer.append(cost.optimizer_s)
            step.append(micro[-1] * table.grad_accum_steps + cost.optimizer_s)
            continue
        micros = [_micro(table, c, is_root) for c in table.costs[unit]]
        micro.append(alg.pick_time(unit, micros))
        optimizer.append(alg.pick_time(unit, [c.optimizer_s for c in table.costs[unit]]))
        step.append(alg.pick_time(unit, [m * table.grad_accum_steps + c.optimizer_s  # unit_step_s
                                         for m, c in zip(micros, table.costs[unit])]))
    return StepTime(add_all(micro), add_all(optimizer), add_all(step))


def lower_bound_step_s(table: CostTable) -> float:
    """The step time with no memory limit: each unit's fastest option. An exact lower bound for
    any memory-limited plan at this micro-batch size."""
    return sum(min(unit_step_s(table, unit)) for unit in range(len(table.units)))
