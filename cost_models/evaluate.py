"""Evaluate one fixed plan (an option index per unit) with the cost model: memory timeline, peak, step time."""

from __future__ import annotations

from dataclasses import dataclass

from .algebra import NumericAlgebra
from .memory import CATEGORIES, MemoryPoint, timeline, total
from .step import step_time
from .table import CostTable


@dataclass
class Evaluation:
    choices: list[int]
    points: list[MemoryPoint]
    peak_index: int
    step_time_s: float
    micro_batch_s: float
    optimizer_s: float

    @property
    def peak_mem_bytes(self) -> int:
        return int(total(self.points[self.peak_index]))

    @property
    def peak_point(self) -> MemoryPoint:
        return self.points[self.peak_index]

    def fits(self, mem_limit_bytes: int) -> bool:
        return self.peak_mem_bytes <= mem_limit_bytes


def evaluate(table: CostTable, choices: list[int]) -> Evaluation:
    alg = NumericAlgebra(choices)
    points = timeline(table, alg)
    totals = [total(p) for p in points]
    peak = max(range(len(points)), key=lambda i: totals[i])
    step = step_time(table, alg)
    return Evaluation(list(choices), points, peak, float(step.step_s), float(step.micro_batch_s), float(step.optimizer_s))


def uniform_choices(table: CostTable, sharding: str, checkpoint: bool, exact: bool = False) -> list[int] | None:
    """Option index per unit for a uniform strategy. Units without a checkpointing option run
    without it; the root, which is not offered shard_keep (options_for), takes plain "shard" for
    "shard_keep". With `exact`, None when the sharding kind itself is not offered (hybrid on one node)."""
    choices = []
    for options in table.options:
        match = [i for i, o in enumerate(options) if o.sharding == sharding and o.checkpoint == checkpoint]
        match = match or [i for i, o in enumerate(options) if o.sharding == sharding and not o.checkpoint]
        if exact and not match and not any(o.sharding == sharding for opts in table.options for o in opts):
            return None
        match = match or [i for i, o in enumerate(options) if o.sharding == "shard" and not o.checkpoint]
        if not match:
            return None
        choices.append(match[0])
    return choices


__all__ = ["CATEGORIES", "Evaluation", "evaluate", "uniform_choices"]
