"""Mesh choice: the micro-batch sweep at each tensor-parallel degree (with and without sequence parallelism).

A plan of TP degree t runs on a (world / t) x t mesh: tensor parallelism inside each group of t GPUs of a
node, FSDP over the world / t data-parallel ranks. Each degree is searched with the data-parallel sweep
unchanged, on the per-rank view of the model (cost_models.tensor_parallel: the split ops and
parameters, the TP collectives on each unit's critical path) and the data-parallel cluster (world / t
ranks, gpus_per_node / t per node, inter-node bandwidth shared by the t groups of a node). Degree 1 is
the plain search on the plain tables. The fastest plan that fits wins; every degree's best is reported.

Under TP the data-parallel dimension offers the kinds that shard over all its ranks (shard, shard_keep):
replicate and hybrid would need a three-dimensional mesh that apply does not build, and offload is not
offered beside DTensor's tensor-parallel parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.nn as nn

from autoplan.errors import AutoplanError, InfeasibleError, UsageError
from autoplan.solve.cluster import Cluster
from autoplan.solve.sweep import SweepOutcome, sweep
from autoplan.solve.tables import CHECKPOINTED, CostTables
from autoplan.solve.tp_layout import TpRefusal, recognise, tp_degrees
from cost_models.options import PRECISIONS, SHARDING_KINDS, MeshShape, Recompute
from cost_models.records import extrapolate_ops
from cost_models.table import ClusterShape, CostTable, build_cost_table
from cost_models.tensor_parallel import (
    TpLayout,
    add_tp_time,
    regions_per_unit,
    tp_collectives,
    tp_keep_bytes,
    tp_ops,
    tp_profile,
    tp_units,
    unit_layouts,
)

__all__ = ["DegreeResult", "TpTables", "best_result", "data_parallel_cluster", "degrees_to_search", "sweep_degrees"]


@dataclass
class DegreeResult:
    """One (degree, sequence parallelism) searched or refused."""

    degree: int
    sequence_parallel: bool
    outcome: SweepOutcome | None = None  # the fastest plan that fits, in solver terms
    layout: TpLayout | None = None
    cluster: Cluster | None = None  # the data-parallel cluster it was searched on
    tables: "TpTables | CostTables | None" = None
    refused: str | None = None  # why it was not searched, or why nothing fits
    error: InfeasibleError | None = None
    timed_out: AutoplanError | None = None  # the solver's time ran out before any verdict at every micro-batch
    wall_time_s: float = 0.0

    @property
    def throughput(self) -> float:
        if self.outcome is None:
            return 0.0
        return self.outcome.table.samples_per_step / self.outcome.evaluation.step_time_s


def degrees_to_search(tp: int | None, gpus_per_node: int) -> list[int]:
    """`tp` itself when given (checked against the node), else every divisor of the node up to 8."""
    if tp is None:
        return tp_degrees(gpus_per_node)
    if gpus_per_node % tp:
        raise UsageError(f"`tp` {tp} does not divide `gpus_per_node` {gpus_per_node}: tensor parallelism runs inside "
                         f"a node; choose one of {', '.join(map(str, tp_degrees(gpus_per_node)))}")
    return [tp]


def data_parallel_cluster(cluster: Cluster, degree: int) -> Cluster:
    """The cluster FSDP sees under TP degree `degree`: world / t ranks, gpus_per_node / t per node, no offload."""
    if degree == 1:
        return cluster
    shape = cluster.shape
    return replace(cluster, shape=ClusterShape(shape.world_size // degree, shape.nodes, shape.gpus_per_node // degree),
                   profile=tp_profile(cluster.profile, degree), host_mem_bytes=None,
                   host_mem_source="not offered with tensor parallelism")


class TpTables:
    """A CostTables' per-rank view under a layout: what `sweep` reads (`table`, `units`, `tracer`)."""

    def __init__(self, base: CostTables, layout: TpLayout):
        self.base, self.layout = base, layout
        self.tracer = base.tracer
        self.units = tp_units(base.units, layout)
        self.unit_layouts = unit_layouts(base.units, layout)
        self.regions = regions_per_unit(base.units, layout)
        # the vocabulary-parallel head's rows on one rank: the width of its loss_parallel logits
        head = f"{layout.head}.weight" if layout.head else None
        self.local_vocab = next((p.shape[0] for u in self.units for p in u.params if p.name == head), 0)

    def table(self, micro_batch_size: int, grad_accum_steps: int, cluster: Cluster, seq_len: int,
              dtype: str, optimizer: str, offload: bool | None = None) -> CostTable:
        # `offload` as CostTables.table's; beside tensor parallelism no unit offloads (_data_parallel_kinds)
        base, layout, m = self.base, self.layout, micro_batch_size - 1
        raw = extrapolate_ops(base.trace_1.ops, base.trace_2.ops, micro_batch_size)
        ops = tp_ops(raw, layout)
        at = {mode: [a + (b - a) * m for a, b in zip(*base.keep[mode])] for mode in CHECKPOINTED}
        activation = micro_batch_size * seq_len * layout.hidden * PRECISIONS[dtype].compute_bytes
        kept = [tp_keep_bytes(full, cheap, tag, layout, regions, activation) for full, cheap, tag, regions
                in zip(at[Recompute.ALL], at[Recompute.CHEAP], self.unit_layouts, self.regions)]
        keep = {Recompute.ALL: [k[0] for k in kept], Recompute.CHEAP: [k[1] for k in kept]}
        # held after the recomputation: the selective cache's outputs it replays go (a collective's output
        # after the last saving op, the MLP's, stays; the attention's is counted too: an upper bound)
        cheap_bwd = [a + (b - a) * m for a, b in zip(*base.backward_keep[Recompute.CHEAP])]
        backward_keep = {Recompute.ALL: keep[Recompute.ALL],
                         Recompute.CHEAP: [tp_keep_bytes(full, cheap, tag, layout, regions, activation)[1]
                                           for full, cheap, tag, regions in zip(at[Recompute.ALL], cheap_bwd,
                                                                               self.unit_layouts, self.regions)]}
        share = {old.name: new.saved_bytes / old.saved_bytes for old, new in zip(raw, ops) if old.saved_bytes}
        kept_saved = {mode: {name: int((a + (at_2.get(name, 0) - a) * m) * share.get(name, 1.0))
                             for name, a in at_1.items()}
                      for mode, (at_1, at_2) in base.kept_saved.items()}
        table = build_cost_table(self.units, ops, keep, cluster.profile, cluster.shape, micro_batch_size,
                                 grad_accum_steps, seq_len, dtype, optimizer, kept_saved, backward_keep=backward_keep)
        table = _data_parallel_kinds(table)
        times = tp_collectives(self.units, layout, micro_batch_size, seq_len, table.precision.compute_bytes,
                               cluster.profile, self.local_vocab)
        fsdp = cluster.profile.fsdp
        add_tp_time(table.options, table.costs, times, fsdp.collective_fwd_s, fsdp.collective_bwd_s)
        return table


