"""Evaluate one fixed plan (an option index per unit) with the cost model: memory timeline, peak, step time."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.options import DEFAULT_CHECKPOINT, DEFAULT_SHARDING, SHARDING_KINDS, checkpoint_of_bool

from .algebra import NumericAlgebra
from .allocator_margin import fitted_totals
from .memory import CATEGORIES, MemCategory, MemoryPoint, timeline, total
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
    host_bytes: int = 0  # offloaded state in host memory, per rank
    fit_bytes: int | None = None  # where the table carries the allocator's margin: its highest point less the slack

    @property
    def peak_mem_bytes(self) -> int:
        return int(total(self.points[self.peak_index]))

    @property
    def peak_point(self) -> MemoryPoint:
        return self.points[self.peak_index]

    def fits(self, mem_limit_bytes: int, host_limit_bytes: int | None = None) -> bool:
        """Device peak within `mem_limit_bytes` and, given a host limit (per rank), offloaded state within it."""
        fitted = self.peak_mem_bytes if self.fit_bytes is None else self.fit_bytes
        return fitted <= mem_limit_bytes and (host_limit_bytes is None
                                                            or self.host_bytes <= host_limit_bytes)


def evaluate(table: CostTable, choices: list[int]) -> Evaluation:
    alg = NumericAlgebra(choices)
    points = timeline(table, alg)
    totals = [total(p) for p in points]
    peak = max(range(len(points)), key=lambda i: totals[i])
    step = step_time(table, alg)
    host = sum(table.costs[u][c].host_bytes for u, c in enumerate(choices))
    fit = max(fitted_totals(table, points, alg)) if table.allocator is not None else None
    return Evaluation(list(choices), points, peak, float(step.step_s), float(step.micro_batch_s),
                      float(step.optimizer_s), host, fit)


def checkpoint_name(checkpoint: str | bool | None) -> str:
    """A checkpoint mode's name from the forms the API takes: a name, True (full), False/None (none)."""
    return DEFAULT_CHECKPOINT if checkpoint is None else checkpoint_of_bool(checkpoint)


def uniform_choices(table: CostTable, sharding: str, checkpoint: str | bool = DEFAULT_CHECKPOINT,
                    exact: bool = False, offload: bool = False) -> list[int] | None:
    """Option index per unit for a uniform strategy. Units without a checkpointing option run
    without it, units without parameters without offload; a unit not offered the kind (the root is
    not offered kinds that keep parameters gathered, see options_for) takes its resharding twin (same
    shard group, reshard_after_forward, e.g. "shard" for "shard_keep"), else DEFAULT_SHARDING. With
    `exact`, None when the sharding kind itself is not offered (a multi-node kind on one node), or
    offload is asked and offered nowhere."""
    checkpoint = checkpoint_name(checkpoint)
    if exact and offload and not any(o.offload for opts in table.options for o in opts):
        return None
    twins = _resharding_twins(sharding)
    choices = []
    for options in table.options:
        def find(kind: str) -> list[int]:
            ranked = ([i for i, o in enumerate(options) if o.sharding == kind and o.checkpoint == checkpoint
                       and o.offload == offload]
                      or [i for i, o in enumerate(options) if o.sharding == kind and not o.mode.checkpoints
                          and o.offload == offload]
                      or [i for i, o in enumerate(options) if o.sharding == kind and o.checkpoint == checkpoint]
                      or [i for i, o in enumerate(options) if o.sharding == kind and not o.mode.checkpoints])
            return ranked

        match = find(sharding)
        if exact and not match and not any(o.sharding == sharding for opts in table.options for o in opts):
            return None
        for twin in twins:
            match = match or find(twin)
        if not match:
            return None
        choices.append(match[0])
    return choices


def _resharding_twins(sharding: str) -> list[str]:
    """Kinds to fall back to, in order: those of the same shard group that reshard after forward, then
    DEFAULT_SHARDING."""
    kind = SHARDING_KINDS.get(sharding)
    twins = [k.name for k in SHARDING_KINDS.values() if kind is not None and k is not kind
             and k.shard_group == kind.shard_group and k.reshard_after_forward]
    return twins + [DEFAULT_SHARDING]


__all__ = ["CATEGORIES", "MemCategory", "Evaluation", "checkpoint_name", "evaluate", "uniform_choices"]
