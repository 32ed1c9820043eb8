"""One planning request as the stages below the API take it: prepared once, typed, handed down whole.

`autoplan.search`, `estimate`, `frontier`, `explain` and `diff` each turn their settings into a
`PlanRequest` in one step (autoplan.api.prepare): the model resolved and traced, the cluster and the
meshes to search on it, the memory limits, the micro-batches, the pins. The mesh search
(autoplan.solve.mesh_search), the micro-batch sweep (autoplan.solve.sweep) and the plan's assembly
(autoplan.plan.assemble) each take the request, so no untyped bundle of arguments crosses a module
boundary, and a new setting is a field here rather than a keyword threaded through every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch.nn as nn

from autoplan.models.experts import ExpertInfo, experts_of
from autoplan.settings import DEFAULT_TIME_LIMIT_S
from autoplan.solve.cluster import Cluster
from autoplan.solve.pins import PinResolution
from autoplan.solve.rows import sparse_rows
from autoplan.solve.tables import CostTables, micro_batch_candidates
from cost_models.allocator_conf import is_expandable
from cost_models.allocator_margin import allocated_within, needed_bytes, point_margin
from cost_models.mesh import Mesh
from cost_models.stranding import forward_stranding
from cost_models.table import CostTable
from cost_models.training import MicroBatch, Training

__all__ = ["Batch", "Limits", "ModelInfo", "PlanRequest", "Uniform", "model_stranding"]


@dataclass(frozen=True)
class ModelInfo:
    """The model planned: what a plan file records of it, and its module (on the meta device)."""

    name: str
    """zoo name, "hf:PATH" or "package.module:factory" (what the plan names)"""
    config: dict[str, Any] | None
    """the zoo config a plan rebuilds the model from (None: a factory or a module)"""
    n_params: int
    fingerprint: str
    """sha256 of the module tree and parameter shapes (autoplan.models.fingerprint)"""
    module: nn.Module
    notes: dict[str, Any] = field(default_factory=dict)
    """how it was priced: the plan's ModelRef fields of that name (attention kernels, unpriced ops, inputs)"""

    @cached_property
    def experts(self) -> ExpertInfo:
        """The module's expert stacks (autoplan.models.experts), found once: every mesh's tables ask (a walk over
        every module's parameters, about 0.1 CPU-s on a 126-layer stack)."""
        return experts_of(self.module)


@dataclass(frozen=True)
class Limits:
    """The per-GPU memory a plan must fit, and the solver's time per micro-batch."""

    mem_limit_bytes: int
    headroom: float = 0.0
    """fraction of the limit kept free against prediction error and run-to-run variation"""
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    allocator_conf: str | None = None
    """the PYTORCH_CUDA_ALLOC_CONF a CUDA run uses (None: no caching allocator, a CPU profile)"""
    fit_to: str = "needed"
    """"needed": the plan's live bytes leave room for what the caching allocator needs beyond them
    (cost_models.allocator_margin); "allocated": the live bytes alone fit"""

    @property
    def fits_needed(self) -> bool:
        return self.allocator_conf is not None and self.fit_to == "needed"

    @property
    def planned_bytes(self) -> int:
        """What the plan's live bytes (the memory timeline's peak) may reach: the limit less the headroom, less
        the caching allocator's margin when fitting to what it needs."""
        kept = int(self.mem_limit_bytes * (1 - self.headroom))
        return allocated_within(kept, self.allocator_conf) if self.fits_needed else kept

    def with_margin(self, table: CostTable, source=None) -> CostTable:
        """`table` carrying the allocator's margin per time point where the plan is fitted to what that allocator
        needs (cost_models.allocator_margin; not on a table whose rows are written sparse: that keeps the flat
        bound of `planned_bytes`). The margin follows what the model's tensor sizes strand under the configuration,
        simulated from the trace of `source` (the TableSource `table` came from; None: the bound that needs no
        trace)."""
        if not self.fits_needed or sparse_rows(table):
            return table
        expandable = is_expandable(self.allocator_conf)
        stranding = model_stranding(source, table.micro_batch_size, expandable) if source is not None else None
        return replace(table, allocator=point_margin(self.allocator_conf, stranding))

    def fitted_of(self, evaluation, table: CostTable) -> int:
        """What a plan (a cost_models.evaluate.Evaluation of `table`) is fitted to: its live peak, or what the
        caching allocator needs to run it (where `table` carries the allocator's margin, its rows' figure plus the
        margin's slack, which they leave out; else the flat bound)."""
        peak = evaluation.peak_mem_bytes
        if not self.fits_needed:
            return peak
        if evaluation.fit_bytes is not None:  # set exactly where the table carries a margin (cost_models.evaluate)
            return evaluation.fit_bytes + table.allocator.slack
        return needed_bytes(peak, self.allocator_conf)

    def limit_for(self, peak_bytes: int) -> int:
        """The `--mem` a plan of this live peak needs: its headroom and, fitting to what the caching allocator
        needs, that allocator's margin (flat, as `planned_bytes`) added back."""
        wanted = needed_bytes(peak_bytes, self.allocator_conf) if self.fits_needed else peak_bytes
        return math.ceil(wanted / (1 - self.headroom))

    def planned_for(self, table: CostTable) -> int:
        """What `table`'s solver rows may reach: `planned_bytes`, or for a table carrying the allocator's margin
        (its rows are what the allocator needs) the limit less the headroom and the margin's slack."""
        if table.allocator is None:
            return self.planned_bytes
        return int(self.mem_limit_bytes * (1 - self.headroom)) - table.allocator.slack


