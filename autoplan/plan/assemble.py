"""From the solver's answer to a plan file's records: decisions per unit, predictions, baselines.

The solve stage speaks in cost tables and option indices; a plan speaks in module paths, FSDP2
settings and bytes. This module is the one translation between them, used by the search, the
estimates and the calibration runs alike.

A plan of a mesh search records the whole cluster its best mesh runs on (the world, the nodes, the
tensor-parallel degree and sequence parallelism), every unit's full parameter shapes (apply checks them
against the model) and its layout under tensor parallelism. Where meshes above degree 1 were searched, each
one's best is in `solver.tp_degrees`, and a plan of degree above 1 is compared with the best plan of degree
1 (FSDP alone, the `fsdp-only` baseline) and the uniform baselines of degree 1.
"""

from __future__ import annotations

from autoplan.errors import PlanFileError
from autoplan.plan.expert_spec import ExpertParallelSpec
from autoplan.plan.schema import (
    Baseline,
    ClusterSpec,
    MemoryBreakdown,
    ModelRef,
    Plan,
    Prediction,
    SearchTiming,
    SolverInfo,
    SweepEntry,
    TimelinePoint,
    TpDegreeEntry,
    TrainingSpec,
    UnitDecision,
    UnitPrediction,
)
from autoplan.plan.pipeline_plan import pipeline_spec, pipeline_units
from autoplan.solve.mesh_search import MeshResult, MeshSearch
from autoplan.solve.request import PlanRequest
from autoplan.version import __version__
from cost_models.algebra import NumericAlgebra
from cost_models.allocator_margin import needed_of_points, reserved_bytes, selective_bytes
from cost_models.evaluate import Evaluation, evaluate, uniform_choices
from cost_models.memory import MemCategory, total
from cost_models.records import Unit
from cost_models.table import CostTable
from cost_models.tensor_parallel import UnitLayout

__all__ = ["BASELINES", "FSDP_ONLY", "NO_PIPELINE", "assemble_plan", "baselines", "model_ref", "plan_choices", "prediction", "training_spec",
           "unit_decisions"]

FSDP_ONLY = "fsdp-only"  # the baseline a tensor-parallel plan is compared with: the best plan of degree 1
NO_PIPELINE = "no-pipeline"  # the baseline a pipelined plan is compared with: the best plan without a pipeline
# the uniform plans every search is compared with: (name, sharding kind, checkpoint mode)
BASELINES = (("all-shard", "shard", "none"), ("all-shard+sel", "shard", "selective"), ("all-shard+ckpt", "shard", "full"),
             ("all-replicate", "replicate", "none"))


def _breakdown(point) -> MemoryBreakdown:
    return MemoryBreakdown(**{f"{category.value}_bytes": int(point.parts[category]) for category in MemCategory})


def prediction(table: CostTable, result: Evaluation, allocator_conf: str | None = None) -> Prediction:
    """The plan's predicted figures; on a CUDA profile (an `allocator_conf`) with what the caching allocator
    needs and reserves for the allocated peak (cost_models.allocator_margin)."""
    samples = table.samples_per_step
    needed = (needed_of_points(result.points, allocator_conf, selective_bytes(table, NumericAlgebra(result.choices)),
                               table.allocator) if allocator_conf else 0)
    return Prediction(
        peak_mem_bytes=result.peak_mem_bytes,
        peak_point=result.peak_point.label,
        breakdown=_breakdown(result.peak_point),
        step_time_s=result.step_time_s,
        throughput_samples_s=samples / result.step_time_s,
        throughput_tokens_s=samples * table.seq_len / result.step_time_s,
        timeline=[TimelinePoint(point=p.label, total_bytes=int(total(p)), breakdown=_breakdown(p))
                  for p in result.points],
        host_mem_bytes=result.host_bytes,
        host_mem_per_node_bytes=result.host_bytes * table.mesh.gpus_per_node,
        needed_bytes=needed if allocator_conf else None,
        reserved_bytes=(max(needed, reserved_bytes(result.peak_mem_bytes, allocator_conf,
                                                   table.device_mem_bytes or None)) if allocator_conf else None),
        mfu=table.model_flops * table.grad_accum_steps / (result.step_time_s * table.peak_flops)
        if table.peak_flops and table.model_flops else None,
    )


