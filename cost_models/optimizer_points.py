"""The optimizer step's time points: what scratch each holds beside the state (cost_models.memory's timeline ends
with them).

Why a module of its own: a per-tensor optimizer step (the CPU's) holds the scratch of one parameter at a time, and
the largest of those is a maximum over units, which is not linear in the options; this is how the timeline keeps it
linear, apart from the timeline's other points.
"""

from __future__ import annotations

from .algebra import Algebra
from .table import CostTable

__all__ = ["MAX_SCRATCH_POINTS", "optimizer_scratch"]

MAX_SCRATCH_POINTS = 64


def optimizer_scratch(table: CostTable, alg: Algebra) -> list[tuple[str, object]]:
    """The optimizer step's points as (label, the per-tensor scratch it holds beside every unit's state and foreach
    scratch). A foreach step's scratch spans every parameter (`optimizer_temp_bytes`, in the state); a per-tensor
    step's (the CPU's) is that of one parameter at a time, so the step's peak holds the largest of the units'
    `tensor_scratch_bytes`. A maximum is not linear in the options; one point per unit that can hold it is: with
    `surely` the largest scratch some unit has under every option, unit u's point holds max(its scratch, surely),
    and the highest of these points is the plan's maximum. Units that never exceed `surely` need no point; with
    none left, one point holds `surely`. Past MAX_SCRATCH_POINTS units (each point is a solver row over every
    option), one point holds the largest scratch any unit can have: an upper bound."""
    scratch = [[cost.tensor_scratch_bytes for cost in costs] for costs in table.costs]
    surely = max((min(values) for values in scratch), default=0)
    holders = [u for u, values in enumerate(scratch) if max(values) > surely]
    if not holders or len(holders) > MAX_SCRATCH_POINTS:
        return [("optimizer step", max((max(scratch[u]) for u in holders), default=surely))]
    return [("optimizer step" if len(holders) == 1 else f"optimizer step {table.units[u].path or '<root>'}",
             alg.pick(u, [max(v, surely) for v in scratch[u]])) for u in holders]
