"""The least bytes a cost table's memory rows can reach: at each time point, every unit's least value in each term.

Why: the micro-batch sweep (autoplan.solve.sweep) goes on until a micro-batch where nothing fits, and proving that
took the table's solver rows (a dense row per time point over every option: ~20 ms for a 129-unit model, 60 ms at
3,000 options) and a solve. The 405B-class search on 32 x 8 GPUs paid it once per mesh, most of a tenth of its
CPU. The same timeline (cost_models.memory) and allocator weights (cost_models.allocator_margin.fitted_totals),
evaluated over `LeastAlgebra`, give each point a number no plan's row goes under, in a few milliseconds; where the
highest of them is over the limit, no plan fits, as the solve would have said.

Why it is a bound: a point's row is a sum of terms, each a unit's value under its chosen option (`pick`) times a
weight of at least 0 (the allocator's weights; one plus numbers: a sum), rounded up. Taking each term at its unit's
least value can only lower the sum (a unit in two terms of a point may take different options in them: lower
still), and rounding up is monotone. So every plan's row at the point is at least the floor there. The bound is
weak where one option of a unit is small in one term and large in another (it is not the leanest plan's peak),
strong where memory grows with the micro-batch: the activations of the leanest checkpointing alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from .allocator_margin import fitted_totals
from .memory import timeline
from .table import CostTable

__all__ = ["LeastAlgebra", "memory_floor"]


class LeastAlgebra:
    """The cost formulas with each unit's least value in each term (see the module docstring): plain numbers, as
    NumericAlgebra's, with no plan chosen."""

    def pick(self, unit: int, values: Sequence[int]) -> int:
        return min(values)

    def pick_time(self, unit: int, values: Sequence[float]) -> float:
        return min(values)

    def define(self, expr, name: str):
        return expr


def memory_floor(table: CostTable) -> int:
    """The least bytes any plan of `table` reaches at its highest time point, as its solver rows count them (live
    bytes, or where the table carries the allocator's margin, what that allocator needs less the slack): no plan's
    peak row is under it."""
    return max(fitted_totals(table, timeline(table, LeastAlgebra()), LeastAlgebra()))
