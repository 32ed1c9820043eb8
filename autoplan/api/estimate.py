"""Fixed-strategy estimates: per-rank peak memory by category and step time of one given strategy.

The strategy is uniform (every unit sharded, kept gathered, replicated or hybrid, with or without
activation checkpointing) or a plan file's decisions. This is what accelerate's estimate-memory and
DeepSpeed's ZeRO estimators report, with what they leave out counted: activations saved for
backward, gathered parameters, FSDP's gradient and reduction buffers, and the largest temporaries,
on the same per-rank memory timeline the planner constrains (cost_models.memory).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autoplan.api.heap import young_collections_only
from autoplan.api.prepare import load_plan_of, prepare, wrap_policy_of
from autoplan.errors import PlanFileError, UsageError
from autoplan.models.tp_layout import TpRefusal, check_with_experts, recognise
from autoplan.pins import path_groups
from autoplan.plan.assemble import model_ref, plan_choices, prediction, training_spec, unit_decisions
from autoplan.plan.estimate import Estimate
from autoplan.plan.pipeline_plan import pipeline_spec, pipeline_units
from autoplan.plan.schema import ClusterSpec, Plan
from autoplan.settings import EstimateSettings
from autoplan.sizes import format_bytes
from autoplan.solve.context_tables import context_source
from autoplan.solve.expert_tables import mesh_source
from autoplan.solve.mesh_search import check_beside_tensor_parallelism, check_context
from autoplan.solve.pipeline import PipelineOutcome, fixed_pipelines
from autoplan.solve.request import PlanRequest
from autoplan.solve.stages import forward_units
from cost_models.evaluate import evaluate, uniform_choices
from cost_models.expert_parallel import expert_kind_runs
from cost_models.options import CHECKPOINT_MODES, SHARDING_KINDS
from cost_models.schedules import DEFAULT_SCHEDULE
from cost_models.table import CostTable


def estimate(model: Any = None, strategy: str | None = None, *, settings: EstimateSettings | None = None,
             **fields: Any) -> Estimate:
    """Per-rank peak memory (by category), the memory timeline and the step time of a fixed strategy.

    `strategy`: a sharding kind ("shard", the default, "shard_keep", "replicate", "hybrid", ...) for
    every unit, with `checkpoint` a checkpoint mode ("selective", "full"; True is full) wherever it applies
    (every unit but the root) and `offload=True` putting every unit's state in host memory; or `plan=` (a Plan or a plan file) for its decisions, its model and, unless
    given, its settings (the plan's model is rebuilt from the plan's data only: its zoo config, or its
    "hf:" config relative to the plan file's folder; a plan made from a factory needs `model`).
    `batch_size` is the micro-batch per GPU (default 1); `global_batch` adds gradient accumulation;
    `mem` is a limit to compare with (default: the device's memory; above it only with
    `allow_over_device_mem`). `pins` / `pin` override the units they name (the rest keep the strategy's or
    the plan's options). The fields are `autoplan.settings.EstimateSettings`'s (the same as
    `autoplan estimate`'s flags).

    >>> import autoplan
    >>> est = autoplan.estimate("gpt2-tiny", "shard", checkpoint=True, gpus=2, batch_size=8, seq_len=64)
    >>> est.fits, est.predicted.peak_mem_bytes > est.model_state_bytes
    (True, True)
    """
    s = EstimateSettings.create(settings, model=model, strategy=strategy, **fields)
    with young_collections_only():  # the traces and the table live until the estimate is made (autoplan.api.heap)
        return _estimate(s)


def _estimate(s: EstimateSettings) -> Estimate:
    plan, plan_file = load_plan_of(s.plan)
    request = prepare(s, plan, plan_file)
    if request.meshes[0].pp > 1:
        return _pipelined_estimate(request, plan, s)
    table, choices = request_table(request, plan)
    if plan is not None:
        label = "plan"
        description = f"the plan's decisions ({request.model.name}, limit {format_bytes(plan.cluster.mem_limit_bytes)})"
    else:
        uniform = request.uniform
        mode = CHECKPOINT_MODES[uniform.checkpoint]
        label = uniform.strategy + mode.label + ("+offload" if uniform.offload else "")
        description = (SHARDING_KINDS[uniform.strategy].description + "; " + mode.description
                       + (" on every unit but the root" if mode.checkpoints else "")
                       + ("; parameters, gradients and optimizer states offloaded to the host" if uniform.offload else ""))
    if wrap_policy_of(s) is not None and plan is None:
        description += f"; the units those the FSDP wrap policy {wrap_policy_of(s).text()} wraps"
    choices = _pinned(request, table, choices)
    label, description = _with_pins(request, label, description)
    cluster = request.cluster.with_mesh(request.meshes[0])
    return Estimate(
        model=model_ref(request), strategy=label, description=description,
        cluster=ClusterSpec.of(cluster, request.limits), training=training_spec(table, request),
        units=unit_decisions(table, choices), predicted=prediction(table, evaluate(table, choices),
                                                                   request.limits.allocator_conf),
    )


def _pinned(request: PlanRequest, table: CostTable, choices: list[int]) -> list[int]:
    """The pinned units take their pins; the rest keep the strategy's or the plan's option."""
    return choices if request.pins is None else request.pins.overlay(table, choices)


def _with_pins(request: PlanRequest, label: str, description: str) -> tuple[str, str]:
    """The estimate's label and description with its pins (single blocks alike written as one range,
    "layers.0-94/2: shard+ckpt")."""
    pins = request.pins
    if pins is None:
        return label, description
    return (label + f" + {len(pins.pins)} pin{'s' if len(pins.pins) > 1 else ''}",
            description + "; pinned: " + ", ".join(f"{p}: {d}" for p, _, d in path_groups(pins.records())))


def request_table(request: PlanRequest, plan: Plan | None = None) -> tuple[CostTable, list[int]]:
    """The one table of an estimate's request (its mesh, its micro-batch) and the choices it costs: the plan's
    decisions, or the uniform strategy's. Offload is priced where the strategy or the plan asks for it."""
    [mesh] = request.meshes
    [micro_batch] = request.batch.candidates(mesh.dp)
    layout = request_layout(request)
    cluster, uniform, t = request.cluster.with_mesh(mesh), request.uniform, request.training
    offloads = (uniform is not None and uniform.offload) or (plan is not None and any(u.offload for u in plan.units))
    if mesh.ep > 1 and uniform is not None and not expert_kind_runs(uniform.strategy, uniform.offload):
        raise UsageError(f"expert-parallel degree {mesh.ep}: `strategy` {uniform.strategy}"
                         f"{' with offload' if uniform.offload else ''} does not run beside expert parallelism "
                         "(the experts shard over their group: shard, shard_keep; no offload)")
    if mesh.cp > 1:
        try:
            check_context(request, mesh)
        except TpRefusal as exc:
            raise UsageError(str(exc)) from None
    source = context_source(mesh_source(request, mesh, layout), mesh.cp)
    table = source.table(micro_batch.size, micro_batch.grad_accum_steps, cluster, t.seq_len, t.dtype, t.optimizer,
                         offload=offloads or None)
    table = request.limits.with_margin(table, source)  # the allocator's margin per time point, where fitted to it
    if plan is not None:
        return table, plan_choices(table, plan)
    choices = uniform_choices(table, uniform.strategy, uniform.checkpoint, offload=uniform.offload,
                              exact=uniform.offload)
    if choices is None:
        raise UsageError(f"`offload` needs a profile that prices the host link; {cluster.profile_name} has none "
                         "(see `autoplan profiles`)")
    return table, choices


def request_layout(request: PlanRequest):
    """The tensor-parallel layout of an estimate's mesh (None at degree 1); UsageError where the model or the
    strategy does not take it."""
    [mesh] = request.meshes
    if mesh.tp == 1:
        return None
    try:
        check_beside_tensor_parallelism(request.uniform)
        layout = recognise(request.model.module, mesh.tp, mesh.sequence_parallel)
        check_with_experts(layout, mesh.ep)
        return layout
    except TpRefusal as exc:
        raise UsageError(f"tensor-parallel degree {mesh.tp}: {exc}") from None


def _pipelined_estimate(request: PlanRequest, plan: Plan | None, settings: EstimateSettings) -> Estimate:
    """The estimate of a pipelined mesh: the plan's stages and decisions, or the uniform strategy on
    balanced stages (autoplan.solve.pipeline.fixed_pipeline); the busiest rank's peak and timeline."""
    [outcome] = request_pipeline(request, plan)
    busiest, tensor_parallel = outcome.busiest, request.meshes[0].tp > 1
    uniform = request.uniform
    label = "plan" if plan is not None else uniform.strategy + CHECKPOINT_MODES[uniform.checkpoint].label
    description = (f"the plan's decisions and stages ({request.model.name})" if plan is not None else
                   f"{SHARDING_KINDS[uniform.strategy].description}; {CHECKPOINT_MODES[uniform.checkpoint].description}"
                   f"; {len(outcome.cuts)} stages balanced by predicted time, schedule {outcome.schedule}")
    label, description = _with_pins(request, label, description)

    def decisions_of(rank):
        return unit_decisions(rank.table, rank.choices, rank.source.full_units() if tensor_parallel else None,
                              rank.source.unit_layouts if tensor_parallel else None)

    evaluation = replace(busiest.evaluation, step_time_s=outcome.step_time_s)
    return Estimate(
        model=model_ref(request), strategy=label + f" pp {outcome.degree}", description=description,
        cluster=ClusterSpec.of(request.cluster.with_mesh(request.meshes[0]), request.limits),
        training=training_spec(busiest.table, request),
        units=pipeline_units(outcome, [u.path for u in request.tables.units], decisions_of),
        predicted=prediction(busiest.table, evaluation, request.limits.allocator_conf),
        pipeline=pipeline_spec(outcome))


def request_pipeline(request: PlanRequest, plan: Plan | None = None, moved: bool = False) -> list[PipelineOutcome]:
    """An estimate's (or a plan's) pipeline priced with fixed decisions: the plan's stages, schedule and
    decisions (with `moved`, then each boundary a unit earlier and a unit later), or the uniform strategy on
    balanced stages under `schedule` (default 1F1B)."""
    [mesh] = request.meshes
    if plan is not None and plan.pipeline is not None:
        cuts = plan_cuts(plan, request)
        cut_list = [cuts] + ([moved_cut for i in range(1, len(cuts)) for step in (-1, 1)
                              if (moved_cut := _moved(cuts, i, step, len(forward_units(request.tables.units))))]
                             if moved else [])
        return fixed_pipelines(request, mesh, request_layout(request), plan.pipeline.schedule, cut_list,
                               lambda table: _pinned(request, table, plan_choices(table, _units_of(plan, table))))
    uniform = request.uniform
    schedule = request.schedule or DEFAULT_SCHEDULE

    def decide(table):
        choices = uniform_choices(table, uniform.strategy, uniform.checkpoint, offload=uniform.offload,
                                  exact=uniform.offload)
        if choices is None:
            raise UsageError("`offload` is not priced on this pipeline's stages (its profile has no host link)")
        return _pinned(request, table, choices)

    return fixed_pipelines(request, mesh, request_layout(request), schedule, [None], decide)


def plan_cuts(plan: Plan, request: PlanRequest) -> list[int]:
    """Each of a pipelined plan's stages' first unit, as an index among the model's forward units."""
    order = [request.tables.units[u].path for u in forward_units(request.tables.units)]
    try:
        return [0] + [order.index(next(p for p in stage.units if p)) for stage in plan.pipeline.stages[1:]]
    except (ValueError, StopIteration):
        raise PlanFileError("the plan's pipeline stages do not name the model's units in order") from None


def _moved(cuts: list[int], index: int, step: int, units: int) -> list[int] | None:
    """The cuts with boundary `index` a unit earlier (-1) or later (+1); None where a stage would be empty."""
    moved = list(cuts)
    moved[index] += step
    ends = moved[1:] + [units]
    return moved if all(start < end for start, end in zip(moved, ends)) else None


def _units_of(plan: Plan, table: CostTable) -> Plan:
    """The plan with the units of one rank's table only."""
    paths = {unit.path for unit in table.units}
    return plan.model_copy(update={"units": [u for u in plan.units if u.module in paths]})


__all__ = ["estimate", "plan_cuts", "request_layout", "request_pipeline", "request_table"]
