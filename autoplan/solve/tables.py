"""Cost tables at any micro-batch size, from a model's two traces, on any mesh, and the micro-batch sizes to try.

Every op count is affine in the micro-batch (per-sample activations and FLOPs plus batch-independent
parameter traffic), so traces at micro-batch 1 and 2 give the costs at any size without tracing again:
`CostTables.inputs` extrapolates them once per size. A tensor-parallel degree is a transform of those
inputs (`TensorParallelTables`: what one rank of a tensor-parallel group runs, holds and sends), not a
second builder; both are `TableSource`s, the one interface the sweep reads, and both build their tables
with the same `TableSource.table`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.solve.cluster import Cluster
from autoplan.tracing.tracer import TracePair, trace_pair
from autoplan.tracing.units import build_units
from cost_models.activations import checkpoint_keeps
from cost_models.options import Recompute
from cost_models.records import LOSS_NODE, OpRecord, Unit, extrapolate_ops
from cost_models.search_memo import memo, searching
from cost_models.table import CostTable, TableInputs, build_cost_table, op_content
from cost_models.tensor_parallel import (
    TpLayout,
    UnitLayout,
    data_parallel_kinds,
    op_role,
    regions_per_unit,
    tp_keep_bytes,
    tp_ops,
    tp_units,
    unit_layouts,
)
from cost_models.tp_time import add_tp_time, tp_collectives
from cost_models.training import MicroBatch, Training

__all__ = ["CHECKPOINTED", "MAX_MICRO_BATCH", "CostTables", "TableSource", "TensorParallelTables", "compute_dtype_of",
           "micro_batch_candidates"]

MAX_MICRO_BATCH = 256
# the ways of checkpointing that keep a subset of activations (a tensor-parallel view prices ALL and CHEAP)
CHECKPOINTED = (Recompute.ALL, Recompute.CHEAP, Recompute.ALTERNATE)


def compute_dtype_of(dtype: str) -> str:
    """The dtype the model computes in under a training precision ("bf16-mixed" computes in bf16)."""
    return Training(1, dtype, "adamw").compute_dtype


def micro_batch_candidates(world_size: int, batch_size: int | None, global_batch: int | None) -> list[MicroBatch]:
    """(micro-batch size, gradient accumulation steps) pairs to try, smallest micro-batch first, for
    `world_size` data-parallel ranks."""
    if global_batch is not None and global_batch < 1:
        raise UsageError(f"`global_batch` must be positive, got {global_batch}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"`batch_size` must be positive, got {batch_size}")
    if global_batch is None:
        sizes = [batch_size] if batch_size else [2**k for k in range(MAX_MICRO_BATCH.bit_length()) if 2**k <= MAX_MICRO_BATCH]
        return [MicroBatch(size, 1) for size in sizes]
    if global_batch % world_size:
        raise UsageError(f"`global_batch` {global_batch} is not divisible by the {world_size} GPUs")
    per_rank = global_batch // world_size
    if batch_size is not None:
        if per_rank % batch_size:
            raise UsageError(
                f"`global_batch` {global_batch} is not a multiple of `batch_size` {batch_size} x {world_size} GPUs")
        return [MicroBatch(batch_size, per_rank // batch_size)]
    return [MicroBatch(size, per_rank // size) for size in range(1, min(per_rank, MAX_MICRO_BATCH) + 1)
            if per_rank % size == 0]


class TableSource(Protocol):
    """What the sweep reads: a model's units and its cost tables at any micro-batch, on any cluster."""

    tracer: str
    units: list[Unit]

    def inputs(self, micro_batch_size: int, training: Training) -> TableInputs:
        """What the table at this micro-batch is built from."""

    def table(self, micro_batch_size: int, grad_accum_steps: int, cluster: Cluster, seq_len: int, dtype: str,
              optimizer: str, offload: bool | None = None) -> CostTable:
        """The table at this micro-batch on `cluster` (see _Source.table)."""


