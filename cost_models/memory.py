"""Per-rank memory at each time point of a training step, by category.

Time points: the forward of each op segment in execution order, the backward of each segment in
reverse order, and the optimizer step (one point per unit whose parameters may hold its largest
scratch on the CPU: see _optimizer_step_points). At the forward of segment s (ops a..b, owned by unit u):
    params + optimizer states                      (all units, sharded or not per their option)
  + gradients                                      (only with gradient accumulation > 1)
  + activations saved by segments 1..s
  + gathered params of every unit running at s (u and the units around it), plus those kept gathered
    by finished units with reshard_after_forward=False, plus the all-gather output of the unit gathered
    last (FSDP2, torch 2.13: each unit's all-gather output stays alive until the next unit's copy-out;
    the forward prefetches nothing by default)
  + the largest tensor the segment allocates.
Before the first segment of each unit with parameters, a "pre-fwd" point: its copy-out, when the
previous unit's all-gather output, its own and its unsharded parameters are alive at once.
At the backward of s: the activations of segments 1..s-1 (those of later segments are freed), what a
checkpointed u keeps that its recomputation leaves held (activations.backward_keep_bytes), reduced gradients of units whose backward finished, the parameter
gradients the units around u have computed so far (unsharded, compute dtype), and the peak of s's
backward simulated op by op (table.backward_peak): s's saved or recomputed activations not yet
consumed, gradients in flight and u's parameter gradients so far.
The loss is a segment of its own: it runs after the model's forward and before its backward, when
FSDP2 holds no unit gathered (not even the root: apply sets reshard_after_forward explicitly). Its
forward's transients hold its input (the logits) unless a checkpointed unit keeps that input already
(a selectively checkpointed head: OptionCost.loss_kept_bytes, taken off there).
When a unit's backward is done, FSDP2 reshards it and copies its gradients into the reduction input
(reduce dtype): a "reduce" point with that unit's activations freed.
FSDP2 keeps that reduction input alive until the next unit's post-backward (it frees the previous
one just before allocating its own; reduce_scatter_max_input_buffers=1), so the backward points
between two reductions hold the last reduced unit's reduction input too (on the CPU, with gloo's copy
of it: table._pending_reduce_bytes).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from enum import Enum

from .algebra import Algebra
from .options import Recompute
from .table import CostTable

__all__ = ["MemCategory", "CATEGORIES", "MemoryPoint", "PHASE_OF_POINT", "phase_of", "timeline", "total"]


class MemCategory(str, Enum):
    """What the bytes of a time point hold. A str: a category equals, hashes and prints as its value
    ("params", ...), and a plan's memory breakdown names its fields "<value>_bytes"."""

    PARAMS = "params"  # parameters held between steps (sharded or not per unit option)
    GRADS = "grads"  # reduced gradients (all of them during gradient accumulation)
    OPTIMIZER = "optimizer"  # optimizer states
    ACTIVATIONS = "activations"  # saved for backward (a checkpointed unit's inputs only)
    GATHERED = "gathered"  # unsharded parameters of running, prefetched and kept-gathered units
    TEMPORARIES = "temporaries"  # the largest transient: op scratch, gradients in flight, reduction buffers

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


CATEGORIES = tuple(MemCategory)


# the training phase each kind of time point (a label's first word) falls in: a unit's reduction runs in
# its post-backward hook, inside loss.backward()
PHASE_OF_POINT = {"pre-fwd": "forward", "fwd": "forward", "bwd": "backward", "reduce": "backward",
                  "optimizer": "optimizer"}


def phase_of(label: str) -> str | None:
    """"forward", "backward" or "optimizer" for a time point's label ("reduce transformer.h.0": "backward")."""
    return PHASE_OF_POINT.get(label.split(" ", 1)[0])


@dataclass
class MemoryPoint:
    label: str
    parts: dict[MemCategory, object]  # category -> expression (a number under NumericAlgebra)


def _parts(*, params, grads, optimizer, activations, gathered, temporaries) -> dict[MemCategory, object]:
    return {MemCategory.PARAMS: params, MemCategory.GRADS: grads, MemCategory.OPTIMIZER: optimizer,
            MemCategory.ACTIVATIONS: activations, MemCategory.GATHERED: gathered,
            MemCategory.TEMPORARIES: temporaries}


