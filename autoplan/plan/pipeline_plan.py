"""A pipelined mesh's best plan as plan-file records: the units of every rank and the stages they make.

The pipeline search (autoplan.solve.pipeline) solves each pipeline rank's units apart, the root among them
on every rank (holding only what the rank's ops use). The plan keeps one decision per unit: each block's
from the rank that runs it, the root's from the rank holding most of its parameters (the last stage: the
final norm). Under a pipeline FSDP keeps every unit's parameters gathered from its first forward to the
last backward whatever its sharding kind says (reshard_after_forward off, as torchtitan and torch's
PipelineStage run it): that is what the figures price, and a unit's kind chooses only its shard group. So
every decision records reshard_after_forward=false, which apply follows (it takes false whatever the kind under a
pipeline): with the kind's true, FSDP2 would free a unit's parameters after each micro-batch's forward and gather
them again for its backward: more collectives than priced and another memory timeline than the one priced.
"""

from __future__ import annotations

from autoplan.plan.pipeline_spec import PipelineSpec, StageSpec
from autoplan.plan.schema import UnitDecision
from autoplan.solve.pipeline import PipelineOutcome, RankOutcome
from autoplan.solve.stages import stage_modules

__all__ = ["pipeline_spec", "pipeline_units"]


def pipeline_units(outcome: PipelineOutcome, unit_order: list[str], decisions_of) -> list[UnitDecision]:
    """One decision per unit of the model (in `unit_order`, the model's unit paths), each from the rank running
    it; `decisions_of(rank)`: a rank's UnitDecisions (plan.assemble.unit_decisions on its table)."""
    chosen: dict[str, UnitDecision] = {}
    roots: list[UnitDecision] = []
    for rank in outcome.ranks:
        for decision in decisions_of(rank):
            decision = decision.model_copy(update={"reshard_after_forward": False})  # gathered once per step
            if decision.module == "":
                roots.append(decision)
            else:
                chosen[decision.module] = decision
    # the root's parameters are spread over the ranks whose ops use them: one decision (the rank holding most)
    root = max(roots, key=lambda d: d.params)
    chosen[""] = root.model_copy(update={"params": sum(d.params for d in roots),
                                         "param_shapes": {k: v for d in roots for k, v in d.param_shapes.items()}})
    return [chosen[path] for path in unit_order if path in chosen]


def pipeline_spec(outcome: PipelineOutcome) -> PipelineSpec:
    stages: list[StageSpec] = []
    for rank in outcome.ranks:
        for stage, (first, last) in zip(rank.stages, rank.chunks):
            stages.append(_stage(rank, stage, first, last))
    stages.sort(key=lambda s: s[0])
    return PipelineSpec(degree=outcome.degree, schedule=outcome.schedule, microbatches=outcome.microbatches,
                        stages=[s[1] for s in stages], bubble_s=outcome.bubble_s, p2p_s=outcome.p2p_s,
                        optimizer_s=max(r.evaluation.optimizer_s for r in outcome.ranks))


def _stage(rank: RankOutcome, stage: int, first: int, last: int) -> tuple[int, StageSpec]:
    """Stage `stage` (the ops [first, last] of the model's trace) of `rank`: its modules, its units and their
    share of the rank's time; the rank's peak."""
    positions = rank.positions
    local = [i for i, p in enumerate(positions) if first <= p <= last]
    lo, hi = local[0], local[-1]
    table = rank.table
    units = [u for u, unit in enumerate(table.units) if not unit.is_root and lo <= unit.first_op <= hi]
    if stage == rank.stages[0]:
        units = [next(u for u, unit in enumerate(table.units) if unit.is_root)] + units
    fwd = sum(_fwd(table.costs[u][rank.choices[u]]) for u in units)
    bwd = sum(_bwd(table.costs[u][rank.choices[u]]) for u in units)
    ops = rank.trace_ops
    return stage, StageSpec(rank=rank.rank, modules=stage_modules(table.units, ops, local) or ["<root>"],
                            units=[table.units[u].path for u in units],
                            peak_mem_bytes=rank.evaluation.peak_mem_bytes, fwd_s=fwd, bwd_s=bwd,
                            in_flight=rank.flight)


def _fwd(cost) -> float:
    return cost.fwd_s + cost.comm_fwd_s + cost.overhead_fwd_s


def _bwd(cost) -> float:
    return cost.bwd_s + cost.comm_bwd_s + cost.overhead_bwd_s
