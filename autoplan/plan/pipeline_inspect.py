"""`explain` and `diff` of pipelined plans: each pipeline rank's units on the rank's own tables, and the
stage boundaries.

A pipelined plan's units run on different ranks, each with its own memory timeline (its micro-batches in
flight, FSDP's parameters gathered for the step: autoplan.solve.stage_solve). A unit group is explained,
or a difference priced, on the rank that runs it, against that rank's step and peak. The boundaries are
explained by moving each one a unit earlier and a unit later, the decisions kept: the pipeline's step and
its busiest rank's peak then, against the plan's.
"""

from __future__ import annotations

from autoplan.plan.diff import PlanDiff, diff_plans
from autoplan.plan.explain import Explanation, explain_plan
from autoplan.plan.pipeline_report import stage_label
from autoplan.plan.schema import Plan
from autoplan.sizes import format_bytes
from autoplan.solve.pipeline import PipelineOutcome, RankOutcome
from autoplan.solve.stage_solve import held_evaluation

__all__ = ["diff_pipelined", "explain_pipelined", "stage_changes"]


def _of_rank(plan: Plan, rank: RankOutcome) -> Plan:
    """The plan with one rank's units only."""
    paths = {unit.path for unit in rank.table.units}
    return plan.model_copy(update={"units": [u for u in plan.units if u.module in paths]})


def _evaluator(rank: RankOutcome):
    return lambda table, choices: held_evaluation(table, rank.held, choices)


def explain_pipelined(plan: Plan, priced: PipelineOutcome, moved: list[PipelineOutcome]) -> Explanation:
    """The plan's groups explained on their ranks (the root on each), then its stages and boundaries."""
    groups, seen = [], set()
    for rank in priced.ranks:
        part = explain_plan(_of_rank(plan, rank), rank.table, rank.choices, _evaluator(rank))
        for group in part.groups:
            if group.pattern in seen:
                continue
            seen.add(group.pattern)
            groups.append(group.model_copy(update={"why": f"rank {rank.rank}: {group.why}"}))
    busiest = priced.busiest.evaluation
    return Explanation(model=plan.model.name, step_time_s=priced.step_time_s, peak_mem_bytes=busiest.peak_mem_bytes,
                       peak_point=f"rank {priced.busiest.rank}, {busiest.peak_point.label}",
                       mem_limit_bytes=plan.cluster.mem_limit_bytes, planned_bytes=plan.cluster.planned_bytes,
                       margin_bytes=int(plan.cluster.mem_limit_bytes * (1 - plan.cluster.mem_headroom))
                       - plan.cluster.planned_bytes,
                       micro_batch_size=plan.training.micro_batch_size, groups=groups,
                       stages=_stage_lines(plan, priced, moved))


def _stage_lines(plan: Plan, priced: PipelineOutcome, moved: list[PipelineOutcome]) -> list[str]:
    pipe = plan.pipeline
    slowest = max(priced.ranks, key=lambda r: r.slot_s)
    lines = ["", f"pipeline: {len(pipe.stages)} stages on {pipe.degree} ranks, {pipe.schedule}, {pipe.microbatches} "
             f"micro-batches; the boundaries balance the ranks' time per micro-batch (slowest rank {slowest.rank}: "
             f"{slowest.slot_s * 1e3:.2f} ms with its sends, fastest "
             f"{min(r.slot_s for r in priced.ranks) * 1e3:.2f} ms)"]
    for index, stage in enumerate(pipe.stages):
        lines.append(f"  stage {index} (rank {stage.rank}): {stage_label(stage)}; peak {format_bytes(stage.peak_mem_bytes)}"
                     f" with {stage.in_flight:g} micro-batches in flight")
    planned = plan.cluster.planned_bytes
    for outcome in moved:
        changed = [i for i, (a, b) in enumerate(zip(priced.cuts, outcome.cuts)) if a != b]
        if not changed:
            continue
        i = changed[0]
        way = "a unit earlier" if outcome.cuts[i] < priced.cuts[i] else "a unit later"
        peak = outcome.busiest.evaluation.peak_mem_bytes
        fits = "fits" if peak <= planned else f"{format_bytes(peak - planned)} over at rank {outcome.busiest.rank}"
        lines.append(f"  boundary {i - 1}|{i} {way}: step {(outcome.step_time_s - priced.step_time_s) * 1e3:+.2f} ms, "
                     f"peak {format_bytes(peak)} ({fits})")
    return lines


def stage_changes(a: Plan, b: Plan) -> list[str]:
    """The stages whose modules differ between two plans (either may be pipelined)."""
    stages_a = a.pipeline.stages if a.pipeline is not None else []
    stages_b = b.pipeline.stages if b.pipeline is not None else []
    lines = []
    for index in range(max(len(stages_a), len(stages_b))):
        x = stage_label(stages_a[index]) if index < len(stages_a) else "-"
        y = stage_label(stages_b[index]) if index < len(stages_b) else "-"
        if x != y:
            lines.append(f"stage {index}: {x} -> {y}")
    return lines


def diff_pipelined(a: Plan, b: Plan, priced: PipelineOutcome) -> PlanDiff:
    """B's differences from pipelined A, each priced on the A rank running the units (its step and peak)."""
    parts = [diff_plans(_of_rank(a, rank), b, rank.table, rank.choices, _evaluator(rank)) for rank in priced.ranks]
    whole = diff_plans(a, b, priced.ranks[0].table, priced.ranks[0].choices, _evaluator(priced.ranks[0]))
    changes, seen = [], set()
    for part in parts:
        for change in part.changes:
            if change.pattern not in seen:
                seen.add(change.pattern)
                changes.append(change)
    return whole.model_copy(update={"changes": changes, "stages": stage_changes(a, b), "all_step_change_s": None,
                                    "all_peak_change_bytes": None})