def unit_decisions(table: CostTable, choices: list[int], full_units: list[Unit] | None = None,
                   layouts: list[UnitLayout | None] | None = None) -> list[UnitDecision]:
    """Each unit's decision and predictions. Under tensor parallelism `table` holds a rank's shards:
    `full_units` are the units as the model holds them (their parameters recorded whole) and `layouts` each
    unit's tensor-parallel layout."""
    decisions = []
    for index, (unit, options, costs, choice) in enumerate(zip(table.units, table.options, table.costs, choices)):
        option, cost = options[choice], costs[choice]
        whole = full_units[index] if full_units is not None else unit
        layout = layouts[index] if layouts is not None else None
        decisions.append(UnitDecision(
            module=unit.path, sharding=option.sharding, checkpoint=option.checkpoint, offload=option.offload,
            reshard_after_forward=option.kind.reshard_after_forward, params=whole.numel,
            param_shapes={p.name: list(p.shape) for p in whole.params},
            predicted=UnitPrediction(
                persistent_bytes=cost.param_bytes + cost.optimizer_bytes, grad_bytes=cost.grad_bytes,
                gathered_bytes=cost.gathered_bytes, activation_bytes=cost.activation_bytes,
                fwd_s=cost.fwd_s, bwd_s=cost.bwd_s, comm_s=cost.comm_fwd_s + cost.comm_bwd_s,
                optimizer_s=cost.optimizer_s, host_bytes=cost.host_bytes,
            ),
            tp=layout.value if layout is not None else None,
        ))
    return decisions


def plan_choices(table: CostTable, plan: Plan) -> list[int]:
    """The plan's option per unit, as option indices into `table`."""
    decisions = {unit.module: unit for unit in plan.units}
    missing = [u.path or "<root>" for u in table.units if u.path not in decisions]
    extra = sorted(set(decisions) - {u.path for u in table.units})
    if missing or extra:
        raise PlanFileError(f"the plan's units do not match the model's at granularity {plan.training.granularity}: "
                            f"missing {missing[:5]}, unknown {extra[:5]}")
    choices = []
    for unit, options in zip(table.units, table.options):
        decision = decisions[unit.path]
        match = [i for i, o in enumerate(options)
                 if (o.sharding, o.checkpoint, o.offload) == (decision.sharding, decision.checkpoint, decision.offload)]
        if not match:
            why = " (offload needs a profile with a host link)" if decision.offload else ""
            raise PlanFileError(f"unit {unit.path or '<root>'}: {decision.label} is not an option on this cluster{why}")
        choices.append(match[0])
    return choices


def baselines(tables: list[CostTable], mem_limit_bytes: int) -> list[Baseline]:
    baselines = []
    for name, sharding, checkpoint in BASELINES:
        best: tuple[CostTable, Evaluation] | None = None
        smallest: tuple[CostTable, Evaluation] | None = None
        for table in tables:
            choices = uniform_choices(table, sharding, checkpoint)
            result = evaluate(table, choices)
            smallest = smallest or (table, result)
            if result.fits(mem_limit_bytes, table.host_limit_bytes):
                throughput = table.samples_per_step / result.step_time_s
                if best is None or throughput > best[0].samples_per_step / best[1].step_time_s:
                    best = (table, result)
        table, result = best or smallest
        baselines.append(Baseline(
            name=name, fits=best is not None, micro_batch_size=table.micro_batch_size,
            peak_mem_bytes=result.peak_mem_bytes, step_time_s=result.step_time_s,
            throughput_samples_s=table.samples_per_step / result.step_time_s,
        ))
    return baselines


def model_ref(request: PlanRequest) -> ModelRef:
    model = request.model
    return ModelRef(name=model.name, config=model.config, n_params=model.n_params, fingerprint=model.fingerprint,
                    tracer=request.tables.tracer, **model.notes)


def training_spec(table: CostTable, request: PlanRequest) -> TrainingSpec:
    t = request.training
    return TrainingSpec(micro_batch_size=table.micro_batch_size, grad_accum_steps=table.grad_accum_steps,
                        global_batch_size=table.samples_per_step, seq_len=t.seq_len, dtype=t.dtype,
                        optimizer=t.optimizer, granularity=request.granularity)


def assemble_plan(search: MeshSearch, request: PlanRequest) -> Plan:
    """The plan file of a mesh search's best result, with its baselines compared at the planned bytes."""
    best, limits = search.best, request.limits
    outcome, result = best.outcome, best.outcome.result
    table = outcome.table
    source = best.source
    tensor_parallel = best.degree > 1 or best.mesh.ep > 1  # the units split: recorded whole, FSDP alone compared
    parallel = tensor_parallel or best.mesh.cp > 1  # beside FSDP alone: compared with its best plan
    solver = SolverInfo(status=result.status, objective_s=result.objective,
                        bound_s=result.bound if result.bound is not None else result.objective,
                        num_variables=outcome.num_variables,
                        num_constraints=outcome.num_constraints,
                        micro_batch_sweep=[SweepEntry(micro_batch_size=s.micro_batch_size,
                                                      grad_accum_steps=s.grad_accum_steps, status=s.status,
                                                      step_time_s=s.step_time_s,
                                                      throughput_samples_s=s.throughput_samples_s)
                                           for s in outcome.steps])
    if parallel or search.tensor_parallel_searched or any(r.pp > 1 for r in search.results):
        solver = solver.model_copy(update={"tp_degrees": [_degree_entry(r) for r in search.results]})
    if best.pipeline is not None:
        return _pipelined_plan(search, request, solver)
    fsdp = search.data_parallel
    return Plan(
        autoplan_version=__version__,
        model=model_ref(request),
        cluster=ClusterSpec.of(best.cluster, limits),
        training=training_spec(table, request),
        units=unit_decisions(table, outcome.choices, source.full_units() if tensor_parallel else None,
                             source.unit_layouts if tensor_parallel else None),
        predicted=prediction(table, outcome.evaluation, limits.allocator_conf),
        solver=solver,
        baselines=(_fsdp_only(fsdp, limits.planned_bytes) if parallel and fsdp is not None
                   else baselines(outcome.tables, limits.planned_bytes)),
        experts=(ExpertParallelSpec(**source.figures(table, outcome.choices, best.cluster)) if best.mesh.ep > 1
                 else None),
        # wall-clock times, apart: identical searches differ only there
        timing=SearchTiming(solver_s=outcome.wall_time_s,
                            tp_degrees_s=[r.wall_time_s for r in search.results] if solver.tp_degrees else []),
    )


