"""The search over meshes: the micro-batch sweep on each of the request's meshes, the fastest plan kept.

A mesh of tensor-parallel degree t runs tensor parallelism inside each group of t GPUs of a node and FSDP
over the world / t data-parallel ranks. Each mesh is searched with the same sweep (autoplan.solve.sweep)
on the tables as one of its ranks sees them (`CostTables.for_layout`: the split ops and parameters, the TP
collectives on each unit's critical path) and the cluster as its data-parallel groups share it
(`Cluster.with_mesh`). FSDP alone is the mesh of degree 1: one path for every mesh. The fastest plan that
fits wins; every mesh's best, or why it was not searched, is kept for the report.

The meshes are independent searches, each deterministic (one CP-SAT worker), so for a model large enough
to pay for it (PARALLEL_MIN_UNITS) they are handed to this process and forked workers on the machine's other
cores as each frees up (autoplan.solve.mesh_workers), the pipelined meshes beside the others (`_in_rounds`);
a refusal of FSDP alone, such as pins that cannot hold, ends the search. The plan is the same either way.

Under tensor parallelism the data-parallel dimension offers the kinds that shard over all its ranks
(shard, shard_keep): replicate and hybrid would need a three-dimensional mesh that apply does not build,
and offload is not offered beside DTensor's tensor-parallel parameters. A model whose blocks the layout
does not recognise (autoplan.models.tp_layout) keeps its plans of degree 1.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace

from autoplan.errors import UsageError
from autoplan.solve.mesh_workers import MeshWorkers
from autoplan.solve.pipeline_pins import best_explained
from autoplan.solve.one_mesh import MeshResult, check_beside_tensor_parallelism, check_context, clear_layouts, \
    extrapolated, restored, search_mesh
from autoplan.solve.progress import MeshProgress
from autoplan.solve.request import PlanRequest
from autoplan.solve.solver import cp_sat
from cost_models.mesh import Mesh

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
    clear_layouts()  # the last search's models not kept alive
    progress = MeshProgress(len(request.meshes), PROGRESS_DELAY_S)
    count = _workers(request, len(request.meshes) + len(request.pipeline_meshes) - 1)
    if not count:
        return _one_by_one(request, progress)
    extrapolated(request, request.meshes + request.pipeline_meshes)
    with MeshWorkers(count, _search_in_worker) as workers:
        global _REQUEST
        _REQUEST = request  # inherited by the workers forked now, never pickled
        try:
            cp_sat()  # imported once, before the fork, not by every worker
            workers.start()
            return _in_rounds(request, progress, workers)
        finally:
            _REQUEST = None


def _one_by_one(request: PlanRequest, progress: MeshProgress) -> MeshSearch:
    """The meshes searched in this process, in the request's order; the pipelined ones after, where they can pay,
    against the best throughput without a pipeline (`beat`: a schedule whose bound cannot beat it is not solved)."""
    results = []
    for mesh in request.meshes:
        results.append(search_mesh(request, mesh, progress.sweeping(len(results), mesh)))
        progress.done(results)
    if request.pipeline_meshes and pipeline_pays(results):
        meshes = request.pipeline_meshes + _at_best_degree(request.pipeline_meshes, results)
        progress.meshes += len(meshes)
        beat = _beat(results)
        for mesh in meshes:
            results.append(search_mesh(request, mesh, beat=beat))
            progress.done(results)
    return _searched(request, results)


def _searched(request: PlanRequest, results: list[MeshResult]) -> MeshSearch:
    return MeshSearch(results, best_explained(request, results, best_result))  # pins in a pipeline: pipeline_pins


def _beat(results: list[MeshResult]) -> float:
    """The throughput a pipelined plan must beat: the best without a pipeline's (0: none fits)."""
    return max((r.throughput for r in results if r.outcome is not None), default=0.0)


def _in_rounds(request: PlanRequest, progress: MeshProgress, workers: MeshWorkers) -> MeshSearch:
    """The search of `_one_by_one`, its meshes handed to this process and the workers as they free up: the pipelined
    meshes begin beside the others, before the beat is known (`search_pipeline`'s `beat` None) until it is (the
    workers' shared value); such a result stands where every bound it compared is above the beat, as the search
    with the beat would have pruned nothing either; the others, and the pipeline degrees at the best tensor degree
    (known only then), are searched in a second round, or by this process while a worker finishes the first
    (`_Round.spare`). The same results as `_one_by_one`, in the same order."""
    flat, piped = request.meshes, request.pipeline_meshes
    first = _Round(request, progress, len(flat), workers)
    workers.run([(mesh, 0.0) for mesh in flat] + [(mesh, None) for mesh in piped], first.here, first.done,
                first.spare)
    results = first.ordered[:len(flat)]
    if not first.pays:
        return _searched(request, results)
    meshes = first.second
    progress.meshes += len(meshes)
    second = _Round(request, progress, len(meshes), workers, results)
    for i in range(len(meshes)):
        ahead = first.later.get(i, first.found.get(len(flat) + i) if i < len(piped) else None)
        if ahead is not None and first.stands(ahead):
            second.done(i, ahead, None)
    again = [i for i in range(len(meshes)) if i not in second.found]
    second.indices = again
    workers.run([(meshes[i], first.beat) for i in again], second.here, second.done)
    results = second.ordered
    return _searched(request, results)


