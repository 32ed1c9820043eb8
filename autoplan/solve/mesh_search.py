"""The search over meshes: the micro-batch sweep on each of the request's meshes, the fastest plan kept.

A mesh of tensor-parallel degree t runs tensor parallelism inside each group of t GPUs of a node and FSDP
over the world / t data-parallel ranks. Each mesh is searched with the same sweep (autoplan.solve.sweep)
on the tables as one of its ranks sees them (`CostTables.for_layout`: the split ops and parameters, the TP
collectives on each unit's critical path) and the cluster as its data-parallel groups share it
(`Cluster.with_mesh`). FSDP alone is the mesh of degree 1: one path for every mesh. The fastest plan that
fits wins; every mesh's best, or why it was not searched, is kept for the report.

The meshes are independent searches, each deterministic (one CP-SAT worker), so for a model large enough
to pay for it (PARALLEL_MIN_UNITS) the rest run in forked worker processes on the machine's other cores while
this process searches the first (a refusal of FSDP alone, such as pins that cannot hold, ends the search);
the plan is the same either way.

Under tensor parallelism the data-parallel dimension offers the kinds that shard over all its ranks
(shard, shard_keep): replicate and hybrid would need a three-dimensional mesh that apply does not build,
and offload is not offered beside DTensor's tensor-parallel parameters. A model whose blocks the layout
does not recognise (autoplan.models.tp_layout) keeps its plans of degree 1.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, replace

from autoplan.errors import InfeasibleError, SolverTimeout, UsageError
from autoplan.models.tp_layout import TpRefusal, check_with_experts, recognise
from autoplan.solve.cluster import Cluster
from autoplan.solve.expert_tables import mesh_source
from autoplan.solve.pipeline import PipelineOutcome, search_pipeline
from autoplan.solve.pipeline_pins import best_explained
from autoplan.solve.progress import MeshProgress
from autoplan.solve.request import PlanRequest, Uniform
from autoplan.solve.solver import cp_sat
from autoplan.solve.stages import StageTables
from autoplan.solve.sweep import MeshPruned, SweepOutcome, sweep
from autoplan.solve.context_tables import context_refusal, context_source
from autoplan.solve.tables import TableSource
from cost_models.expert_parallel import expert_kind_runs
from cost_models.mesh import Mesh
from cost_models.options import SHARDING_KINDS, MeshShape
from cost_models.tensor_parallel import TpLayout

__all__ = ["PARALLEL_MIN_UNITS", "PIPELINE_MFU", "PROGRESS_DELAY_S", "MeshResult", "MeshSearch", "best_result",
           "check_beside_tensor_parallelism", "check_context", "pipeline_pays", "search_meshes"]

PROGRESS_DELAY_S = 2.0  # a search that answers sooner prints nothing on stderr
# worker processes only for models of this many units: forking a process that holds a traced model and sending
# its results back costs a tenth of a second or so, a model's search grows with its units (the zoo's 7B Llama
# has 34, GPT-2 1.5B 50)
PARALLEL_MIN_UNITS = 24
# pipelines are searched (unless `pp` is given) where the best plan without one leaves them something to win:
# nothing fits, it offloads, or its model FLOPs use is below this (its collectives or recomputation exposed)
PIPELINE_MFU = 0.4


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


@dataclass
class MeshSearch:
    """Every mesh's result, in the request's order, and the fastest that fits."""

    results: list[MeshResult]
    best: MeshResult

    @property
    def tensor_parallel_searched(self) -> bool:
        """Whether some mesh above degree 1 was searched (its layout recognised, its context parallelism one the
        model runs), so the report lists them."""
        return any(r.degree > 1 and r.layout is not None or r.mesh.ep > 1
                   or r.mesh.cp > 1 and not (r.refused or "").startswith("context parallelism")
                   for r in self.results)

    @property
    def data_parallel(self) -> MeshResult | None:
        """The result of degree 1 without expert or context parallelism or a pipeline (FSDP alone), if searched."""
        return next((r for r in self.results if r.degree == 1 and r.mesh.ep == 1 and r.mesh.cp == 1 and r.pp == 1),
                    None)

    @property
    def without_pipeline(self) -> MeshResult | None:
        """The fastest result without a pipeline that fits (the plan a pipelined one is compared with)."""
        fitting = [r for r in self.results if r.pp == 1 and r.outcome is not None]
        return best_result(fitting) if fitting else None


def search_meshes(request: PlanRequest) -> MeshSearch:
    """Every mesh of the request searched, then its pipelined meshes where a pipeline can pay
    (`pipeline_pays`), the fastest plan that fits chosen (`best_result`). Raises the InfeasibleError needing
    the least memory when nothing fits anywhere."""
    _LAYOUTS.clear()  # the last search's models not kept alive
    progress = MeshProgress(len(request.meshes), PROGRESS_DELAY_S)
    with _Workers(request) as workers:
        results = _search_all(request, request.meshes, progress, workers)
        if request.pipeline_meshes and pipeline_pays(results):
            meshes = request.pipeline_meshes + _at_best_degree(request.pipeline_meshes, results)
            progress.meshes += len(meshes)
            # a pipelined schedule whose bound cannot beat the best plan without a pipeline is not solved
            beat = max((r.throughput for r in results if r.outcome is not None), default=0.0)
            results += _search_all(request, meshes, progress, workers, len(results), beat)
    return MeshSearch(results, best_explained(request, results, best_result))  # pins in a pipeline: pipeline_pins


def _at_best_degree(pipelined: tuple[Mesh, ...], results: list[MeshResult]) -> tuple[Mesh, ...]:
    """The pipeline degrees again at the tensor degree (and sequence parallelism) of the best plan without a
    pipeline, where the pipelined meshes do not have it already."""
    fitting = [r for r in results if r.outcome is not None]
    if not fitting:
        return ()
    best = max(fitting, key=lambda r: (round(r.throughput, 9), -r.degree, r.sequence_parallel)).mesh
    have = {(m.tp, m.sequence_parallel) for m in pipelined}
    if (best.tp, best.sequence_parallel) in have:
        return ()
    return tuple(best.with_pipeline(pp) for pp in sorted({m.pp for m in pipelined}))


def pipeline_pays(results: list[MeshResult]) -> bool:
    """Whether the best plan without a pipeline leaves a pipeline something to win: none fits, it offloads, or
    its model FLOPs use is below PIPELINE_MFU."""
    fitting = [r for r in results if r.outcome is not None]
    if not fitting:
        return True
    best = max(fitting, key=lambda r: r.throughput)
    table, evaluation = best.outcome.table, best.outcome.evaluation
    if any(table.options[u][c].offload for u, c in enumerate(best.outcome.choices)):
        return True
    if not table.peak_flops or not table.model_flops:
        return False
    return table.model_flops * table.grad_accum_steps / (evaluation.step_time_s * table.peak_flops) < PIPELINE_MFU


def _search_all(request: PlanRequest, meshes: tuple[Mesh, ...], progress, workers: "_Workers", offset: int = 0,
                beat: float = 0.0) -> list[MeshResult]:
    """`meshes` searched, the first in this process, the rest in forked workers where it pays; a pipelined one
    only where it can beat `beat` samples/s."""
    first, *rest = meshes
    pool = workers.pool(meshes)
    results: list[MeshResult] = []
    if pool is None:
        for mesh in meshes:
            results.append(_search(request, mesh, progress.sweeping(offset + len(results), mesh), beat))
            progress.done(results)
        return results
    # under way while this process searches the first
    pending = pool.imap(_search_in_worker, [(mesh, beat) for mesh in rest])
    results.append(_search(request, first, progress.sweeping(offset, first), beat))
    progress.done(results)
    for result in pending:  # sent without its tables and cluster, made again here: the traces stay out of the pipes
        results.append(_restored(request, result))
        progress.done(results)
    return results


class _Workers:
    """The forked worker processes of one search: made at the first round of meshes that has meshes to hand them,
    and kept for the next (the pipelined meshes), whose tensor degrees' tables the workers have made already; a
    second fork would make them again."""

    def __init__(self, request: PlanRequest):
        self.request, self._pool = request, None
        # the most meshes a round hands out: the first round's, or the pipelined round's with its best degree's
        pipelined = len(request.pipeline_meshes) + len({m.pp for m in request.pipeline_meshes})
        self.count = _workers(request, max(len(request.meshes), pipelined) - 1)

    def pool(self, meshes: tuple[Mesh, ...]):
        """The pool to hand `meshes` after the first to (None: none to hand, or no workers), forked at its first
        use, with the request and the model's ops at each mesh's first micro-batches made before the fork."""
        if len(meshes) < 2 or not self.count:
            return None
        if self._pool is None:
            global _REQUEST
            _REQUEST = self.request  # inherited by the workers forked now, never pickled
            cp_sat()  # imported once, before the fork, not by every worker
            _extrapolated(self.request, meshes)
            self._pool = multiprocessing.get_context("fork").Pool(self.count)
        return self._pool

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc) -> None:
        global _REQUEST
        if self._pool is not None:  # ended as the pool's own context manager ends it
            self._pool.terminate()
        _REQUEST = None


def _extrapolated(request: PlanRequest, meshes: tuple[Mesh, ...]) -> None:
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


def _recognised(request: PlanRequest, degree: int, sequence_parallel: bool) -> TpLayout:
    key = (request.model.module, degree, sequence_parallel)  # the module by identity: another model never reads it
    if key not in _LAYOUTS:
        _LAYOUTS[key] = recognise(request.model.module, degree, sequence_parallel)
    return _LAYOUTS[key]


def _restored(request: PlanRequest, result: MeshResult) -> MeshResult:
    """A worker's result with its tables and cluster made again in this process."""
    if result.pipeline is not None:
        for rank in result.pipeline.ranks:
            rank.source = StageTables(request.tables, list(rank.chunks)).for_layout(result.layout)
        busiest = result.pipeline.busiest
        return replace(result, source=busiest.source, cluster=request.cluster.with_mesh(result.mesh))
    return replace(result, source=context_source(mesh_source(request, result.mesh, result.layout), result.mesh.cp),
                   cluster=request.cluster.with_mesh(result.mesh))