def _pipelined_plan(search: MeshSearch, request: PlanRequest, solver: SolverInfo) -> Plan:
    """The plan of a pipelined best mesh: every rank's units, the stages, the best plan without a pipeline
    (and its baselines) to compare with."""
    best, limits = search.best, request.limits
    outcome, pipeline = best.outcome, best.pipeline
    tensor_parallel = best.degree > 1

    def decisions_of(rank):
        return unit_decisions(rank.table, rank.choices, rank.source.full_units() if tensor_parallel else None,
                              rank.source.unit_layouts if tensor_parallel else None)

    predicted = prediction(outcome.table, outcome.evaluation, limits.allocator_conf)
    flops = sum(r.table.model_flops for r in pipeline.ranks) / len(pipeline.ranks)
    if flops and outcome.table.peak_flops:
        predicted = predicted.model_copy(update={"mfu": flops * pipeline.microbatches
                                                 / (pipeline.step_time_s * outcome.table.peak_flops)})
    plain = search.without_pipeline
    return Plan(
        autoplan_version=__version__, model=model_ref(request), cluster=ClusterSpec.of(best.cluster, limits),
        training=training_spec(outcome.table, request),
        units=pipeline_units(pipeline, [u.path for u in request.tables.units], decisions_of),
        predicted=predicted, solver=solver,
        baselines=_no_pipeline(plain, limits.planned_bytes) if plain is not None else [],
        pipeline=pipeline_spec(pipeline),
        timing=SearchTiming(solver_s=outcome.wall_time_s, tp_degrees_s=[r.wall_time_s for r in search.results]),
    )


def _no_pipeline(result: MeshResult, planned_bytes: int) -> list[Baseline]:
    """The best plan without a pipeline as a baseline (NO_PIPELINE), then its own mesh's uniform baselines."""
    outcome = result.outcome
    best = Baseline(name=NO_PIPELINE, fits=True, micro_batch_size=outcome.table.micro_batch_size,
                    peak_mem_bytes=outcome.evaluation.peak_mem_bytes, step_time_s=outcome.evaluation.step_time_s,
                    throughput_samples_s=result.throughput)
    return [best] + baselines(outcome.tables, planned_bytes)


def _degree_entry(result: MeshResult) -> TpDegreeEntry:
    outcome = result.outcome
    pp = {"pp_degree": result.pp, "schedule": result.pipeline.schedule if result.pipeline else None}
    if outcome is None:
        note = result.refused or ""
        if result.error is not None and result.error.min_mem_bytes:
            note = f"nothing fits (the leanest plan needs a limit of {result.error.min_mem_bytes:,} bytes)"
        return TpDegreeEntry(degree=result.degree, sequence_parallel=result.sequence_parallel,
                             ep_degree=result.mesh.ep, cp_degree=result.mesh.cp, fits=False, note=note, **pp)
    evaluation = outcome.evaluation
    return TpDegreeEntry(degree=result.degree, sequence_parallel=result.sequence_parallel, ep_degree=result.mesh.ep,
                         cp_degree=result.mesh.cp, fits=True, **pp,
                         micro_batch_size=outcome.table.micro_batch_size,
                         grad_accum_steps=outcome.table.grad_accum_steps, step_time_s=evaluation.step_time_s,
                         throughput_samples_s=result.throughput, peak_mem_bytes=evaluation.peak_mem_bytes)


def _fsdp_only(result: MeshResult, planned_bytes: int) -> list[Baseline]:
    """The best plan of degree 1 as a baseline, then the uniform baselines of degree 1."""
    if result.outcome is None:
        needed = result.error.min_mem_bytes if result.error is not None else None
        return [Baseline(name=FSDP_ONLY, fits=False, micro_batch_size=1, peak_mem_bytes=needed or 0,
                         step_time_s=0.0, throughput_samples_s=0.0)]
    outcome = result.outcome
    best = Baseline(name=FSDP_ONLY, fits=True, micro_batch_size=outcome.table.micro_batch_size,
                    peak_mem_bytes=outcome.evaluation.peak_mem_bytes, step_time_s=outcome.evaluation.step_time_s,
                    throughput_samples_s=result.throughput)
    return [best] + baselines(outcome.tables, planned_bytes)
