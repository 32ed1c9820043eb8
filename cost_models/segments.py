"""A cost table's segments: maximal runs of consecutive ops owned by one unit, in execution order, each with
what its forward allocates, its backward's peak per way of checkpointing (activations.backward_peak) and
the parameter gradients the units around it have computed by then.

The memory timeline (cost_models.memory) has one forward and one backward point per segment. A unit
nested around others (the root around the blocks) has several segments; the loss is a segment of its
own. Backward peaks are simulated op by op, so they are the costly part of a table: units alike in
everything the simulation reads (table.unit_classes, a model's repeated blocks) share theirs.
"""

from __future__ import annotations

import heapq

from cost_models.activations import BackwardPeak, Segment, backward_peak
from cost_models.op_index import OpIndex
from cost_models.options import Recompute
from cost_models.search_memo import memo
from cost_models.unit_prices import op_content

__all__ = ["build_segments"]


def build_segments(inputs, index: OpIndex, classes: list[int]) -> list[Segment]:
    """The segments of `inputs` (a table.TableInputs); `index`: where its ops are (cost_models.op_index);
    `classes`: per unit, the first unit alike (table.unit_classes)."""
    ops = inputs.ops
    segments: list[Segment] = []
    summed: dict[tuple[int, int], tuple[int, int]] = {}  # (class, place) -> its saved bytes and forward temporaries
    places: dict[int, int] = {}
    for u, first, last in index.runs:
        place = places.get(u, 0)
        places[u] = place + 1
        key = (classes[u], place)  # alike units' runs hold alike ops (unit_classes: contents, relative positions)
        if key not in summed:
            run = ops[first:last + 1]
            summed[key] = (sum(op.saved_bytes for op in run),
                           max(0, *(max(op.fwd_max_alloc_bytes, op.fwd_transient_bytes) for op in run)))
        saved, temp = summed[key]
        segments.append(Segment(u, first, last, saved, temp, outside_model=first == index.loss))
    positions = dict(enumerate(index.unit_positions))  # unit -> where its ops are (unit.ops order)
    _backward_peaks(inputs, segments, index.owners, positions, classes)
    _outer_gradients(inputs, segments, positions)
    return segments


def _backward_peaks(inputs, segments: list[Segment], owners: list[int], positions: dict[int, list[int]],
                    classes: list[int]) -> None:
    """Each segment's backward peak unchecked, fully and selectively checkpointed (each selective policy where
    the inputs say what it keeps), simulated once per class of alike units and the segment's place among its
    unit's segments."""
    ops, kept_saved = inputs.ops, inputs.kept_saved
    simulated: dict[tuple[int, int], tuple] = {}
    ordinal: dict[int, int] = {}
    for seg in segments:
        place = ordinal.get(seg.unit, 0)
        ordinal[seg.unit] = place + 1
        key = (classes[seg.unit], place)
        if key not in simulated:
            where = positions[seg.unit]
            # what the simulation reads: its unit's ops (contents, places around the segment's) and what each mode
            # keeps of them; alike in other tables of the search (another stage, mesh or schedule holding the block)
            reads = (tuple(op_content(ops[p]) for p in where), tuple(p - seg.first_op for p in where),
                     seg.last_op - seg.first_op,
                     tuple(tuple(map(kept_saved[mode].get, (ops[p].name for p in where))) if mode in kept_saved
                           else None for mode in _MODES))
            simulated[key] = memo(("backward peaks", reads), lambda: _simulated(ops, owners, seg, where, kept_saved))
        seg.bwd_peak, seg.bwd_peak_checkpointed, seg.bwd_peak_selective, seg.bwd_peak_alternate = simulated[key]


_MODES = (Recompute.ALL, Recompute.CHEAP, Recompute.ALTERNATE)


def _simulated(ops, owners: list[int], seg: Segment, where: list[int], kept_saved: dict) -> tuple:
    """The segment's backward peaks: unchecked, then checkpointed under each of `_MODES`."""
    return (backward_peak(ops, owners, seg, checkpointed=False, positions=where),
            *(backward_peak(ops, owners, seg, checkpointed=True, kept_saved=kept_saved[mode], positions=where)
              if mode in kept_saved else BackwardPeak(0, 0) for mode in _MODES))


def _outer_gradients(inputs, segments: list[Segment], positions: dict[int, list[int]]) -> None:
    """Per segment, the parameter gradients the units whose ops span it (its unit's parents) have computed
    when its backward runs: those of their ops after it. In op order, a sweep over the units' spans."""
    ops, units = inputs.ops, inputs.units
    by_start = sorted(range(len(units)), key=lambda u: units[u].first_op)
    spanning: list[tuple[int, int]] = []  # (last_op, unit) of the units whose ops span the segment's start
    started = 0
    for seg in segments:
        while started < len(by_start) and units[by_start[started]].first_op <= seg.first_op:
            heapq.heappush(spanning, (units[by_start[started]].last_op, by_start[started]))
            started += 1
        while spanning and spanning[0][0] < seg.first_op:
            heapq.heappop(spanning)
        around = [u for _, u in spanning if u != seg.unit]
        seg.outer_grad_bytes = sum(ops[p].param_grad_bytes for u in around for p in positions.get(u, [])
                                   if p > seg.last_op)
