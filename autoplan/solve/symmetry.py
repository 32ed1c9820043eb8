"""Identical units of a cost table: the groups the solver puts in a canonical order (autoplan.solve.solver's
docstring says why the order loses no plan), and each option's rank in that order."""

from __future__ import annotations

import struct
from operator import itemgetter

from cost_models.table import CostTable

__all__ = ["canonical", "identical_runs"]


def identical_runs(table: CostTable) -> tuple[list[list[int]], list[list[int]]]:
    """Groups (of two or more, in execution order) of units with the same options at the same costs, whose
    ops are one segment each, adjacent or not (pins may cut a model's repeated blocks apart), and per unit
    each option's rank, leanest first (see autoplan.solve.solver's docstring: the canonical order)."""
    segments_of: dict[int, list] = {}
    for seg in table.segments:
        segments_of.setdefault(seg.unit, []).append(seg)

    def signature(u: int):
        segments = segments_of.get(u, [])
        peaks = tuple((seg.bwd_peak, seg.bwd_peak_checkpointed, seg.bwd_peak_selective, seg.bwd_peak_alternate,
                       seg.saved_bytes,
                       seg.fwd_temp_bytes, seg.outer_grad_bytes) for seg in segments)
        # not the parent: what the units around a unit hold adds the same to each of its options
        return tuple(o.label for o in table.options[u]), tuple(map(_cost_key, table.costs[u])), peaks

    order = []
    for u in range(len(table.units)):
        lean = sorted(range(len(table.options[u])),
                      key=lambda i: (table.costs[u][i].activation_bytes + table.costs[u][i].held_bytes, i))
        rank = [0] * len(lean)
        for position, i in enumerate(lean):
            rank[i] = position
        order.append(rank)
    groups: dict[tuple, list[int]] = {}
    for u in range(len(table.units)):
        unit = table.units[u]
        if len(segments_of.get(u, [])) == 1 and u != table.root and not unit.children:
            groups.setdefault(signature(u), []).append(u)
    return [group for group in groups.values() if len(group) > 1], order


def _cost_key(cost) -> tuple:
    """An option's costs, equal where their reprs are (each field's type and value; a float's exact bits, so 0.0
    and -0.0 differ), at a fraction of a dataclass repr's time: the fields' types, the other fields' values and
    the floats packed as bytes (their bits), each in C; a cost holding a NaN (whose bits may differ where its hex
    does not) is keyed field by field, as `_exact_key`."""
    values = tuple(vars(cost).values())
    types = tuple(map(type, values))
    split = _SPLITS.get(types)
    if split is None:
        split = _SPLITS[types] = _split(types)
    floats, others, fmt = split
    packed = floats(values)
    if not all(map(float.__eq__, packed, packed)):  # a NaN
        return _exact_key(values)
    return types, others(values), struct.pack(fmt, *packed)


def _exact_key(values: tuple) -> tuple:
    return tuple(value.hex() if type(value) is float else (type(value), value) for value in values)


_SPLITS: dict[tuple, tuple] = {}  # the fields' types -> (their floats, the others, the floats' struct format)


def _split(types: tuple) -> tuple:
    floats = [i for i, kind in enumerate(types) if kind is float]
    others = [i for i, kind in enumerate(types) if kind is not float]
    return _getter(floats), _getter(others), f"<{len(floats)}d"


def _getter(indices: list[int]):
    """A function of a tuple: its items at `indices`, as a tuple."""
    if not indices:
        return lambda values: ()
    get = itemgetter(*indices)
    return get if len(indices) > 1 else (lambda values: (get(values),))


def canonical(choices: list[int], runs: list[list[int]] | None, order: list[list[int]] | None) -> list[int]:
    """The plan with each group's options put in the canonical order (leanest first), which raises no time point
    (the exchange argument in autoplan.solve.solver's docstring)."""
    choices = list(choices)
    for run in runs or []:
        for u, option in zip(run, sorted((choices[u] for u in run), key=lambda option: order[run[0]][option])):
            choices[u] = option
    return choices
