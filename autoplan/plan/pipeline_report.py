"""Readable lines for a plan's pipeline: the stage layout, what the pipeline costs (the bubble, the sends)
and what it saves (each stage's peak beside the best plan without a pipeline).

Like autoplan.plan.report, it reads plans by their fields and never imports the schema.
"""

from __future__ import annotations

from typing import Any

from autoplan.pins import path_groups
from autoplan.sizes import format_bytes
from cost_models.schedules import SCHEDULES

__all__ = ["NO_PIPELINE_NOTE", "pipeline_lines", "stage_label"]

Plan = Any

NO_PIPELINE_NOTE = ("pipelines not searched: the best plan without one fits without offload at an MFU of 40% or "
                    "more (`pp` N searches one)")


def stage_label(stage) -> str:
    """A stage's modules as a range where they are blocks in a row ("layers.0-15")."""
    keyed = [(module, 0) for module in stage.modules]
    return ", ".join(label for label, _paths, _key in path_groups(keyed))


def _name(entry) -> str:
    return f"pp {entry.pp_degree} tp {entry.degree}" + (" +sp" if entry.sequence_parallel else "")


def _why_not(plan: Plan, searched: list) -> list[str]:
    """Why the plan has no pipeline though pipelines were searched: the fastest pipelined plan is slower, or
    none fits (a pipeline cuts the layers, not the sharded state per GPU, and holds each stage's parameters
    unsharded for the step)."""
    fitting = [e for e in searched if e.fits]
    world, seq = plan.cluster.world_size, plan.training.seq_len
    ours = plan.predicted.throughput_tokens_s / world
    pruned = sum(e.note.startswith("pruned") for e in searched)
    # the meshes and schedules whose bound (every unit at its fastest option, with no memory limit or within its rank's:
    # autoplan.solve.slot_bound) cannot beat this plan
    unsolved = (f"; {pruned} pipelined mesh{'es' if pruned > 1 else ''} not searched: no plan of theirs beats this one "
                "even with every unit at its fastest option, with no memory limit or within its rank's"
                ) if pruned else ""
    if fitting:
        best = max(fitting, key=lambda e: e.throughput_samples_s)
        theirs = best.throughput_samples_s * seq / world
        return [f"no pipeline: the fastest pipelined plan found ({_name(best)}, {best.schedule}) runs {theirs:,.0f} "
                f"tokens/s/GPU against this plan's {ours:,.0f} ({theirs / ours:.2f}x): its bubble, sends and "
                "unsharded stage parameters cost more than the collectives it saves" + unsolved]
    if pruned:
        return [f"no pipeline: no pipelined plan beats this one ({ours:,.0f} tokens/s/GPU){unsolved}"
                + ("; the others do not fit" if pruned < len(searched) else "")]
    needs = [(e.note.split("limit of ")[-1].split(" ")[0].replace(",", ""), e) for e in searched]
    needs = [(int(n), e) for n, e in needs if n.isdigit()]
    lines = ["no pipeline: no pipelined mesh fits (a pipeline cuts the layers but not the parameter, gradient and "
             "optimizer state each GPU holds sharded, and keeps each stage's parameters unsharded for the step)"]
    if needs:
        need, entry = min(needs, key=lambda pair: pair[0])
        lines[0] += f"; the leanest, {_name(entry)}, needs at least {format_bytes(need)} per GPU"
    return lines


def pipeline_lines(plan: Plan) -> list[str]:
    """The pipeline's stages and figures, or why there is none (a multi-node plan whose search skipped them)."""
    pipe, solver = plan.pipeline, getattr(plan, "solver", None)
    if pipe is None:
        if solver is None:
            return []
        searched = [e for e in solver.tp_degrees if e.pp_degree > 1]
        if searched:
            return _why_not(plan, searched)
        mfu = getattr(plan.predicted, "mfu", None)
        lean = mfu is not None and mfu >= 0.4 and not any(unit.offload for unit in plan.units)
        return [NO_PIPELINE_NOTE] if plan.cluster.nodes > 1 and solver.tp_degrees and lean else []
    p = plan.predicted
    row = SCHEDULES[pipe.schedule]
    lines = [f"pipeline: {len(pipe.stages)} stages on {pipe.degree} pipeline ranks, schedule {pipe.schedule} "
             f"({row.description}), {pipe.microbatches} micro-batches per step",
             f"  {'stage':>5} {'rank':>4}  {'modules':<44} {'peak/GPU':>10} {'in flight':>9} {'fwd ms':>8} {'bwd ms':>8}"]
    for index, stage in enumerate(pipe.stages):
        label = stage_label(stage)
        label = label if len(label) <= 44 else label[:41] + "..."
        lines.append(f"  {index:>5} {stage.rank:>4}  {label:<44} {format_bytes(stage.peak_mem_bytes):>10} "
                     f"{stage.in_flight:>9.3g} {stage.fwd_s * 1e3:>8.2f} {stage.bwd_s * 1e3:>8.2f}")
    step = p.step_time_s
    lines.append(f"  costs: bubble {pipe.bubble_s * 1e3:.1f} ms ({pipe.bubble_s / step:.0%} of the step), sends "
                 f"{pipe.p2p_s * 1e3:.1f} ms ({pipe.p2p_s / step:.0%}), optimizer after the drain "
                 f"{pipe.optimizer_s * 1e3:.1f} ms")
    plain = next((b for b in getattr(plan, "baselines", []) if b.name == "no-pipeline"), None)
    if plain is not None:
        busiest = max(stage.peak_mem_bytes for stage in pipe.stages)
        lines.append(f"  saves: the busiest stage peaks at {format_bytes(busiest)} against "
                     f"{format_bytes(plain.peak_mem_bytes)} for the best plan without a pipeline, which runs "
                     f"{plain.throughput_samples_s * plan.training.seq_len / plan.cluster.world_size:,.0f} tokens/s/GPU "
                     f"against this plan's {p.throughput_tokens_s / plan.cluster.world_size:,.0f}")
    return lines