class _Source:
    """The table of a TableSource's inputs, written once for every source."""

    def table(self, micro_batch_size: int, grad_accum_steps: int, cluster: Cluster, seq_len: int, dtype: str,
              optimizer: str, offload: bool | None = None) -> CostTable:
        """The table at this micro-batch on `cluster` (its mesh's data-parallel ranks). `offload`: offer
        offload options (None: where the search offers them, see Cluster.offload_searched; True: wherever the
        profile can price them)."""
        offload = cluster.offload_searched if offload is None else offload and cluster.offload_allowed
        training = Training(seq_len, dtype, optimizer)
        host_limit = cluster.host_mem_bytes // cluster.mesh.gpus_per_node if offload else None
        table = build_cost_table(self.inputs(micro_batch_size, training), cluster.profile, cluster.mesh,
                                 MicroBatch(micro_batch_size, grad_accum_steps), training, offload, host_limit)
        return self.finish(table, cluster)

    def inputs(self, micro_batch_size: int, training: Training) -> TableInputs:
        raise NotImplementedError

    def finish(self, table: CostTable, cluster: Cluster) -> CostTable:
        """What the source adds to a built table (nothing by default)."""
        return table


class CostTables(_Source):
    """Op costs at any micro-batch from two traces (micro-batch 1 and 2): they are affine in it."""

    def __init__(self, model: nn.Module, seq_len: int, compute_dtype: str, granularity: str,
                 traces: TracePair | None = None, extra_units: tuple[str, ...] = ()):
        traces = traces or trace_pair(model, seq_len, compute_dtype)
        self.tracer = traces.tracer
        self.trace_1, self.trace_2 = traces.at_1, traces.at_2
        self.units = build_units(model, self.trace_1, granularity, extra_units)  # extra: modules pins make units
        # what a checkpointed unit keeps, per way of checkpointing, at micro-batch 1 and 2
        at_1, at_2 = (checkpoint_keeps(trace, self.units, CHECKPOINTED) for trace in (self.trace_1, self.trace_2))
        self.keep = {mode: (at_1[mode][0], at_2[mode][0]) for mode in CHECKPOINTED}
        self.backward_keep = {mode: (at_1[mode][1], at_2[mode][1]) for mode in CHECKPOINTED}
        self.kept_saved = {mode: (at_1[mode][2], at_2[mode][2]) for mode in CHECKPOINTED}
        self._inputs: dict[int, TableInputs] = {}  # by micro-batch: a mesh search reads each size once per mesh
        # ops alike at micro-batch 1 and 2 (contents, and what checkpointing keeps of them) are alike at every size
        self.op_ids = _ids([(op_content(one), op_content(two),
                             tuple((kept[0].get(one.name), kept[1].get(one.name)) for kept in self.kept_saved.values()))
                            for one, two in zip(self.trace_1.ops, self.trace_2.ops)])

    def inputs(self, micro_batch_size: int, training: Training | None = None) -> TableInputs:
        """The ops, and what checkpointing keeps, at this micro-batch: each count affine between the traces."""
        if micro_batch_size not in self._inputs:
            m = micro_batch_size - 1

            def at(pair: tuple[list[int], list[int]]) -> list[int]:
                return [a + (b - a) * m for a, b in zip(*pair)]

            self._inputs[micro_batch_size] = TableInputs(
                units=self.units,
                ops=extrapolate_ops(self.trace_1.ops, self.trace_2.ops, micro_batch_size, self.op_ids),
                keep={mode: at(self.keep[mode]) for mode in CHECKPOINTED},
                backward_keep={mode: at(self.backward_keep[mode]) for mode in CHECKPOINTED},
                kept_saved={mode: {name: a + (at_2.get(name, 0) - a) * m for name, a in at_1.items()}
                            for mode, (at_1, at_2) in self.kept_saved.items()},
                op_ids=self.op_ids,
            )
        return self._inputs[micro_batch_size]

    def for_layout(self, layout: TpLayout | None) -> TableSource:
        """This model's tables under a tensor-parallel layout (itself for none)."""
        if layout is None or layout.degree == 1:
            return self
        # one view per layout in a search: its meshes and its pipeline stages (`_split_ops`) read its split ops
        return memo(("tp view", id(self), id(layout)), lambda: TensorParallelTables(self, layout), held=(self, layout))


