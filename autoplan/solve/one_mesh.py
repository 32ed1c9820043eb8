"""One mesh of the mesh search (autoplan.solve.mesh_search) searched: its layout recognised, its refusals, the sweep
on its tables or the pipelined search, and the record of what it gave (`MeshResult`), made in this process or in a
forked worker and restored here.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace

from autoplan.errors import InfeasibleError, SolverTimeout, UsageError
from autoplan.models.tp_layout import TpRefusal, check_with_experts, recognise
from autoplan.solve.cluster import Cluster
from autoplan.solve.context_tables import context_refusal, context_source
from autoplan.solve.expert_tables import mesh_source
from autoplan.solve.pipeline import PipelineOutcome, search_pipeline
from autoplan.solve.request import PlanRequest, Uniform
from autoplan.solve.stages import StageTables
from autoplan.solve.sweep import MeshPruned, SweepOutcome, sweep
from autoplan.solve.tables import TableSource
from cost_models.expert_parallel import expert_kind_runs
from cost_models.mesh import Mesh
from cost_models.options import SHARDING_KINDS, MeshShape
from cost_models.tensor_parallel import TpLayout

__all__ = ["MeshResult", "check_beside_tensor_parallelism", "check_context", "clear_layouts", "extrapolated",
           "restored", "search_mesh"]


@dataclass
class MeshResult:
    """One mesh searched, or refused."""

    mesh: Mesh
    outcome: SweepOutcome | None = None  # the fastest plan that fits, in solver terms
    layout: TpLayout | None = None  # the tensor-parallel layout (degree above 1)
    cluster: Cluster | None = None  # the cluster as the mesh runs it (Cluster.with_mesh)
    source: TableSource | None = None  # the tables it was searched on
    refused: str | None = None  # why it was not searched, or why nothing fits
    error: InfeasibleError | None = None
    timed_out: SolverTimeout | None = None  # the solver's time ran out before any verdict at every micro-batch
    wall_time_s: float = 0.0
    pipeline: PipelineOutcome | None = None  # a pipelined mesh's stages, schedule and figures
    # searched before the beat was known (`search_mesh`'s beat None): the least bound over any cut its pipelined
    # search would have compared with the beat (inf otherwise: searched with the beat)
    beat_bound: float = math.inf

    @property
    def degree(self) -> int:
        return self.mesh.tp

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def sequence_parallel(self) -> bool:
        return self.mesh.sequence_parallel

    @property
    def throughput(self) -> float:
        if self.outcome is None:
            return 0.0
        return self.outcome.table.samples_per_step / self.outcome.evaluation.step_time_s

    @property
    def label(self) -> str:
        return (f"pp {self.pp} " if self.pp > 1 else "") + f"tp {self.degree}" + \
            (" +sp" if self.sequence_parallel else "") + (f" ep {self.mesh.ep}" if self.mesh.ep > 1 else "") + \
            (f" cp {self.mesh.cp}" if self.mesh.cp > 1 else "")


def extrapolated(request: PlanRequest, meshes: tuple[Mesh, ...]) -> None:
    """The model's ops at the two smallest micro-batches each mesh tries (every sweep starts there; a larger size only
    some reach: made where it is needed), and their tensor-parallel layouts, made before the fork: once, not once
    per worker."""
    for mesh in meshes:
        with contextlib.suppress(UsageError):  # a global batch this mesh cannot divide: its search says so
            for size, _ in request.batch.candidates(mesh.dp)[:2]:
                request.tables.inputs(size)
        if mesh.tp > 1:
            with contextlib.suppress(TpRefusal):  # the model or the degree cannot take it: its search says so
                _recognised(request, mesh.tp, mesh.sequence_parallel)


_LAYOUTS: dict = {}  # (model, degree, sequence parallelism) -> its TpLayout: every mesh of a degree reads one


def clear_layouts() -> None:
    """The last search's layouts (and through them its model) not kept alive."""
    _LAYOUTS.clear()


def _recognised(request: PlanRequest, degree: int, sequence_parallel: bool) -> TpLayout:
    key = (request.model.module, degree, sequence_parallel)  # the module by identity: another model never reads it
    if key not in _LAYOUTS:
        _LAYOUTS[key] = recognise(request.model.module, degree, sequence_parallel)
    return _LAYOUTS[key]


