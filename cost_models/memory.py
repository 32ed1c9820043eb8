"""Per-rank memory at each time point of a training step, by category.

Time points: the forward of each op segment in execution order, the backward of each segment in reverse order, and
the optimizer step (one point per unit whose parameters may hold its largest scratch on the CPU: see
_optimizer_step_points). At the forward of segment s (ops a..b, owned by unit u):
    params + optimizer states                      (all units, sharded or not per their option)
  + gradients                                      (only with gradient accumulation > 1)
  + activations saved by segments 1..s
  + gathered params of every unit running at s (u and the units around it), plus those kept gathered
    by finished units with reshard_after_forward=False, plus the all-gather output of the unit gathered
    last (FSDP2, torch 2.13: each unit's all-gather output stays alive until the next unit's copy-out;
    the forward prefetches nothing by default)
  + the largest tensor the segment allocates.
Before the first segment of each unit with parameters, a "pre-fwd" point: its copy-out, when the previous unit's
all-gather output, its own and its unsharded parameters are alive at once.
At the backward of s: the activations of segments 1..s-1 (those of later segments are freed), what a checkpointed u
keeps that its recomputation leaves held (activations.backward_keep_bytes), reduced gradients of units whose
backward finished, the parameter gradients the units around u have computed so far (unsharded, compute dtype), and
the peak of s's backward simulated op by op (table.backward_peak): s's saved or recomputed activations not yet
consumed, gradients in flight and u's parameter gradients so far.
The loss is a segment of its own: it runs after the model's forward and before its backward, when FSDP2 holds no
unit gathered (not even the root: apply sets reshard_after_forward explicitly). Its forward's transients hold its
input (the logits) unless a checkpointed unit keeps that input already (a selectively checkpointed head:
OptionCost.loss_kept_bytes, taken off there).
When a unit's backward is done, FSDP2 reshards it and copies its gradients into the reduction input (reduce dtype):
a "reduce" point with that unit's activations freed.
FSDP2 keeps that reduction input alive until the next unit's post-backward (it frees the previous one just before
allocating its own; reduce_scatter_max_input_buffers=1), so the backward points between two reductions hold the last
reduced unit's reduction input too (on the CPU, with gloo's copy of it: table._pending_reduce_bytes).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from enum import Enum

from collections.abc import Callable

from .algebra import Algebra, NumericAlgebra, add_all
from .option_cost import OptionCost
from .optimizer_points import optimizer_scratch
from .options import CheckpointMode, Recompute
from .table import CostTable

__all__ = ["MemCategory", "CATEGORIES", "MemoryPoint", "PHASE_OF_POINT", "phase_of", "timeline",
           "total"]


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
    # the activations, each option's weighted by what its checkpoint mode strands where the table's allocator margin
    # weights them per mode (cost_models.allocator_margin.PointMargin.by_mode; None: the activations' one weight)
    fitted_activations: object = None


def _parts(*, params, grads, optimizer, activations, gathered, temporaries) -> dict[MemCategory, object]:
    return {MemCategory.PARAMS: params, MemCategory.GRADS: grads, MemCategory.OPTIMIZER: optimizer,
            MemCategory.ACTIVATIONS: activations, MemCategory.GATHERED: gathered, MemCategory.TEMPORARIES: temporaries}


def _values(table: CostTable, unit: int, field: str) -> list:
    return [getattr(cost, field) for cost in table.costs[unit]]


_sum = add_all


_PEAK_OF = {Recompute.NOTHING: "bwd_peak", Recompute.ALL: "bwd_peak_checkpointed", Recompute.CHEAP: "bwd_peak_selective",
            Recompute.ALTERNATE: "bwd_peak_alternate"}


def timeline(table: CostTable, alg: Algebra) -> list[MemoryPoint]:
    """Every time point of the step (see the module docstring), as expressions of `alg`: numbers for one plan
    (NumericAlgebra), affine rows over the option literals for the solver (AffineAlgebra)."""
    steps = _Timeline(table, alg)
    fwd_points, bwd_points = [], []
    for index, seg in enumerate(table.segments):  # in op order: a sweep over the units' spans
        around = _sum([steps.pick(u, "gathered_bytes") for u in steps.around(seg)])  # the running units, gathered
        fwd_points += steps.forward(index, seg, around)
        bwd_points.append(steps.backward(index, seg, around))
    return fwd_points + [p for points in bwd_points[::-1] for p in points] + steps.optimizer_step()


class _Timeline:
    """What the time points share: the state held throughout (prefix and suffix sums over units and
    segments, defined once), where units start and end (each question O(log units): a model of thousands
    of layers must not scan every unit at every segment), FSDP2's gather and reduce orders. A unit's values are
    found once per field (`pick`); for one fixed plan (NumericAlgebra) its chosen option's alone."""

    def __init__(self, table: CostTable, alg: Algebra):
        self.table, self.alg = table, alg
        self.chosen = alg.choices if isinstance(alg, NumericAlgebra) else None
        self._picked: dict[tuple[int, str], object] = {}
        self.units, n_units = table.units, len(table.units)
        self._modes: dict[int, list] = {}  # a unit's options' checkpoint modes (Option.mode looks one up at each call)
        self.params_all = alg.define(self.pick_all("param_bytes"), "params")
        self.optimizer_all = alg.define(self.pick_all("optimizer_bytes"), "optimizer")
        self.grads_all = alg.define(self.pick_all("grad_bytes"), "grads")
        self._state_prefixes()
        self._spans()
        self._reductions()
        self.grads_in_step = self.grads_all if table.grad_accum_steps > 1 else 0
        self.loss_keepers = [u for u in range(n_units) if any(cost.loss_kept_bytes for cost in table.costs[u])]
        self.spanning: list[tuple[int, int]] = []  # (last op, unit) of the units started by the segment, less some ended
        self.started = 0

    def both(self, unit: int, value: Callable[[CheckpointMode, OptionCost], int]) -> tuple:
        """per_option of value, and of value weighted by the option's checkpoint mode where the table's allocator
        margin weights activations per mode (else None): the same literals, other coefficients."""
        by_mode = getattr(self.table.allocator, "by_mode", None)
        return self.per_option(unit, value), None if not by_mode else self.per_option(
            unit, lambda mode, cost: math.ceil(value(mode, cost) * by_mode[mode.recompute.value]))

    def fitted_before(self, index: int):
        """The weighted activations of segments before `index` (None where they are not weighted per mode)."""
        return self.fitted_upto[index - 1] if index > 0 or self.fitted_upto[0] is None else 0

    def pick(self, unit: int, field: str):
        if self.chosen is not None:
            return getattr(self.table.costs[unit][self.chosen[unit]], field)
        key = (unit, field)
        found = self._picked.get(key)
        if found is None:
            found = self._picked[key] = self.alg.pick(unit, _values(self.table, unit, field))
        return found

    def pick_all(self, field: str):
        """The sum over every unit of pick(unit, field): at once where the algebra can (`pick_sum`: one dense row)."""
        if self.chosen is not None or not hasattr(self.alg, "pick_sum"):
            return _sum([self.pick(u, field) for u in range(len(self.units))])
        return self.alg.pick_sum([_values(self.table, u, field) for u in range(len(self.units))])

    def per_option(self, unit: int, value: Callable[[CheckpointMode, OptionCost], int]):
        """alg.pick of value(mode, cost) over the unit's options (for a fixed plan, of its chosen option alone)."""
        options, costs = self.table.options[unit], self.table.costs[unit]
        if self.chosen is not None:
            chosen = self.chosen[unit]
            return value(options[chosen].mode, costs[chosen])
        modes = self._modes.get(unit) or self._modes.setdefault(unit, [option.mode for option in options])
        return self.alg.pick(unit, [value(mode, cost) for mode, cost in zip(modes, costs)])

    def _state_prefixes(self) -> None:
        table, alg, units, n_units = self.table, self.alg, self.units, len(self.units)
        # [Constraint-helper] reduced gradients of units whose backward is done: a suffix sum over units
        # ordered by first op (a unit's backward ends at its first op).
        by_first = sorted(range(n_units), key=lambda u: units[u].first_op)
        self.grads_from: list = [0] * (n_units + 1)
        for rank in range(n_units - 1, -1, -1):
            self.grads_from[rank] = alg.define(self.grads_from[rank + 1] + self.pick(by_first[rank], "grad_bytes"),
                                               f"grads_from_{rank}")
        # kept-gathered parameters of units whose forward is done: a prefix sum over units by last op
        by_last = sorted(range(n_units), key=lambda u: units[u].last_op)
        self.held_upto: list = [0] * (n_units + 1)
        for rank, unit in enumerate(by_last):
            self.held_upto[rank + 1] = alg.define(self.held_upto[rank] + self.pick(unit, "held_bytes"), f"held_{rank}")
        # activations saved by segments 1..s: a prefix sum over segments
        self.first_segment_of: dict[int, int] = {}
        self.activations_upto, self.fitted_upto = [], []  # fitted: weighted per mode (`both`), else None
        running, fitted = 0, 0
        for index, seg in enumerate(table.segments):
            first = self.first_segment_of.setdefault(seg.unit, index) == index
            saved, weighted = self.both(seg.unit, lambda mode, cost, first=first, seg=seg: (
                (cost.activation_bytes if first else 0) if mode.checkpoints else seg.saved_bytes))
            running = alg.define(running + saved, f"act_{index}")
            fitted = None if weighted is None else alg.define(fitted + weighted, f"fitted_act_{index}")
            self.activations_upto.append(running)
            self.fitted_upto.append(fitted)

    def _spans(self) -> None:
        """Units by where their ops start and end, and in the order FSDP2 gathers them in the forward (by first
        op, outer ones first)."""
        units, n_units = self.units, len(self.units)
        self.starts = sorted((units[u].first_op, u) for u in range(n_units))
        self.ends = sorted((units[u].last_op, u) for u in range(n_units))
        self.start_ops, self.end_ops = [op for op, _ in self.starts], [op for op, _ in self.ends]
        self.index_of = {unit.path: u for u, unit in enumerate(units)}
        depth = {u: units[u].path.count(".") + (0 if units[u].is_root else 1) for u in range(n_units)}
        self.gather_order = sorted((u for u in range(n_units) if units[u].params),
                                   key=lambda u: (units[u].first_op, depth[u]))
        self.gather_starts = [units[u].first_op for u in self.gather_order]
        self.gather_rank = {u: rank for rank, u in enumerate(self.gather_order)}

    def _reductions(self) -> None:
        """A unit is reduced once the backward of its subtree's first op is done (innermost units first); per
        segment, the unit reduced last before its backward (its reduction input is still alive)."""
        units, segments = self.units, self.table.segments
        firsts = [seg.first_op for seg in segments]  # in op order: the segment of a unit's first op by bisection
        self.reduced_after: dict[int, list[int]] = {}
        for u in sorted(range(len(units)), key=lambda u: -len(self.enclosing(u))):
            at = bisect.bisect_right(firsts, units[u].first_op) - 1
            at = at if at >= 0 and units[u].first_op <= segments[at].last_op else 0
            self.reduced_after.setdefault(at, []).append(u)
        self.last_reduced_before: dict[int, int | None] = {}
        last = None
        for index in range(len(segments) - 1, -1, -1):
            self.last_reduced_before[index] = last
            if self.reduced_after.get(index):
                last = self.reduced_after[index][-1]

    def ending_before(self, position: int) -> int:
        return bisect.bisect_left(self.end_ops, position)

    def starting_after(self, position: int) -> int:
        return len(self.units) - bisect.bisect_right(self.start_ops, position)

    def last_ending_before(self, position: int) -> int | None:
        """Of the units ending before `position`, the last to end (the lowest index among ties)."""
        rank = bisect.bisect_left(self.end_ops, position)
        return self.ends[bisect.bisect_left(self.end_ops, self.end_ops[rank - 1])][1] if rank else None

    def latest_gathered(self, position: int, before: int | None = None) -> int | None:
        """The unit gathered last when the op at `position` runs (or the one gathered just before `before`)."""
        rank = bisect.bisect_right(self.gather_starts, position)
        if before is not None:
            rank = self.gather_rank[before]
        return self.gather_order[rank - 1] if rank else None

    def enclosing(self, unit: int) -> list[int]:
        """Units strictly around `unit` (its parent, the parent's parent, ...)."""
        chain, parent = [], self.units[unit].parent
        while parent is not None:
            chain.append(self.index_of[parent])
            parent = self.units[self.index_of[parent]].parent
        return chain

    def around(self, seg) -> list[int]:
        """The units whose ops span the segment (called for each segment in order). The loss runs after the
        model's forward returned and before its backward starts: FSDP2 holds no unit gathered then (apply sets
        reshard_after_forward explicitly, so the root reshards too)."""
        units, starts = self.units, self.starts
        while self.started < len(units) and self.start_ops[self.started] <= seg.first_op:
            heapq.heappush(self.spanning, (units[starts[self.started][1]].last_op, starts[self.started][1]))
            self.started += 1
        while self.spanning and self.spanning[0][0] < seg.first_op:
            heapq.heappop(self.spanning)
        return [] if seg.outside_model else sorted(u for _, u in self.spanning)

    def _label(self, seg) -> str:
        return "loss" if seg.outside_model else self.units[seg.unit].path or "<root>"

    def forward(self, index: int, seg, around) -> list[MemoryPoint]:
        """The segment's forward point, after a pre-forward point where its unit copies out its gathered
        parameters; `around`: the gathered bytes of the units running at the segment."""
        label = self._label(seg)
        points = []
        held_done = self.held_upto[self.ending_before(seg.first_op)]
        running = around + held_done
        latest = None if seg.outside_model else self.latest_gathered(seg.first_op)
        gathered_fwd = running + (self.pick(latest, "gathered_bytes") if latest is not None else 0)
        if not seg.outside_model and seg.unit == latest and self.first_segment_of[seg.unit] == index:
            # [Point] the unit's copy-out: the previous unit's all-gather output is still alive
            previous = self.latest_gathered(seg.first_op, before=seg.unit)
            points.append(MemoryPoint(f"pre-fwd {label}", _parts(
                params=self.params_all, grads=self.grads_in_step, optimizer=self.optimizer_all,
                activations=self.activations_upto[index - 1] if index > 0 else 0,
                gathered=gathered_fwd + (self.pick(previous, "gathered_bytes") if previous is not None else 0),
                temporaries=0,
            ), self.fitted_before(index)))
        # the loss's unsaved inputs are among its transients; a unit that keeps one counts it already
        kept_by = ([self.per_option(u, lambda _, cost: -cost.loss_kept_bytes) for u in self.loss_keepers]
                   if seg.outside_model else [])
        points.append(MemoryPoint(f"fwd {label}", _parts(
            params=self.params_all, grads=self.grads_in_step, optimizer=self.optimizer_all,
            activations=self.activations_upto[index], gathered=gathered_fwd,
            temporaries=_sum([seg.fwd_temp_bytes] + kept_by),
        ), self.fitted_upto[index]))
        return points

    def backward(self, index: int, seg, around) -> list[MemoryPoint]:
        """The segment's backward at its peak, then the reductions of the units whose backward ends with it."""
        table, n_units = self.table, len(self.units)
        held_done = self.held_upto[self.ending_before(seg.first_op)]
        prefetch_bwd = None if seg.outside_model else self.last_ending_before(seg.first_op)
        gathered_bwd = held_done
        if prefetch_bwd is not None:  # prefetched for the next backward unless already held
            gathered_bwd = gathered_bwd + self.per_option(prefetch_bwd, lambda _, c: c.gathered_bytes - c.held_bytes)
        done_rank = self.starting_after(seg.last_op)
        grads_done = self.grads_all if table.grad_accum_steps > 1 else self.grads_from[n_units - done_rank]
        # the gradients of every unit whose backward is running accumulate unsharded until its reduction
        pending = self.last_reduced_before[index]
        pending_reduce = self.pick(pending, "pending_reduce_bytes") if pending is not None else 0
        # [Point] the segment's backward at its peak (table.backward_peak): its own activations and
        # gradients as simulated op by op, the checkpointed unit's kept inputs, earlier segments' activations
        first = index == self.first_segment_of[seg.unit]
        earlier = self.activations_upto[index - 1] if index > 0 else 0
        fitted_earlier = self.fitted_before(index)
        own, fitted_own = self.both(seg.unit, lambda mode, cost: (
            (cost.bwd_kept_bytes if mode.checkpoints and first else 0)
            + getattr(seg, _PEAK_OF[mode.recompute]).activations))
        points = [MemoryPoint(f"bwd {self._label(seg)}", _parts(
            params=self.params_all, grads=grads_done, optimizer=self.optimizer_all,
            activations=earlier + own,
            gathered=gathered_bwd + around,
            temporaries=self.per_option(seg.unit, lambda mode, _: getattr(seg, _PEAK_OF[mode.recompute]).temporaries)
            + seg.outer_grad_bytes + pending_reduce,
        ), None if fitted_own is None else fitted_earlier + fitted_own)]
        for u in self.reduced_after.get(index, []):
            points.append(self._reduce_point(u, earlier, gathered_bwd, fitted_earlier))
        return points

    def _reduce_point(self, u: int, activations, gathered_bwd, fitted_activations) -> MemoryPoint:
        """[Point] FSDP2's post-backward: u is resharded, its gradients copied into the reduction input (the
        previous unit's input freed just before); the activations of its subtree are freed by now."""
        table, n_units = self.table, len(self.units)
        outer = self.enclosing(u)
        later_rank = self.starting_after(self.units[u].first_op)
        return MemoryPoint(f"reduce {self.units[u].path or '<root>'}", _parts(
            params=self.params_all,
            grads=self.grads_all if table.grad_accum_steps > 1 else self.grads_from[n_units - later_rank],
            optimizer=self.optimizer_all,
            activations=activations,
            gathered=gathered_bwd + _sum([self.pick(v, "gathered_bytes") for v in outer]),
            temporaries=self.pick(u, "reduce_peak_bytes") + _sum([self.pick(v, "unsharded_grad_bytes") for v in outer]),
        ), fitted_activations)

    def optimizer_step(self) -> list[MemoryPoint]:
        state = _parts(params=self.params_all, grads=self.grads_all, optimizer=self.optimizer_all, activations=0,
                       gathered=0, temporaries=self.pick_all("optimizer_temp_bytes"))
        return [MemoryPoint(label, {**state, MemCategory.TEMPORARIES: state[MemCategory.TEMPORARIES] + scratch})
                for label, scratch in optimizer_scratch(self.table, self.alg)]


def total(point: MemoryPoint):
    return _sum([point.parts[c] for c in CATEGORIES])