def _values(table: CostTable, unit: int, field: str) -> list:
    return [getattr(cost, field) for cost in table.costs[unit]]


def _sum(terms: list) -> object:
    total = 0
    for term in terms:
        total = total + term
    return total


def _backward_peak(seg, recompute: Recompute):
    return {Recompute.NOTHING: seg.bwd_peak, Recompute.ALL: seg.bwd_peak_checkpointed,
            Recompute.CHEAP: seg.bwd_peak_selective}[recompute]


def timeline(table: CostTable, alg: Algebra) -> list[MemoryPoint]:
    units, segments = table.units, table.segments
    n_units = len(units)

    def pick(unit: int, field: str):
        return alg.pick(unit, _values(table, unit, field))

    params_all = alg.define(_sum([pick(u, "param_bytes") for u in range(n_units)]), "params")
    optimizer_all = alg.define(_sum([pick(u, "optimizer_bytes") for u in range(n_units)]), "optimizer")
    grads_all = alg.define(_sum([pick(u, "grad_bytes") for u in range(n_units)]), "grads")

    # [Constraint-helper] reduced gradients of units whose backward is done: a suffix sum over units
    # ordered by first op (a unit's backward ends at its first op).
    by_first = sorted(range(n_units), key=lambda u: units[u].first_op)
    grads_from: list = [0] * (n_units + 1)
    for rank in range(n_units - 1, -1, -1):
        grads_from[rank] = alg.define(grads_from[rank + 1] + pick(by_first[rank], "grad_bytes"), f"grads_from_{rank}")

    # kept-gathered parameters of units whose forward is done: a prefix sum over units by last op
    by_last = sorted(range(n_units), key=lambda u: units[u].last_op)
    held_upto: list = [0] * (n_units + 1)
    for rank, unit in enumerate(by_last):
        held_upto[rank + 1] = alg.define(held_upto[rank] + pick(unit, "held_bytes"), f"held_{rank}")

    # activations saved by segments 1..s: a prefix sum over segments
    first_segment_of: dict[int, int] = {}
    activations_upto: list = []
    running = 0
    for index, seg in enumerate(segments):
        first_segment_of.setdefault(seg.unit, index)
        per_option = [
            (cost.activation_bytes if index == first_segment_of[seg.unit] else 0) if option.mode.checkpoints
            else seg.saved_bytes
            for option, cost in zip(table.options[seg.unit], table.costs[seg.unit])
        ]
        running = alg.define(running + alg.pick(seg.unit, per_option), f"act_{index}")
        activations_upto.append(running)

    # units by where their ops start and end: the questions below take O(log units) each, for a model of
    # thousands of layers must not scan every unit at every segment
    starts = sorted((units[u].first_op, u) for u in range(n_units))
    ends = sorted((units[u].last_op, u) for u in range(n_units))
    start_ops, end_ops = [op for op, _ in starts], [op for op, _ in ends]

    def ending_before(position: int) -> int:
        return bisect.bisect_left(end_ops, position)

    def starting_after(position: int) -> int:
        return n_units - bisect.bisect_right(start_ops, position)

    def last_ending_before(position: int) -> int | None:
        """Of the units ending before `position`, the last to end (the lowest index among ties)."""
        rank = bisect.bisect_left(end_ops, position)
        return ends[bisect.bisect_left(end_ops, end_ops[rank - 1])][1] if rank else None

    index_of = {unit.path: u for u, unit in enumerate(units)}
    depth = {u: units[u].path.count(".") + (0 if units[u].is_root else 1) for u in range(n_units)}
    # units with parameters in the order FSDP2 gathers them in the forward: by first op, outer ones first
    gather_order = sorted((u for u in range(n_units) if units[u].params), key=lambda u: (units[u].first_op, depth[u]))
    gather_starts = [units[u].first_op for u in gather_order]
    gather_rank = {u: rank for rank, u in enumerate(gather_order)}

    def latest_gathered(position: int, before: int | None = None) -> int | None:
        """The unit gathered last when the op at `position` runs (or the one gathered just before `before`)."""
        rank = bisect.bisect_right(gather_starts, position)
        if before is not None:
            rank = gather_rank[before]
        return gather_order[rank - 1] if rank else None

    def enclosing(unit: int) -> list[int]:
        """Units strictly around `unit` (its parent, the parent's parent, ...)."""
        chain, parent = [], units[unit].parent
        while parent is not None:
            chain.append(index_of[parent])
            parent = units[index_of[parent]].parent
        return chain

    segment_of_op = {}
    for index, seg in enumerate(segments):
        for position in range(seg.first_op, seg.last_op + 1):
            segment_of_op[position] = index
    # a unit is reduced once the backward of its subtree's first op is done (innermost units first)
    reduced_after: dict[int, list[int]] = {}
    for u in sorted(range(n_units), key=lambda u: -len(enclosing(u))):
        reduced_after.setdefault(segment_of_op.get(units[u].first_op, 0), []).append(u)

    # the unit reduced last before the backward of segment s (its reduction input is still alive)
    last_reduced_before: dict[int, int | None] = {}
    last = None
    for index in range(len(segments) - 1, -1, -1):
        last_reduced_before[index] = last
        if reduced_after.get(index):
            last = reduced_after[index][-1]

    grads_in_step = grads_all if table.grad_accum_steps > 1 else 0
    loss_keepers = [u for u in range(n_units) if any(cost.loss_kept_bytes for cost in table.costs[u])]
    fwd_points, bwd_points = [], []
    spanning: list[tuple[int, int]] = []  # (last op, unit) of the units started by the segment, less some ended
    started = 0
    for index, seg in enumerate(segments):  # in op order: a sweep over the units' spans
        while started < n_units and start_ops[started] <= seg.first_op:
            heapq.heappush(spanning, (units[starts[started][1]].last_op, starts[started][1]))
            started += 1
        while spanning and spanning[0][0] < seg.first_op:
            heapq.heappop(spanning)
        # the loss runs after the model's forward returned and before its backward starts: FSDP2 holds no
        # unit gathered then (apply sets reshard_after_forward explicitly, so the root reshards too)
        around = [] if seg.outside_model else sorted(u for _, u in spanning)  # the units whose ops span it
        label = "loss" if seg.outside_model else units[seg.unit].path or "<root>"
        held_done = held_upto[ending_before(seg.first_op)]

        running = _sum([pick(u, "gathered_bytes") for u in around]) + held_done
        latest = None if seg.outside_model else latest_gathered(seg.first_op)
        gathered_fwd = running + (pick(latest, "gathered_bytes") if latest is not None else 0)
        if not seg.outside_model and seg.unit == latest and first_segment_of[seg.unit] == index:
            # [Point] the unit's copy-out: the previous unit's all-gather output is still alive
            previous = latest_gathered(seg.first_op, before=seg.unit)
            fwd_points.append(MemoryPoint(f"pre-fwd {label}", _parts(
                params=params_all, grads=grads_in_step, optimizer=optimizer_all,
                activations=activations_upto[index - 1] if index > 0 else 0,
                gathered=gathered_fwd + (pick(previous, "gathered_bytes") if previous is not None else 0),
                temporaries=0,
            )))
        # the loss's unsaved inputs are among its transients; a unit that keeps one counts it already
        kept_by = ([alg.pick(u, [-c.loss_kept_bytes for c in table.costs[u]]) for u in loss_keepers]
                   if seg.outside_model else [])
        fwd_points.append(MemoryPoint(f"fwd {label}", _parts(
            params=params_all, grads=grads_in_step, optimizer=optimizer_all,
            activations=activations_upto[index], gathered=gathered_fwd,
            temporaries=_sum([seg.fwd_temp_bytes] + kept_by),
        )))

        prefetch_bwd = None if seg.outside_model else last_ending_before(seg.first_op)
        gathered_bwd = held_done
        if prefetch_bwd is not None:  # prefetched for the next backward unless already held
            gathered_bwd = gathered_bwd + alg.pick(prefetch_bwd, [
                c.gathered_bytes - c.held_bytes for c in table.costs[prefetch_bwd]])
        done_rank = starting_after(seg.last_op)
        grads_done = grads_all if table.grad_accum_steps > 1 else grads_from[n_units - done_rank]
        # the gradients of every unit whose backward is running accumulate unsharded until its reduction
        pending = last_reduced_before[index]
        pending_reduce = pick(pending, "pending_reduce_bytes") if pending is not None else 0
        # [Point] the segment's backward at its peak (table.backward_peak): its own activations and
        # gradients as simulated op by op, the checkpointed unit's kept inputs, earlier segments' activations
        peak = [_backward_peak(seg, option.recompute) for option in table.options[seg.unit]]
        kept = [cost.bwd_kept_bytes if option.mode.checkpoints and index == first_segment_of[seg.unit] else 0
                for option, cost in zip(table.options[seg.unit], table.costs[seg.unit])]
        bwd_here = [MemoryPoint(f"bwd {label}", _parts(
            params=params_all, grads=grads_done, optimizer=optimizer_all,
            activations=(activations_upto[index - 1] if index > 0 else 0)
            + alg.pick(seg.unit, [k + p.activations for k, p in zip(kept, peak)]),
            gathered=gathered_bwd + _sum([pick(u, "gathered_bytes") for u in around]),
            temporaries=alg.pick(seg.unit, [p.temporaries for p in peak]) + seg.outer_grad_bytes + pending_reduce,
        ))]
        for u in reduced_after.get(index, []):
            # [Point] FSDP2's post-backward: u is resharded, its gradients copied into the reduction
            # input (the previous unit's input freed just before); the activations of its subtree
            # are freed by now
            outer = enclosing(u)
            later_rank = starting_after(units[u].first_op)
            bwd_here.append(MemoryPoint(f"reduce {units[u].path or '<root>'}", _parts(
                params=params_all,
                grads=grads_all if table.grad_accum_steps > 1 else grads_from[n_units - later_rank],
                optimizer=optimizer_all,
                activations=activations_upto[index - 1] if index > 0 else 0,
                gathered=gathered_bwd + _sum([pick(v, "gathered_bytes") for v in outer]),
                temporaries=pick(u, "reduce_peak_bytes") + _sum([pick(v, "unsharded_grad_bytes") for v in outer]),
            )))
        bwd_points.append(bwd_here)

    state = _parts(params=params_all, grads=grads_all, optimizer=optimizer_all, activations=0, gathered=0,
                   temporaries=_sum([pick(u, "optimizer_temp_bytes") for u in range(n_units)]))
    step_points = _optimizer_step_points(table, alg, state)
    return fwd_points + [p for points in bwd_points[::-1] for p in points] + step_points