class _Round:
    """One round of `_in_rounds`: each result restored where a worker made it, the progress told of them in the
    request's order, and (the first round) the beat handed to the workers once the meshes without a pipeline are
    all in, or the round stopped where a pipeline cannot pay."""

    def __init__(self, request: PlanRequest, progress: MeshProgress, meshes: int, workers: MeshWorkers,
                 before: list[MeshResult] | None = None):
        self.request, self.progress, self.meshes, self.workers = request, progress, meshes, workers
        self.first = before is None  # the round that finds the beat
        self.ordered: list[MeshResult] = list(before or [])
        self.offset = len(self.ordered)
        self.found: dict = {}
        self.indices: list[int] | None = None  # the round's tasks' mesh indices (None: the same)
        self.pays, self.beat = False, 0.0
        self.second: tuple[Mesh, ...] = ()  # the first round's: the pipelined meshes, then those at the best degree
        self.later: dict[int, MeshResult] = {}  # of those, searched here with the beat while a worker was busy

    def here(self, index: int, task: tuple, value: float) -> MeshResult:
        mesh, beat = task
        mesh_index = index if self.indices is None else self.indices[index]
        sweeping = self.progress.sweeping(self.offset + mesh_index, mesh) if mesh.pp == 1 else None
        return search_mesh(self.request, mesh, sweeping, _beat_of(beat, value))

    def done(self, index: int, result, here: bool | None) -> None:
        """`here` None: a result taken as it is (a pipelined mesh searched in the round before)."""
        index = index if self.indices is None or here is None else self.indices[index]
        if isinstance(result, MeshResult) and here is False:
            result = restored(self.request, result)
        self.found[index] = result
        while len(self.ordered) - self.offset < self.meshes and len(self.ordered) - self.offset in self.found:
            result = self.found[len(self.ordered) - self.offset]
            if isinstance(result, BaseException):
                raise result
            self.ordered.append(result)
            self.progress.done(self.ordered)
        if self.first and self.meshes == len(self.ordered) and not self.pays:
            self._decided()

    def _decided(self) -> None:
        """Every mesh without a pipeline in: the beat published, or the round stopped where no pipeline can pay."""
        results = self.ordered
        if self.request.pipeline_meshes and pipeline_pays(results):
            self.pays, self.beat = True, _beat(results)
            self.workers.publish(self.beat)
            piped = self.request.pipeline_meshes
            self.second = piped + _at_best_degree(piped, results)
        else:
            self.workers.stop()

    def stands(self, result) -> bool:
        """Whether a pipelined mesh's result of the first round is its result with the beat."""
        return isinstance(result, MeshResult) and result.beat_bound > self.beat

    def spare(self) -> bool:
        """A mesh of the second round searched here while a worker finishes the first (True), or none left (False):
        a pipelined mesh whose search before the beat came back and does not stand, or one at the best degree."""
        if not self.pays:
            return False
        before = len(self.request.meshes)
        for i, mesh in enumerate(self.second):
            if i in self.later or i < len(self.request.pipeline_meshes) and (
                    before + i not in self.found or self.stands(self.found[before + i])):
                continue
            self.later[i] = search_mesh(self.request, mesh, beat=self.beat)
            return True
        return False


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


def _workers(request: PlanRequest, meshes: int) -> int:
    """Worker processes for the meshes after the first: none for a small model or a single mesh, else one
    per core besides this process's (at least one), at most one per mesh. Only on Linux, whose fork is safe
    with torch imported; elsewhere the meshes run one after another."""
    if meshes == 0 or len(request.tables.units) < PARALLEL_MIN_UNITS or not sys.platform.startswith("linux"):
        return 0
    return max(1, min(meshes, len(os.sched_getaffinity(0)) - 1))


_REQUEST: PlanRequest | None = None  # the request a forked worker searches


def _beat_of(beat: float | None, value: float) -> float | None:
    """A task's beat (None: a pipelined mesh handed out before the beat was known), or the one published since
    (`value`, NaN until then)."""
    return beat if beat is not None or math.isnan(value) else value


def _search_in_worker(task: tuple[Mesh, float | None], value: float) -> MeshResult:
    """A mesh searched in a worker (`value`: the beat once published, NaN before), sent back without its tables
    and cluster (made again where it is read: the traces stay out of the pipes)."""
    mesh, beat = task
    result = search_mesh(_REQUEST, mesh, beat=_beat_of(beat, value))
    if result.pipeline is not None:
        for rank in result.pipeline.ranks:
            rank.source = None
    return replace(result, source=None, cluster=None)


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
