"""Cost tables at any micro-batch size, from a model's two traces, and the micro-batch sizes to try.

Every op count is affine in the micro-batch (per-sample activations and FLOPs plus batch-independent
parameter traffic), so traces at micro-batch 1 and 2 give the costs at any size without tracing again.
"""

from __future__ import annotations

import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.solve.cluster import Cluster
from autoplan.tracing.tracer import TracePair, trace_pair
from autoplan.tracing.units import build_units
from cost_models.activations import activation_keep_bytes, backward_keep_bytes, kept_saved_bytes
from cost_models.options import PRECISIONS, Recompute
from cost_models.records import extrapolate_ops
from cost_models.table import CostTable, build_cost_table

__all__ = ["CostTables", "micro_batch_candidates", "compute_dtype_of", "MAX_MICRO_BATCH"]

MAX_MICRO_BATCH = 256
CHECKPOINTED = (Recompute.ALL, Recompute.CHEAP)  # the ways of checkpointing that keep a subset of activations


def compute_dtype_of(dtype: str) -> str:
    """The dtype the model computes in under a training precision ("bf16-mixed" computes in bf16)."""
    return PRECISIONS[dtype].compute_dtype.value


def micro_batch_candidates(world_size: int, batch_size: int | None, global_batch: int | None) -> list[tuple[int, int]]:
    """(micro_batch_size, grad_accum_steps) pairs to try, smallest micro-batch first."""
    if global_batch is not None and global_batch < 1:
        raise UsageError(f"`global_batch` must be positive, got {global_batch}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"`batch_size` must be positive, got {batch_size}")
    if global_batch is None:
        sizes = [batch_size] if batch_size else [2**k for k in range(MAX_MICRO_BATCH.bit_length()) if 2**k <= MAX_MICRO_BATCH]
        return [(size, 1) for size in sizes]
    if global_batch % world_size:
        raise UsageError(f"`global_batch` {global_batch} is not divisible by the {world_size} GPUs")
    per_rank = global_batch // world_size
    if batch_size is not None:
        if per_rank % batch_size:
            raise UsageError(
                f"`global_batch` {global_batch} is not a multiple of `batch_size` {batch_size} x {world_size} GPUs")
        return [(batch_size, per_rank // batch_size)]
    return [(size, per_rank // size) for size in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % size == 0]


class CostTables:
    """Op costs at any micro-batch from two traces (micro-batch 1 and 2): they are affine in it."""

    def __init__(self, model: nn.Module, seq_len: int, compute_dtype: str, granularity: str,
                 traces: TracePair | None = None, extra_units: tuple[str, ...] = ()):
        traces = traces or trace_pair(model, seq_len, compute_dtype)
        self.tracer = traces.tracer
        self.trace_1, self.trace_2 = traces.at_1, traces.at_2
        self.units = build_units(model, self.trace_1, granularity, extra_units)  # extra: modules pins make units
        # what a checkpointed unit keeps, per way of checkpointing, at micro-batch 1 and 2
        self.keep = {mode: (activation_keep_bytes(self.trace_1, self.units, mode),
                            activation_keep_bytes(self.trace_2, self.units, mode)) for mode in CHECKPOINTED}
        self.backward_keep = {mode: (backward_keep_bytes(self.trace_1, self.units, mode),
                                     backward_keep_bytes(self.trace_2, self.units, mode)) for mode in CHECKPOINTED}
        self.kept_saved = {mode: (kept_saved_bytes(self.trace_1, self.units, mode),
                                  kept_saved_bytes(self.trace_2, self.units, mode)) for mode in CHECKPOINTED}

    def table(self, micro_batch_size: int, grad_accum_steps: int, cluster: Cluster, seq_len: int,
              dtype: str, optimizer: str, offload: bool | None = None) -> CostTable:
        """The table at this micro-batch. `offload`: offer offload options (None: where the search offers
        them, see Cluster.offload_searched; True: wherever the profile can price them)."""
        offload = cluster.offload_searched if offload is None else offload and cluster.offload_allowed
        ops = extrapolate_ops(self.trace_1.ops, self.trace_2.ops, micro_batch_size)
        keep = {mode: [a + (b - a) * (micro_batch_size - 1) for a, b in zip(*self.keep[mode])]
                for mode in CHECKPOINTED}
        backward_keep = {mode: [a + (b - a) * (micro_batch_size - 1) for a, b in zip(*self.backward_keep[mode])]
                         for mode in CHECKPOINTED}
        kept_saved = {mode: {name: a + (at_2.get(name, 0) - a) * (micro_batch_size - 1) for name, a in at_1.items()}
                      for mode, (at_1, at_2) in self.kept_saved.items()}
        return build_cost_table(self.units, ops, keep, cluster.profile, cluster.shape, micro_batch_size,
                                grad_accum_steps, seq_len, dtype, optimizer, kept_saved,
                                offload=offload, backward_keep=backward_keep,
                                host_limit_bytes=cluster.host_mem_bytes // cluster.shape.gpus_per_node
                                if offload else None)
