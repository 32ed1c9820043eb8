"""The plan of a mesh search: every tensor-parallel degree swept (autoplan.solve.tp_search), the fastest kept.

A degree above 1 is searched on the data-parallel view of the cluster; its plan file says what runs on
the whole cluster: the world, the nodes, `tp_degree` and sequence parallelism, every unit's full
parameter shapes (apply checks them against the model) and its layout under tensor parallelism. Each
degree's best is in `solver.tp_degrees`; a plan with a degree above 1 is compared with the best plan of
degree 1 (FSDP alone, the `fsdp-only` baseline) and the uniform baselines of degree 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from autoplan.plan.assemble import assemble_plan, baselines
from autoplan.plan.schema import Baseline, Plan, TpDegreeEntry
from autoplan.solve.cluster import Cluster
from autoplan.solve.tables import CostTables
from autoplan.solve.tp_search import DegreeResult, TpTables, best_result, sweep_degrees

__all__ = ["FSDP_ONLY", "search_mesh"]

FSDP_ONLY = "fsdp-only"  # the baseline a tensor-parallel plan is compared with: the best plan of degree 1


def _entry(result: DegreeResult) -> TpDegreeEntry:
    outcome = result.outcome
    if outcome is None:
        note = result.refused or ""
        if result.error is not None and result.error.min_mem_bytes:
            note = f"nothing fits (the leanest plan needs a limit of {result.error.min_mem_bytes:,} bytes)"
        return TpDegreeEntry(degree=result.degree, sequence_parallel=result.sequence_parallel, fits=False,
                             wall_time_s=result.wall_time_s, note=note)
    evaluation = outcome.evaluation
    return TpDegreeEntry(degree=result.degree, sequence_parallel=result.sequence_parallel, fits=True,
                         micro_batch_size=outcome.table.micro_batch_size,
                         grad_accum_steps=outcome.table.grad_accum_steps, step_time_s=evaluation.step_time_s,
                         throughput_samples_s=result.throughput, peak_mem_bytes=evaluation.peak_mem_bytes,
                         wall_time_s=result.wall_time_s)


def _fsdp_only(result: DegreeResult, planned_bytes: int) -> list[Baseline]:
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


def _whole_cluster(plan: Plan, result: DegreeResult, cluster: Cluster, tables: TpTables) -> Plan:
    """A plan searched on the data-parallel view, as the whole cluster runs it."""
    spec = plan.cluster.model_copy(update={
        "world_size": cluster.shape.world_size, "nodes": cluster.shape.nodes,
        "gpus_per_node": cluster.shape.gpus_per_node, "tp_degree": result.degree,
        "sequence_parallel": result.sequence_parallel, "host_mem_bytes": None})
    units = [decision.model_copy(update={
        "params": unit.numel, "param_shapes": {p.name: list(p.shape) for p in unit.params},
        "tp": tag.value if tag is not None else None})
        for decision, unit, tag in zip(plan.units, tables.base.units, tables.unit_layouts, strict=True)]
    return plan.model_copy(update={"cluster": spec, "units": units})


def search_mesh(module: nn.Module, tables: CostTables, cluster: Cluster, degrees: list[int],
                candidates_of: Callable[[int], list[tuple[int, int]]], *, strategy: str | None, offload: bool,
                sweep_args: dict[str, Any], assemble_args: dict[str, Any],
                sequence_parallel: bool | None = None) -> Plan:
    """The fastest plan over `degrees` (each with and without sequence parallelism above 1). Where no degree
    above 1 could be searched (the model's blocks are not recognised), the plan of degree 1 as a plain search
    makes it, with nothing added. `sequence_parallel` True or False searches only that variant above 1."""
    results = sweep_degrees(module, tables, cluster, degrees, candidates_of, strategy=strategy, offload=offload,
                            sequence_parallel=sequence_parallel, **sweep_args)
    best = best_result(results)  # raises the InfeasibleError needing the least memory when nothing fits
    searched = [r for r in results if r.degree > 1 and r.layout is not None]
    if best.degree == 1:
        plan = assemble_plan(best.outcome, cluster=cluster, **assemble_args)
        if not searched:
            return plan
    else:
        plan = assemble_plan(best.outcome, cluster=best.cluster, **assemble_args)
        plan = _whole_cluster(plan, best, cluster, best.tables)
        fsdp = next((r for r in results if r.degree == 1), None)
        if fsdp is not None:
            plan = plan.model_copy(update={"baselines": _fsdp_only(fsdp, assemble_args["planned_bytes"])})
    solver = plan.solver.model_copy(update={"tp_degrees": [_entry(r) for r in results]})
    return plan.model_copy(update={"solver": solver})