def model_stranding(source, micro_batch: int, expandable: bool = False) -> float | None:
    """What the model's tensor sizes strand in the caching allocator at this micro-batch (cost_models.stranding;
    `expandable`: with expandable segments), simulated once per trace, micro-batch, configuration and
    tensor-parallel layout from the trace under `source`, each op's storages scaled to a rank's share of its
    outputs under the layout. None under context or expert parallelism (sizes the simulation has not been checked
    against by replay) or for a trace without storages: the caller keeps the bound that needs none."""
    layout, tp_source = None, None
    while not hasattr(source, "trace_1") and getattr(source, "base", None) is not None:
        if hasattr(source, "cp") or hasattr(source, "experts"):
            return None
        if getattr(source, "layout", None) is not None and layout is None:
            layout, tp_source = source.layout, source
        source = source.base
    trace = getattr(source, "trace_1", None)
    if trace is None:
        return None
    key = (micro_batch, expandable, (layout.degree, layout.sequence_parallel) if layout is not None else None)
    known = trace.__dict__.setdefault("_stranding", {})  # the ops are not changed once traced
    if key not in known:
        scale = tp_source.output_shares if layout is not None else None  # a rank's share of each op's outputs
        known[key] = forward_stranding(trace, micro_batch, expandable, scale)
    return known[key]


@dataclass(frozen=True)
class Uniform:
    """A strategy that replaces the solver: every unit takes this sharding kind, checkpoint mode and offload."""

    strategy: str
    checkpoint: str | None = None
    offload: bool = False


@dataclass(frozen=True)
class Batch:
    """The micro-batch asked for (`batch_size`, else swept) and the samples per step (`global_batch`)."""

    batch_size: int | None = None
    global_batch: int | None = None

    @property
    def fixed(self) -> bool:
        return self.batch_size is not None

    def candidates(self, data_parallel_ranks: int) -> list[MicroBatch]:
        """The micro-batches to try over this many data-parallel ranks, smallest first."""
        return micro_batch_candidates(data_parallel_ranks, self.batch_size, self.global_batch)


@dataclass(frozen=True)
class PlanRequest:
    """Everything a search (or an estimate) of one model on one cluster needs."""

    model: ModelInfo
    tables: CostTables
    """the model's units and cost tables (with the units pins make)"""
    training: Training
    granularity: str
    cluster: Cluster
    meshes: tuple[Mesh, ...]
    """the meshes to search, in order (their tensor degree and sequence parallelism); one for an estimate"""
    batch: Batch
    limits: Limits
    pins: PinResolution | None = None
    uniform: Uniform | None = None
    """a uniform strategy in place of the solver"""
    pipeline_meshes: tuple[Mesh, ...] = ()
    """meshes with a pipeline degree, searched after `meshes` where their best plan leaves room for a pipeline
    to pay (autoplan.solve.mesh_search.pipeline_pays)"""
    schedule: str | None = None
    """the pipeline schedule asked for (None: each pipelined mesh picks among those torch runs there)"""