def _data_parallel_kinds(table: CostTable) -> CostTable:
    """Only the options apply runs beside tensor parallelism: kinds sharding over the whole data-parallel
    dimension, without offload."""
    keep = [[i for i, o in enumerate(opts) if o.kind.mesh == MeshShape.WORLD and not o.offload]
            for opts in table.options]
    return replace(table, options=[[opts[i] for i in k] for opts, k in zip(table.options, keep)],
                   costs=[[costs[i] for i in k] for costs, k in zip(table.costs, keep)])


def sweep_degrees(module: nn.Module, tables: CostTables, cluster: Cluster, degrees: list[int],
                  candidates_of: Callable[[int], list[tuple[int, int]]], *, strategy: str | None, offload: bool,
                  sequence_parallel: bool | None = None, **sweep_args) -> list[DegreeResult]:
    """Every degree's sweep (degree > 1: with sequence parallelism and without, or as `sequence_parallel`
    says), or why it was refused.
    `candidates_of(data_parallel_world)` gives the micro-batch candidates; `sweep_args` go to `sweep`."""
    results = []
    for degree in degrees:
        variants = (True, False) if sequence_parallel is None else (sequence_parallel,)
        for sp in ((False,) if degree == 1 else variants):
            result = DegreeResult(degree, sp)
            results.append(result)
            start = time.perf_counter()
            try:
                if degree == 1:
                    view, dp_cluster = tables, cluster
                else:
                    if strategy is not None and SHARDING_KINDS[strategy].mesh != MeshShape.WORLD:
                        raise TpRefusal(f"`strategy` {strategy} is not offered beside tensor parallelism "
                                        "(the data-parallel dimension shards: shard, shard_keep)")
                    if offload:
                        raise TpRefusal("`offload` is not offered beside tensor parallelism")
                    result.layout = recognise(module, degree, sp)
                    view, dp_cluster = TpTables(tables, result.layout), data_parallel_cluster(cluster, degree)
                result.cluster, result.tables = dp_cluster, view
                result.outcome = sweep(view, dp_cluster, candidates_of(dp_cluster.shape.world_size),
                                       strategy=strategy, offload=offload, **sweep_args)
            except TpRefusal as exc:
                result.refused = str(exc)
            except UsageError as exc:  # pins asking for options that do not run beside tensor parallelism
                if degree == 1:
                    raise
                result.refused = f"not with the pins: {exc}"
            except InfeasibleError as exc:
                result.refused, result.error = "nothing fits", exc
            except AutoplanError as exc:  # the sweep's plain error: no verdict within the time limit
                if type(exc) is not AutoplanError:
                    raise
                result.refused, result.timed_out = "no verdict within `time_limit_s`", exc
            result.wall_time_s = time.perf_counter() - start
    return results


def best_result(results: list[DegreeResult]) -> DegreeResult:
    """The fastest result that fits (the lowest degree among equals); the InfeasibleError needing the least
    memory when none fits."""
    fitting = [r for r in results if r.outcome is not None]
    if fitting:
        return max(fitting, key=lambda r: (round(r.throughput, 9), -r.degree, r.sequence_parallel))
    errors = [r.error for r in results if r.error is not None]
    timed_out = [r.timed_out for r in results if r.timed_out is not None]
    if timed_out:  # a degree with no verdict might have fitted: say so rather than "nothing fits"
        raise timed_out[0]
    if not errors:
        raise UsageError("no tensor-parallel degree could be searched: "
                         + "; ".join(f"{r.degree}: {r.refused}" for r in results))
    error = min(errors, key=lambda e: e.min_mem_bytes if e.min_mem_bytes is not None else float("inf"))
    tried = [str(r.degree) + (" with sequence parallelism" if r.sequence_parallel else "")
             for r in results if r.error is not None]
    if len(tried) > 1:
        error.args = (error.args[0] + f" (tensor-parallel degrees tried: {', '.join(tried)})",)
    raise error
