"""From the solver's answer to a plan file's records: decisions per unit, predictions, baselines.

The solve stage speaks in cost tables and option indices; a plan speaks in module paths, FSDP2
settings and bytes. This module is the one translation between them, used by the search, the
estimates and the calibration runs alike.
"""

from __future__ import annotations

from autoplan.plan.schema import (
    Baseline,
    ClusterSpec,
    MemoryBreakdown,
    ModelRef,
    Plan,
    Prediction,
    SolverInfo,
    SweepEntry,
    TimelinePoint,
    TrainingSpec,
    UnitDecision,
    UnitPrediction,
)
from autoplan.solve.cluster import Cluster
from autoplan.solve.sweep import SweepOutcome
from autoplan.version import __version__
from cost_models.allocator import reserved_bound
from cost_models.evaluate import Evaluation, evaluate, uniform_choices
from cost_models.memory import MemCategory, total
from cost_models.table import CostTable

__all__ = ["BASELINES", "assemble_plan", "baselines", "prediction", "unit_decisions"]

# the uniform plans every search is compared with: (name, sharding kind, checkpoint mode)
BASELINES = (("all-shard", "shard", "none"), ("all-shard+sel", "shard", "selective"), ("all-shard+ckpt", "shard", "full"),
             ("all-replicate", "replicate", "none"))


def _breakdown(point) -> MemoryBreakdown:
    return MemoryBreakdown(**{f"{category.value}_bytes": int(point.parts[category]) for category in MemCategory})


def prediction(table: CostTable, result: Evaluation, device_type: str | None = None) -> Prediction:
    """The plan's predicted figures; on a CUDA profile (`device_type` "cuda") with what the caching allocator
    reserves for the allocated peak (cost_models.allocator)."""
    samples = table.samples_per_step
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
        host_mem_per_node_bytes=result.host_bytes * table.cluster.gpus_per_node,
        reserved_bytes=reserved_bound(result.peak_mem_bytes) if device_type == "cuda" else None,
    )


def unit_decisions(table: CostTable, choices: list[int]) -> list[UnitDecision]:
    decisions = []
    for unit, options, costs, choice in zip(table.units, table.options, table.costs, choices):
        option, cost = options[choice], costs[choice]
        decisions.append(UnitDecision(
            module=unit.path, sharding=option.sharding, checkpoint=option.checkpoint, offload=option.offload,
            reshard_after_forward=option.kind.reshard_after_forward, params=unit.numel,
            param_shapes={p.name: list(p.shape) for p in unit.params},
            predicted=UnitPrediction(
                persistent_bytes=cost.param_bytes + cost.optimizer_bytes, grad_bytes=cost.grad_bytes,
                gathered_bytes=cost.gathered_bytes, activation_bytes=cost.activation_bytes,
                fwd_s=cost.fwd_s, bwd_s=cost.bwd_s, comm_s=cost.comm_fwd_s + cost.comm_bwd_s,
                optimizer_s=cost.optimizer_s, host_bytes=cost.host_bytes,
            ),
        ))
    return decisions


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


def assemble_plan(outcome: SweepOutcome, *, model: ModelRef, cluster: Cluster, mem_limit_bytes: int, headroom: float,
                  seq_len: int, dtype: str, optimizer: str, granularity: str, planned_bytes: int) -> Plan:
    """The plan file of a sweep's answer, with its baselines compared at `planned_bytes`."""
    table, result = outcome.table, outcome.result
    return Plan(
        autoplan_version=__version__,
        model=model,
        cluster=ClusterSpec(world_size=cluster.shape.world_size, nodes=cluster.shape.nodes,
                            gpus_per_node=cluster.shape.gpus_per_node, profile=cluster.profile_name,
                            device_mem_bytes=cluster.profile.mem_bytes, mem_limit_bytes=mem_limit_bytes,
                            mem_headroom=headroom,
                            host_mem_bytes=cluster.host_mem_bytes if cluster.offload_allowed else None),
        training=TrainingSpec(micro_batch_size=table.micro_batch_size, grad_accum_steps=table.grad_accum_steps,
                              global_batch_size=table.samples_per_step, seq_len=seq_len, dtype=dtype,
                              optimizer=optimizer, granularity=granularity),
        units=unit_decisions(table, outcome.choices),
        predicted=prediction(table, outcome.evaluation, cluster.profile.device_type),
        solver=SolverInfo(status=result.status, objective_s=result.objective, bound_s=result.bound,
                          wall_time_s=outcome.wall_time_s, num_variables=outcome.num_variables,
                          num_constraints=outcome.num_constraints,
                          micro_batch_sweep=[SweepEntry(micro_batch_size=s.micro_batch_size,
                                                        grad_accum_steps=s.grad_accum_steps, status=s.status,
                                                        step_time_s=s.step_time_s,
                                                        throughput_samples_s=s.throughput_samples_s)
                                             for s in outcome.steps]),
        baselines=baselines(outcome.tables, planned_bytes),
    )