class TensorParallelTables(_Source):
    """A model's tables as one rank of a tensor-parallel group under `layout` sees them: the split ops and
    parameters (cost_models.tensor_parallel), what a checkpointed unit keeps of them, the data-parallel
    kinds that run beside tensor parallelism, and each unit's tensor-parallel collectives."""

    def __init__(self, base: CostTables, layout: TpLayout, whole: TpLayout | None = None):
        # `whole`: where `base` is a pipeline stage's tables (stages.StageTables) and `layout` the whole model's
        # restricted to the stage, the whole model's (its transformed ops are the stage's: `_split_ops`)
        self.base, self.layout, self.whole = base, layout, whole
        self.tracer = base.tracer
        self.units = tp_units(base.units, layout)
        self._inputs: dict[tuple, TableInputs] = {}  # by micro-batch and training: each table and split backward reads
        self._ops: dict[int, list[OpRecord]] = {}  # by micro-batch: the split ops

    # what a table needs beyond the units, made at the first (a pipelined mesh makes a view per cut of the model's
    # stages and builds tables for few: alike stages share theirs)
    @cached_property
    def unit_layouts(self) -> list[UnitLayout | None]:
        return unit_layouts(self.base.units, self.layout)

    @cached_property
    def regions(self) -> list[int]:
        return regions_per_unit(self.base.units, self.layout)

    @cached_property
    def local_vocab(self) -> int:
        """The vocabulary-parallel head's rows on one rank: the width of its loss_parallel logits."""
        head = f"{self.layout.head}.weight" if self.layout.head else None
        return next((p.shape[0] for u in self.units for p in u.params if p.name == head), 0)

    @cached_property
    def op_ids(self) -> list[int]:
        """An op is transformed by its role alone: alike ops of one role stay alike. In a search, a pipeline stage's
        are the whole model's numbered again (its ops' roles are the whole model's, see `_split_ops`)."""
        if self.whole is not None and searching():
            model = self.base.base.for_layout(self.whole)
            return _ids([model.op_ids[p] for p in self.base.positions])
        roles: dict = {}
        return _ids([(base_id, op_role(op, self.layout, roles))
                     for base_id, op in zip(self.base.op_ids, self.base.trace_1.ops)])

    @cached_property
    def output_shares(self) -> dict[str, float]:
        """Per traced op (by name), the share of its outputs one rank of the group makes (what
        cost_models.stranding scales the trace's storages by)."""
        ops = self.base.trace_1.ops
        return {new.name: new.out_bytes / old.out_bytes
                for old, new in zip(ops, tp_ops(ops, self.layout, self.op_ids)) if old.out_bytes}

    def inputs(self, micro_batch_size: int, training: Training) -> TableInputs:
        """The base inputs at this micro-batch, transformed: each op as a rank runs it, and what a checkpointed
        unit keeps per rank (cost_models.tensor_parallel.tp_keep_bytes). Made once per micro-batch and training."""
        key = (micro_batch_size, training.seq_len, training.dtype, training.optimizer)
        if key not in self._inputs:
            self._inputs[key] = self._transformed(micro_batch_size, training)
        return self._inputs[key]

    def _transformed(self, micro_batch_size: int, training: Training) -> TableInputs:
        base, layout = self.base.inputs(micro_batch_size), self.layout
        ops = self._split_ops(micro_batch_size, base.ops)
        activation = micro_batch_size * training.seq_len * layout.hidden * training.precision.compute_bytes

        def kept(full: list[int], cheap: list[int]) -> list[tuple[int, int]]:
            return [tp_keep_bytes(f, c, tag, layout, regions, activation)
                    for f, c, tag, regions in zip(full, cheap, self.unit_layouts, self.regions)]

        keep = kept(base.keep[Recompute.ALL], base.keep[Recompute.CHEAP])
        # held after the recomputation: the selective cache's outputs it replays go (a collective's output
        # after the last saving op, the MLP's, stays; the attention's is counted too: an upper bound)
        cheap_after = kept(base.keep[Recompute.ALL], base.backward_keep[Recompute.CHEAP])
        share = {old.name: new.saved_bytes / old.saved_bytes for old, new in zip(base.ops, ops) if old.saved_bytes}
        return TableInputs(
            units=self.units, ops=ops,
            keep={Recompute.ALL: [k[0] for k in keep], Recompute.CHEAP: [k[1] for k in keep]},
            backward_keep={Recompute.ALL: [k[0] for k in keep], Recompute.CHEAP: [k[1] for k in cheap_after]},
            kept_saved={mode: _scaled(entries, share) for mode, entries in base.kept_saved.items()},
            op_ids=self.op_ids,
        )

    def split_ops(self, micro_batch_size: int) -> list[OpRecord]:
        """The ops one rank of the group runs at this micro-batch (its inputs' ops), without the rest of its inputs
        (what a checkpointed unit keeps)."""
        return self._split_ops(micro_batch_size, self.base.inputs(micro_batch_size).ops)

    def _split_ops(self, micro_batch_size: int, ops: list[OpRecord]) -> list[OpRecord]:
        """`ops` (the base's at this micro-batch) as a rank of the group runs them, alike ops transformed once. In a
        search, a pipeline stage's are the whole model's (its view's, which the search shares: `for_layout`), taken at
        the stage's positions: tp_op reads an op's contents and its module's role, which the restriction keeps for
        every module that runs on the stage, and the head only for the loss; not where the stage's loss would read
        another head, nor for experts (whose transform reads the op's own module: the first alike op decides)."""
        whole, layout = self.whole, self.layout
        if (whole is None or not searching() or whole.expert_widths
                or (self._has_loss and whole.head != layout.head)):
            if micro_batch_size not in self._ops:
                self._ops[micro_batch_size] = tp_ops(ops, layout, self.op_ids)
            return self._ops[micro_batch_size]
        model = self.base.base.for_layout(whole)
        every = model.split_ops(micro_batch_size)
        return [every[p] for p in self.base.positions]

    @cached_property
    def _has_loss(self) -> bool:
        return any(op.name == LOSS_NODE for op in self.base.trace_1.ops)

    def finish(self, table: CostTable, cluster: Cluster) -> CostTable:
        """Only the data-parallel kinds that run beside tensor parallelism; each unit's TP collectives added."""
        table = data_parallel_kinds(table)
        times = tp_collectives(self.units, self.layout, table.micro_batch_size, table.seq_len,
                               table.precision.compute_bytes, cluster.profile, self.local_vocab)
        fsdp = cluster.profile.fsdp
        add_tp_time(table.options, table.costs, times, fsdp.collective_fwd_s, fsdp.collective_bwd_s)
        return table

    def full_units(self) -> list[Unit]:
        """The units as the whole model holds them (the plan records their full parameter shapes)."""
        return self.base.units


def _scaled(entries: dict[str, int], share: dict[str, float]) -> dict[str, int]:
    """`entries` with each op's in `share` scaled by it (in their order; the others as they are, which is what
    scaling them by 1.0 gives: whole byte counts)."""
    scaled = dict(entries)
    for name, factor in share.items():
        if name in scaled:
            scaled[name] = int(scaled[name] * factor)
    return scaled


def _ids(keys: list) -> list[int]:
    """Per key, a number equal for equal keys."""
    seen: dict = {}
    return [seen.setdefault(key, len(seen)) for key in keys]
