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
from cost_models.options import Recompute
from cost_models.records import LOSS_NODE

__all__ = ["build_segments"]


def build_segments(inputs, owner: dict[str, int], classes: list[int]) -> list[Segment]:
    """The segments of `inputs` (a table.TableInputs); `owner`: op name -> its unit's index; `classes`: per
    unit, the first unit alike (table.unit_classes)."""
    ops = inputs.ops
    segments: list[Segment] = []
    for position, op in enumerate(ops):
        if segments and segments[-1].unit == owner[op.name] and op.name != LOSS_NODE:
            seg = segments[-1]
            seg.last_op = position
        else:
            seg = Segment(owner[op.name], position, position, 0, 0, outside_model=op.name == LOSS_NODE)
            segments.append(seg)
        seg.saved_bytes += op.saved_bytes
        seg.fwd_temp_bytes = max(seg.fwd_temp_bytes, op.fwd_max_alloc_bytes, op.fwd_transient_bytes)
    owners = [owner[op.name] for op in ops]
    positions: dict[int, list[int]] = {}  # unit -> where its ops are: a deep model must not scan every op per segment
    for position, u in enumerate(owners):
        positions.setdefault(u, []).append(position)
    _backward_peaks(inputs, segments, owners, positions, classes)
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
            simulated[key] = (
                backward_peak(ops, owners, seg, checkpointed=False, positions=where),
                *(backward_peak(ops, owners, seg, checkpointed=True, kept_saved=kept_saved[mode], positions=where)
                  if mode in kept_saved else BackwardPeak(0, 0)
                  for mode in (Recompute.ALL, Recompute.CHEAP, Recompute.ALTERNATE)),
            )
        seg.bwd_peak, seg.bwd_peak_checkpointed, seg.bwd_peak_selective, seg.bwd_peak_alternate = simulated[key]


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