def restored(request: PlanRequest, result: MeshResult) -> MeshResult:
    """A worker's result with its tables and cluster made again in this process."""
    if result.pipeline is not None:
        for rank in result.pipeline.ranks:
            rank.source = StageTables(request.tables, list(rank.chunks)).for_layout(result.layout)
        busiest = result.pipeline.busiest
        return replace(result, source=busiest.source, cluster=request.cluster.with_mesh(result.mesh))
    return replace(result, source=context_source(mesh_source(request, result.mesh, result.layout), result.mesh.cp),
                   cluster=request.cluster.with_mesh(result.mesh))


def search_mesh(request: PlanRequest, mesh: Mesh, progress=None, beat: float | None = 0.0) -> MeshResult:
    """One mesh searched (`beat` None: a pipelined mesh searched before the beat is known; search_pipeline)."""
    result, bounds = MeshResult(mesh), []
    start = time.perf_counter()
    try:
        if mesh.tp > 1:
            check_beside_tensor_parallelism(request.uniform)
            result.layout = _recognised(request, mesh.tp, mesh.sequence_parallel)
            check_with_experts(result.layout, mesh.ep)
        uniform = request.uniform
        if mesh.ep > 1 and uniform is not None and not expert_kind_runs(uniform.strategy, uniform.offload):
            raise TpRefusal(f"`strategy` {uniform.strategy}{' with offload' if uniform.offload else ''} does not "
                            "run beside expert parallelism (shard, shard_keep)")
        if mesh.cp > 1:
            check_context(request, mesh)
        result.cluster = request.cluster.with_mesh(mesh)
        if mesh.pp > 1:
            result.pipeline, result.outcome = search_pipeline(request, mesh, result.layout, request.schedule, beat,
                                                              bounds)
            result.source = result.pipeline.busiest.source
        else:
            result.source = context_source(mesh_source(request, result.mesh, result.layout), mesh.cp)
            result.outcome = sweep(request, result.source, result.cluster, progress)
    except (TpRefusal, MeshPruned) as exc:
        result.refused = str(exc)
    except UsageError as exc:  # pins asking for options that do not run beside tensor or context parallelism
        if mesh.tp == 1 and mesh.cp == 1 and mesh.pp == 1:
            raise
        result.refused = str(exc) if mesh.pp > 1 else f"not with the pins: {exc}"
    except InfeasibleError as exc:
        result.refused, result.error = "nothing fits", exc
    except SolverTimeout as exc:
        result.refused, result.timed_out = "no verdict within `time_limit_s`", exc
    result.wall_time_s = time.perf_counter() - start
    if beat is None:  # searched before the beat was known: it stands where the beat is under every bound compared
        result.beat_bound = min(bounds, default=math.inf)
    return result


def check_context(request: PlanRequest, mesh: Mesh) -> None:
    """TpRefusal (a mesh the model cannot run) where the model cannot run context parallelism of the mesh's
    degree (autoplan.solve.context_tables.context_refusal), or beside a uniform strategy that is not over
    the whole FSDP dimension."""
    why = context_refusal(request.tables.trace_1.ops, request.model.module, request.training.seq_len, mesh.cp)
    if why is None and request.uniform is not None and SHARDING_KINDS[request.uniform.strategy].mesh != MeshShape.WORLD:
        why = f"`strategy` {request.uniform.strategy} is not offered beside context parallelism (shard, shard_keep)"
    if why is not None:
        raise TpRefusal(f"context parallelism {mesh.cp}: {why}")


def check_beside_tensor_parallelism(uniform: Uniform | None) -> None:
    """TpRefusal for a uniform strategy that does not run beside tensor parallelism."""
    if uniform is None:
        return
    if SHARDING_KINDS[uniform.strategy].mesh != MeshShape.WORLD:
        raise TpRefusal(f"`strategy` {uniform.strategy} is not offered beside tensor parallelism "
                        "(the data-parallel dimension shards: shard, shard_keep)")
    if uniform.offload:
        raise TpRefusal("`offload` is not offered beside tensor parallelism")
