"""Where a cost table's ops are: per op its unit, per unit its ops' positions, the runs of ops that make the
segments, and where the loss is.

None of it reads an op's counts, only the ops' names in order and the units' op names, which do not change with
the micro-batch, the mesh or a tensor-parallel transform. A search builds each source's tables at several
micro-batches (a pipelined mesh's kinds of stage at each too), so while it runs the index is made once per
names and units (cost_models.search_memo, keyed on them) rather than once per table: a 405B-class model's
table has 5,300 ops and its search builds 243 tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.records import LOSS_NODE, Unit
from cost_models.search_memo import memo

__all__ = ["OpIndex", "op_index"]


@dataclass(frozen=True)
class OpIndex:
    """Where `names` (the ops, in order) are among `units`."""

    position: dict[str, int]  # op name -> its position
    owners: list[int]  # per op, the index of the unit that owns it
    unit_positions: list[list[int]]  # per unit, its own ops' positions, in its order (Unit.ops)
    runs: list[tuple[int, int, int]]  # the segments' (unit, first op, last op): maximal runs of one unit's ops
    loss: int | None  # the loss's position (None: not among the ops)
    # per unit, its ops' (position relative to its first, id) where `ids` were given (table.unit_classes)
    op_shapes: list[tuple] | None

    @staticmethod
    def of(names: tuple[str, ...], unit_ops: tuple[tuple[str, ...], ...], ids: tuple[int, ...] | None) -> OpIndex:
        position = {name: p for p, name in enumerate(names)}
        owners = [0] * len(names)
        unit_positions = []
        for u, ops in enumerate(unit_ops):
            where = [position[name] for name in ops]
            for p in where:
                owners[p] = u
            unit_positions.append(where)
        runs: list[list[int]] = []
        for p, (name, u) in enumerate(zip(names, owners)):
            if runs and runs[-1][0] == u and name != LOSS_NODE:
                runs[-1][2] = p
            else:
                runs.append([u, p, p])
        shapes = None
        if ids is not None:
            shapes = [tuple((p - where[0], ids[p]) for p in where) if where else () for where in unit_positions]
        return OpIndex(position, owners, unit_positions, [tuple(run) for run in runs], position.get(LOSS_NODE),
                       shapes)


def op_index(names: tuple[str, ...], units: list[Unit], ids: list[int] | None) -> OpIndex:
    """The index of ops named `names` (in order) among `units`, with their `ids` (table.TableInputs.op_ids)."""
    unit_ops = tuple(tuple(unit.ops) for unit in units)
    ids = tuple(ids) if ids is not None else None
    return memo(("op index", names, unit_ops, ids), lambda: OpIndex.of(names, unit_ops, ids))
