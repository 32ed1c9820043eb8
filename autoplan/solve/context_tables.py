"""A model's cost tables as one rank of a context-parallel group sees them: a transform of any table source.

Context parallelism of degree c splits each sequence over c ranks (cost_models.context_parallel has the
formulas and where they come from): this source divides the ops' FLOPs and activations, and what a
checkpointed unit keeps, by c, adds each ring-attention call's buffers, and after the table is built adds
the part of the ring's K/V traffic that each block's attention does not hide. It wraps the model's tables
or their tensor-parallel view alike, so a mesh of both degrees is the one transform after the other
(torchtitan's order: tensor parallelism inside, context parallelism around it). The sharding kinds that
run beside it are those over the whole FSDP dimension (data x context parallel ranks, a 1-D mesh that
`apply` flattens); replicate and hybrid would need the 3-D mesh it does not build.
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.solve.cluster import Cluster
from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.context_parallel import cp_ops, is_ring_attention, ring_exposed_s
from cost_models.options import MeshShape
from cost_models.tensor_parallel import TpLayout
from autoplan.solve.tables import CostTables, TableSource, _Source
from cost_models.table import CostTable, TableInputs
from cost_models.tp_time import TpTime, add_tp_time
from cost_models.training import Training

__all__ = ["ContextParallelTables", "MIN_CONTEXT_SEQ", "context_refusal", "context_source", "source_of"]

MIN_CONTEXT_SEQ = 16384  # a search tries context-parallel degrees from sequences this long up


def source_of(tables: CostTables, layout: TpLayout | None, cp: int) -> TableSource:
    """The model's tables under a tensor-parallel layout (CostTables.for_layout) at context-parallel degree `cp`."""
    source = tables.for_layout(layout)
    return source if cp == 1 else ContextParallelTables(source, cp)


def context_source(source: TableSource, cp: int) -> TableSource:
    """`source` (a mesh's tables) as one rank of a context-parallel group of degree `cp` sees them."""
    return source if cp == 1 else ContextParallelTables(source, cp)


class ContextParallelTables(_Source):
    """`base` (CostTables or TensorParallelTables) as one rank of a context-parallel group of degree `cp`."""

    def __init__(self, base, cp: int):
        self.base, self.cp = base, cp
        self.tracer, self.units, self.op_ids = base.tracer, base.units, base.op_ids
        self.layout = getattr(base, "layout", None)  # the tensor-parallel layout under it, if any
        self._inputs: dict[tuple, TableInputs] = {}

    @property
    def unit_layouts(self):
        return getattr(self.base, "unit_layouts", [None] * len(self.units))

    def full_units(self):
        return self.base.full_units() if hasattr(self.base, "full_units") else self.units

    def inputs(self, micro_batch_size: int, training: Training) -> TableInputs:
        """The base's inputs at this micro-batch, as a rank of the group runs them (1/c of each sequence)."""
        key = (micro_batch_size, training.seq_len, training.precision.name)
        if key not in self._inputs:
            base, c = self.base.inputs(micro_batch_size, training), self.cp

            def div(values: list[int]) -> list[int]:
                return [-(-v // c) for v in values]

            self._inputs[key] = TableInputs(
                units=base.units, ops=cp_ops(base.ops, c),
                keep={mode: div(v) for mode, v in base.keep.items()},
                backward_keep={mode: div(v) for mode, v in base.backward_keep.items()},
                kept_saved={mode: {name: -(-b // c) for name, b in entries.items()}
                            for mode, entries in base.kept_saved.items()},
                op_ids=base.op_ids)
        return self._inputs[key]

    def finish(self, table: CostTable, cluster: Cluster) -> CostTable:
        """The base's additions, only the kinds over the whole FSDP dimension, and each unit's exposed ring
        traffic (autoplan.solve.tables builds the table of `inputs` first, as every source's)."""
        # the base's additions (tensor-parallel collectives) move the rank's 1/c of each sequence
        local = self.base.finish(replace(table, seq_len=table.seq_len // self.cp), cluster)
        table = _whole_dimension_kinds(replace(local, seq_len=table.seq_len))
        inputs = self._inputs[(table.micro_batch_size, table.seq_len, table.precision.name)]
        fsdp = cluster.profile.fsdp
        add_tp_time(table.options, table.costs, self.ring_times(inputs, cluster, table.precision.compute_dtype),
                    fsdp.collective_fwd_s, fsdp.collective_bwd_s)
        return table

    def ring_times(self, inputs: TableInputs, cluster: Cluster, compute_dtype: str) -> list[TpTime]:
        """Per unit, its attention calls' exposed ring traffic (forward, backward) and the calls it makes."""
        comm = CommModel(cluster.profile, cluster.mesh.gpus_per_node)
        compute, fsdp = ComputeModel(cluster.profile, compute_dtype), cluster.profile.fsdp
        by_name = {op.name: op for op in inputs.ops}
        profile = cluster.profile
        bandwidth = profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency  # the ring's merges and copies
        times = []
        for unit in inputs.units:
            fwd = bwd = 0.0
            calls = 0
            for name in unit.ops:
                op = by_name[name]
                if not is_ring_attention(op):
                    continue
                attention = (compute.ops_time_s([op], "fwd", fsdp.compute_fwd_scale),
                             compute.ops_time_s([op], "bwd", fsdp.compute_bwd_scale))
                ring = ring_exposed_s(op, self.cp, comm, cluster.mesh.cp_scope, attention, bandwidth)
                fwd, bwd, calls = fwd + ring.fwd_exposed_s, bwd + ring.bwd_exposed_s, calls + 1
            times.append(TpTime(fwd, bwd, calls, calls * (1 + self.cp)))
        return times


def _whole_dimension_kinds(table: CostTable) -> CostTable:
    """Only the sharding kinds over the whole FSDP dimension (see the module docstring)."""
    keep = [[i for i, o in enumerate(opts) if o.kind.mesh == MeshShape.WORLD] for opts in table.options]
    return replace(table, options=[[opts[i] for i in k] for opts, k in zip(table.options, keep)],
                   costs=[[costs[i] for i in k] for costs, k in zip(table.costs, keep)])


def context_refusal(ops, module, seq_len: int, cp: int) -> str | None:
    """Why a model cannot run context parallelism of degree `cp` (None where it can): its attention must be
    causal SDPA calls (the ring's load balancing needs causal masks; other attention is not dispatched to the
    ring), its sequence must cut into 2 cp chunks, and `apply` must know where its positions come from (the
    zoo's rotary transformers: autoplan.run.context)."""
    from autoplan.models.llama import RopeTransformer

    attention = [op for op in ops if op.attention]
    if not attention or any(not is_ring_attention(op) for op in attention):
        return "its attention is not causal scaled_dot_product_attention throughout (ring attention needs it)"
    if seq_len % (2 * cp):
        return f"`seq_len` {seq_len} does not cut into {2 * cp} equal chunks (load-balanced causal sharding)"
    if not isinstance(module, RopeTransformer):
        return "apply shards the positions of the zoo's rotary transformers (Llama, MoE) only"
    return None