def _workers(request: PlanRequest, meshes: int) -> int:
    """Worker processes for the meshes after the first: none for a small model or a single mesh, else one
    per core besides this process's (at least one), at most one per mesh. Only on Linux, whose fork is safe
    with torch imported; elsewhere the meshes run one after another."""
    if meshes == 0 or len(request.tables.units) < PARALLEL_MIN_UNITS or not sys.platform.startswith("linux"):
        return 0
    return max(1, min(meshes, len(os.sched_getaffinity(0)) - 1))


_REQUEST: PlanRequest | None = None  # the request a forked worker searches


def _search_in_worker(task: tuple[Mesh, float]) -> MeshResult:
    mesh, beat = task
    result = _search(_REQUEST, mesh, beat=beat)
    if result.pipeline is not None:
        for rank in result.pipeline.ranks:
            rank.source = None
    return replace(result, source=None, cluster=None)


def _search(request: PlanRequest, mesh: Mesh, progress=None, beat: float = 0.0) -> MeshResult:
    result = MeshResult(mesh)
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
            result.pipeline, result.outcome = search_pipeline(request, mesh, result.layout, request.schedule, beat)
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


def best_result(results: list[MeshResult]) -> MeshResult:
    """The fastest result that fits (the lowest degree among equals); the InfeasibleError needing the least
    memory when none fits."""
    fitting = [r for r in results if r.outcome is not None]
    if fitting:
        return max(fitting, key=lambda r: (round(r.throughput, 9), -r.pp, -r.degree, -r.mesh.ep, -r.mesh.cp,
                                           r.sequence_parallel))
    errors = [r.error for r in results if r.error is not None]
    timed_out = [r.timed_out for r in results if r.timed_out is not None]
    if timed_out:  # a degree with no verdict might have fitted: say so rather than "nothing fits"
        raise timed_out[0]
    if not errors:
        raise UsageError("no mesh could be searched: " + "; ".join(f"{r.label}: {r.refused}" for r in results))
    error = min(errors, key=lambda e: e.min_mem_bytes if e.min_mem_bytes is not None else float("inf"))
    tried = [str(r.degree) + (" with sequence parallelism" if r.sequence_parallel else "")
             for r in results if r.error is not None]
    if len(tried) > 1:
        error.args = (error.args[0] + f" (tensor-parallel degrees tried: {', '.join(tried)})",)
    raise error