MAX_SCRATCH_POINTS = 64


def _optimizer_step_points(table: CostTable, alg: Algebra, state: dict[MemCategory, object]) -> list[MemoryPoint]:
    """The optimizer step: every unit's state plus its scratch. A foreach step's scratch spans every
    parameter (`optimizer_temp_bytes`, summed in `state`); a per-tensor step's (the CPU's) is that of
    one parameter at a time, so the step's peak holds the largest of the units' `tensor_scratch_bytes`.
    A maximum is not linear in the options; one point per unit that can hold it is: with `surely` the
    largest scratch some unit has under every option, unit u's point holds max(its scratch, surely),
    and the highest of these points is the plan's maximum. Units that never exceed `surely` need no
    point; with none left, one point holds `surely`. Past MAX_SCRATCH_POINTS units (each point is a
    solver row over every option), one point holds the largest scratch any unit can have: an upper bound."""
    scratch = [_values(table, u, "tensor_scratch_bytes") for u in range(len(table.units))]
    surely = max((min(values) for values in scratch), default=0)
    holders = [u for u, values in enumerate(scratch) if max(values) > surely]
    if not holders or len(holders) > MAX_SCRATCH_POINTS:
        bound = max((max(scratch[u]) for u in holders), default=surely)
        return [MemoryPoint("optimizer step", {**state, MemCategory.TEMPORARIES: state[MemCategory.TEMPORARIES] + bound})]
    return [MemoryPoint("optimizer step" if len(holders) == 1 else f"optimizer step {table.units[u].path or '<root>'}",
                        {**state, MemCategory.TEMPORARIES: state[MemCategory.TEMPORARIES]
                         + alg.pick(u, [max(v, surely) for v in scratch[u]])})
            for u in holders]


def total(point: MemoryPoint):
    return _sum([point.parts[c] for c in CATEGORIES])
