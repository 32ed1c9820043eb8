"""A model's cost tables as one rank of an expert-parallel group sees them: a transform of any table source,
as `TensorParallelTables` is of the traced one (autoplan.solve.tables).

The transform (cost_models.expert_parallel): each expert stack holds E / ep experts; its options are priced
again on the experts' data-parallel group (`Mesh.experts_view`: dp / ep ranks, its FSDP collectives 1/ep of
the stack's) and kept to the kinds that run beside expert parallelism; its all-to-all dispatch and combine
are added to its forward and backward. Every other unit is the base source's.
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.models.experts import ExpertInfo
from autoplan.solve.cluster import Cluster
from autoplan.solve.request import PlanRequest
from autoplan.solve.tables import TableSource, _Source
from cost_models.expert_parallel import (
    ExpertLayout,
    all_to_all_bytes,
    all_to_all_times,
    ep_units,
    expert_options,
    expert_unit_indices,
)
from cost_models.mesh import Mesh
from cost_models.option_cost import UnitPricer
from cost_models.options import Recompute
from cost_models.records import Unit
from cost_models.table import CostTable, TableInputs
from cost_models.tensor_parallel import TpLayout
from cost_models.tp_time import add_tp_time
from cost_models.training import Training

__all__ = ["ExpertParallelTables", "expert_layout", "mesh_source"]


def mesh_source(request: PlanRequest, mesh: Mesh, layout: TpLayout | None) -> TableSource:
    """The tables one rank of `mesh` sees: under its tensor-parallel `layout`, then its experts split `mesh.ep`
    ways (the search's and the estimate's, alike); without expert parallelism, a model with fewer experts than
    data-parallel ranks has them sharded on their second dimension (as `apply` does: autoplan.run.experts)."""
    source = request.tables.for_layout(layout)
    experts = request.model.experts if mesh.ep > 1 or mesh.dp > 1 else ExpertInfo()
    if mesh.ep == 1 and not (experts and experts.n_experts < mesh.dp):  # split, or sharded on their second dim
        return source
    factor = request.model.notes.get("capacity_factor", 1.0)
    return ExpertParallelTables(source, expert_layout(experts, mesh.ep, factor), mesh.expert_shard)


def expert_layout(experts: ExpertInfo, degree: int, capacity_factor: float = 1.0) -> ExpertLayout:
    """The cost model's layout of a model's experts at an expert-parallel degree."""
    return ExpertLayout(degree, experts.stacks, experts.n_experts, experts.top_k, experts.hidden, capacity_factor)


class ExpertParallelTables(_Source):
    """`base`'s tables with the model's experts split `layout.degree` ways (see the module docstring)."""

    def __init__(self, base: TableSource, layout: ExpertLayout, expert_shard: int):
        self.base, self.layout = base, layout
        self.tracer = base.tracer
        self.units = ep_units(base.units, layout, expert_shard)
        self.experts = expert_unit_indices(base.units, layout)
        self.unit_layouts = getattr(base, "unit_layouts", [None] * len(base.units))
        self._inputs: dict[tuple, TableInputs] = {}  # by micro-batch and training: each table reads them twice

    def inputs(self, micro_batch_size: int, training: Training) -> TableInputs:
        """The base inputs with the expert stacks' parameters as one rank holds them."""
        key = (micro_batch_size, training)
        if key not in self._inputs:
            self._inputs[key] = replace(self.base.inputs(micro_batch_size, training), units=self.units)
        return self._inputs[key]

    def finish(self, table: CostTable, cluster: Cluster) -> CostTable:
        return self.base.finish(table, cluster) if isinstance(self.base, _Source) else table

    def table(self, micro_batch_size: int, grad_accum_steps: int, cluster: Cluster, seq_len: int, dtype: str,
              optimizer: str, offload: bool | None = None) -> CostTable:
        """The base's table of this rank's inputs, each expert stack priced again on its own group, with its
        all-to-alls."""
        table = super().table(micro_batch_size, grad_accum_steps, cluster, seq_len, dtype, optimizer, offload)
        if self.layout.degree == 1:  # FSDP alone: the stacks' shapes only (sharded on their second dimension)
            return table
        training = Training(seq_len, dtype, optimizer)
        inputs = self.inputs(micro_batch_size, training)
        pricer = UnitPricer(cluster.profile, cluster.mesh.experts_view(), training, False)
        ops = {op.name: op for op in inputs.ops}
        options, costs = list(table.options), list(table.costs)
        for u in self.experts:
            unit = self.units[u]
            times = pricer.unit_times([ops[name] for name in unit.ops])
            options[u] = [options[u][i] for i in expert_options(options[u])]
            costs[u] = [pricer.option_cost(unit, option, times, inputs.keep, inputs.backward_keep, u)
                        for option in options[u]]
        nbytes = all_to_all_bytes(self.layout, micro_batch_size, seq_len, table.precision.compute_bytes)
        fsdp = cluster.profile.fsdp
        add_tp_time(options, costs, all_to_all_times(self.units, self.layout, nbytes, cluster.profile, cluster.mesh),
                    fsdp.collective_fwd_s, fsdp.collective_bwd_s)
        return replace(table, options=options, costs=costs)

    def figures(self, table: CostTable, choices: list[int], cluster: Cluster) -> dict:
        """What the plan records of the split (autoplan.plan.expert_spec): the all-to-alls of a step under the
        chosen options (a fully checkpointed stack runs its forward's again), and a gathered stack's bytes."""
        mesh, layout = cluster.mesh, self.layout
        nbytes = all_to_all_bytes(layout, table.micro_batch_size, table.seq_len, table.precision.compute_bytes)
        times = all_to_all_times(self.units, layout, nbytes, cluster.profile, mesh)
        step = sum(times[u].fwd_s * (2 if table.options[u][choices[u]].recompute is Recompute.ALL else 1)
                   + times[u].bwd_s for u in self.experts) * table.grad_accum_steps
        whole = sum(p.numel for p in self.base.units[self.experts[0]].params) if self.experts else 0
        compute = table.precision.compute_bytes
        return dict(degree=layout.degree, stacks=len(self.experts), experts_per_rank=layout.n_experts // layout.degree,
                    expert_shard=mesh.expert_shard, scope=mesh.expert_scope, all_to_all_bytes=nbytes,
                    all_to_all_s=step, gathered_stack_bytes=whole // layout.degree * compute,
                    gathered_stack_bytes_fsdp_only=whole * compute)

    def full_units(self) -> list[Unit]:
        """The units as the whole model holds them (the plan records their full parameter shapes)."""
        full = getattr(self.base, "full_units", None)
        return full() if full is not None else self.base.units
