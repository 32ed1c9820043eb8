"""One pipeline rank's units solved by the per-unit CP-SAT solver with what the rank holds all step.

The solver's memory rows are one micro-batch's timeline (cost_models.memory); a pipelined rank holds more
at every forward and backward point (cost_models.pipeline.HeldAllStep: other micro-batches' activations,
the unsharded parameters and gradients FSDP keeps through the step), each a constant of the unit's option.
They are added to the solver's model's rows (`AffineModel.rows`) and to the evaluation's points, the
optimizer step's points excepted (the last backward reshards and frees them), so the solver and the
evaluation price one memory timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autoplan.solve.request import PlanRequest
from autoplan.solve.solver import AffineModel, SolveResult, SolveStatus, solve_min_time
from cost_models.choices import searched_options
from cost_models.evaluate import Evaluation, evaluate, uniform_choices
from cost_models.memory import MemCategory, MemoryPoint, phase_of, total
from cost_models.pipeline import HeldAllStep
from cost_models.table import CostTable

__all__ = ["RankSolve", "held_evaluation", "leanest", "solve_rank"]


@dataclass(frozen=True)
class RankSolve:
    """A rank's solve: its choices (None: nothing fits), the solver's status, and the least any plan of its
    units can peak at (a bound: each point's smallest bytes, unit by unit)."""

    choices: list[int] | None
    status: SolveStatus
    floor_bytes: int


def solve_rank(request: PlanRequest, table: CostTable, held: HeldAllStep) -> RankSolve:
    """The rank's fastest choices within the request's planned bytes (or its uniform strategy's, where they fit).
    A rank whose floor is over the limit is not handed to CP-SAT (its proof of infeasibility can take long)."""
    limit = request.limits.planned_bytes
    if request.uniform is not None:
        u = request.uniform
        choices = uniform_choices(table, u.strategy, u.checkpoint, offload=u.offload)
        peak = held_evaluation(table, held, choices).peak_mem_bytes if choices is not None else limit + 1
        return RankSolve(choices if peak <= limit else None, SolveStatus.FIXED, peak)
    keep = [searched_options(options) for options in table.options]
    searched = replace(table, options=[[o[i] for i in k] for o, k in zip(table.options, keep)],
                       costs=[[c[i] for i in k] for c, k in zip(table.costs, keep)])
    kept = HeldAllStep(*[[[values[u][i] for i in k] for u, k in enumerate(keep)]
                         for values in (held.activations, held.gathered, held.grads)], held.buffers)
    affine = AffineModel.of(searched)
    _add_held(affine, searched, kept)
    floor = affine.rows.floor(affine.algebra.offsets)
    if floor > limit:
        return RankSolve(None, SolveStatus.INFEASIBLE, floor)
    result: SolveResult = solve_min_time(searched, limit, request.limits.time_limit_s, affine=affine)
    if result.choices is None:
        return RankSolve(None, result.status, floor)
    return RankSolve([k[c] for k, c in zip(keep, result.choices)], result.status, floor)


def _add_held(affine: AffineModel, table: CostTable, held: HeldAllStep) -> None:
    """What the rank holds all step added to every forward and backward point's row of the solver's model."""
    labels = [p.label for p in evaluate(table, [0] * len(table.units)).points]
    vector = np.array([held.total(u, o) for u in range(len(table.units)) for o in range(len(table.options[u]))],
                      dtype=np.int64)
    affine.rows.add([row for row, label in enumerate(labels) if phase_of(label) != "optimizer"], vector,
                    held.buffers)


def held_evaluation(table: CostTable, held: HeldAllStep, choices: list[int]) -> Evaluation:
    """The rank's evaluation with what it holds all step in its forward and backward points."""
    e = evaluate(table, choices)
    activations = sum(held.activations[u][c] for u, c in enumerate(choices))
    gathered = sum(held.gathered[u][c] for u, c in enumerate(choices))
    grads = sum(held.grads[u][c] for u, c in enumerate(choices))
    points = []
    for p in e.points:
        parts = dict(p.parts)
        parts[MemCategory.ACTIVATIONS] += held.buffers
        if phase_of(p.label) == "optimizer":
            points.append(MemoryPoint(p.label, parts))
            continue
        parts[MemCategory.ACTIVATIONS] += activations
        parts[MemCategory.GATHERED] += gathered
        parts[MemCategory.GRADS] += grads
        points.append(MemoryPoint(p.label, parts))
    peak = max(range(len(points)), key=lambda i: total(points[i]))
    return replace(e, points=points, peak_index=peak)


def leanest(table: CostTable, held: HeldAllStep) -> list[int]:
    """Per unit, the option holding least (a rough leanest plan, for the message where nothing fits)."""
    return [min(range(len(costs)), key=lambda o: (costs[o].activation_bytes + held.total(u, o) + costs[o].param_bytes
                                                   + costs[o].optimizer_bytes, o))
            for u, costs in enumerate(table.costs)]
