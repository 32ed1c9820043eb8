"""The search of one pipelined mesh: micro-batches, schedules, stage boundaries and each stage's own plan.

A mesh with a pipeline degree pp runs the world as pp groups of ranks, each running one stage (or, looped, v
stages) of contiguous units sharded over the group's data-parallel ranks (tensor parallelism inside a node as
on any mesh). For each micro-batch size (micro-batches per step from the global batch: global / (dp x
micro-batch); without one, `DEFAULT_MICROBATCHES_PER_STAGE` x pp) and each schedule torch can run there
(`--schedule` fixes one), the units are cut where the predicted time balances (autoplan.solve.stages) and
every pipeline rank's units are solved by the per-unit CP-SAT solver on the rank's tables as the pipeline
runs them (cost_models.pipeline: micro-batches in flight, FSDP gathering once per step) under the rank's
memory limit, pins cutting a pinned unit's options as without a pipeline. A rank that does not fit gives a
unit to its neighbour and the ranks are solved again. The step is the pipeline's makespan (the slowest
rank's micro-batch and sends, times the micro-batches plus the bubble, then the optimizer).

Stages of the same blocks (and pins) share their tables and, at the same micro-batches in flight, their
solves (`PipelineSearch.kind`): the pipeline dimension adds about one whole-model pricing per mesh and micro-batch,
not one per stage. A schedule whose makespan with every unit at its fastest option cannot beat the best
found (on the mesh, or without a pipeline: `beat`) is not solved; nor one whose ranks, each shown to fit, cannot
beat it within their memory (autoplan.solve.slot_bound: a relaxation of each rank's memory rows).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from autoplan.errors import InfeasibleError, UsageError
from autoplan.sizes import format_bytes
from autoplan.solve.request import PlanRequest
from autoplan.solve.pipeline_outcome import PipelineOutcome, RankOutcome, as_sweep, priced_pipeline
from autoplan.solve.pipeline_search import PipelineSearch
from autoplan.solve.slot_bound import literal_times, rank_slot_bound
from autoplan.solve.solver import SolveStatus
from autoplan.solve.stage_solve import RankSolve, rank_evaluation, solve_rank
from autoplan.solve.stages import balanced_cuts, fastest_slot, forward_units, rank_chunks, shifted, slot_bounds, \
    stage_boundaries, stage_cluster, undominated, unit_weights, weight_outputs
from autoplan.solve.sweep import MeshPruned, SweepOutcome, SweepStep
from cost_models.mesh import Mesh
from cost_models.pipeline import HeldAllStep, bubble_slots, deferred, in_flight, later_flight, makespan_s, refusal, \
    send_s, stages_per_rank
from cost_models.schedules import SCHEDULES, StagesPerRank
from cost_models.table import CostTable
from cost_models.tensor_parallel import TpLayout

__all__ = ["DEFAULT_MICROBATCHES_PER_STAGE", "PipelineOutcome", "RankOutcome", "fixed_pipelines", "search_pipeline"]

DEFAULT_MICROBATCHES_PER_STAGE = 4  # without a global batch: 4 pp micro-batches per step, a bubble under a fifth


def search_pipeline(request: PlanRequest, mesh: Mesh, layout: TpLayout | None, schedule: str | None = None,
                    beat: float | None = 0.0, bounds: list[float] | None = None) -> tuple[PipelineOutcome, SweepOutcome]:
    """The fastest pipelined plan on `mesh` (see the module docstring) faster than `beat` samples/s where its bound
    can beat that, and the same in the sweep's terms (the busiest rank's table and evaluation, the step the makespan).
    InfeasibleError where nothing fits, MeshPruned where no schedule's bound beats `beat`. `beat` None: not known yet,
    none prunes; `bounds` gets each bound over any cut compared with `beat` (samples/s): where all are above the beat
    found, a search with it takes the same path (it prunes only what one is not above)."""
    if mesh.ep > 1:
        raise UsageError("expert parallelism is not combined with a pipeline (`pp` above 1) yet")
    bounds = [] if bounds is None else bounds
    search = PipelineSearch(request, mesh, layout, stage_cluster(request.cluster, mesh), beat=beat, bounds=bounds)
    start, steps = time.perf_counter(), []
    rows = [SCHEDULES[schedule]] if schedule else sorted(SCHEDULES.values(), key=lambda r: bubble_slots(r, mesh.pp))
    units = len(forward_units(request.tables.units))
    weights = unit_weights(request.tables.units, request.tables.inputs(1).ops, request.cluster.profile,
                           request.training.compute_dtype)
    refusals: list[str | None] = []
    for micro_batch_size, accum in request.batch.candidates(search.cluster.mesh.dp):
        m = accum if request.batch.global_batch is not None else DEFAULT_MICROBATCHES_PER_STAGE * mesh.pp
        refused = {row.name: refusal(row, mesh.pp, m, units) for row in rows}
        refusals += refused.values()
        tried = undominated([row for row in rows if refused[row.name] is None], schedule)
        outcomes = [_schedule(search, row, weights, micro_batch_size, m) for row in tried]
        found = [o for o in outcomes if isinstance(o, PipelineOutcome)]
        best = min(found, key=lambda o: (o.step_time_s, o.schedule), default=None)
        if best is not None and (search.best is None or best.samples_per_step / best.step_time_s >
                                 search.best.samples_per_step / search.best.step_time_s * (1 + 1e-9)):
            search.best = best
        infeasible = tried and all(o is None for o in outcomes)
        steps.append(SweepStep(micro_batch_size, m, SolveStatus.OPTIMAL if best else SolveStatus.INFEASIBLE if
                               infeasible else SolveStatus.PRUNED, best.step_time_s if best else None,
                               best.samples_per_step / best.step_time_s if best else None))
        if infeasible:
            break  # a larger micro-batch needs more memory still
    if search.best is None and search.pruned:  # what was not pruned did not fit: it might have, so say pruned
        raise MeshPruned(f"pruned: no pipelined plan beats {beat:,.2f} samples/s (the best without a pipeline): with "
                         "every unit at its fastest option, with no memory limit or within its rank's memory, every "
                         "schedule tried is slower")
    if search.best is None:
        why = "; ".join([r for r in refusals if r][:3])
        raise search.lean or UsageError(f"no schedule runs on pipeline degree {mesh.pp}: {why}")
    search.best.steps = steps
    return search.best, as_sweep(search.best, time.perf_counter() - start)


def _bound_s(search: PipelineSearch, row, cuts: list[int], micro_batch_size: int, m: int) -> tuple[float, float]:
    """The makespan with every unit at its fastest option, no sends and no optimizer step (memory aside): no plan
    of this cut beats the first, no plan of any cut the second (stages.slot_bounds)."""
    pp, base, starts = search.mesh.pp, search.request.tables, search.starts(cuts)
    sums = []
    for rank in range(pp):  # ranks of one kind share their tables: their fastest slot once
        chunks = rank_chunks(row, pp, rank, starts, len(base.trace_1.ops))[1]
        kind = (search.kind(chunks), micro_batch_size, m)
        if kind not in search.fastest:
            search.fastest[kind] = fastest_slot(search.pipelined(chunks, micro_batch_size, m, units=False)[0], m)
        sums.append(search.fastest[kind])
    return tuple(makespan_s(slot, 0.0, row, pp, m) for slot in slot_bounds(sums))


_PRUNED = "pruned"  # a schedule not solved at a micro-batch: it cannot beat the best found
BOUND_MARGIN = 1e-7  # a memory-aware bound (a float search) prunes only what it is below by more than this


def _schedule(search: PipelineSearch, row, weights: list[float], micro_batch_size: int,
              m: int) -> PipelineOutcome | str | None:
    """The pipeline under `row` at one micro-batch: balanced cuts, each rank solved, a unit moved off a rank
    that does not fit (at most once per stage); None where no cut fits, _PRUNED where its bound cannot beat
    the best found."""
    stages, units = search.mesh.pp * stages_per_rank(row), len(search.order)
    cuts = balanced_cuts(weights, stages)
    best, samples = search.best, micro_batch_size * m * search.cluster.mesh.dp
    if best is None and search.beat != 0:  # rank 0 first, as every path below (its floor alone: no other rank's table)
        _, failed = _ranks(search, row, cuts, micro_batch_size, m, solve=False, upto=1)
        if failed is not None and search.over > 1 + stages / units:
            return None  # over by more than a unit of its stage: no cut fits, whatever the bound
    if best is not None or search.beat != 0:  # None: not known yet
        this_cut, any_cut = (samples / bound for bound in _bound_s(search, row, cuts, micro_batch_size, m))
        if best is not None and this_cut <= best.samples_per_step / best.step_time_s:
            return _PRUNED  # cannot beat the best found even with no memory limit
        # nor the best without a pipeline, which wins a tie (best_result: the lower pipeline degree); unless a
        # rank's floor says, as a solve would (below), that no cut fits: a larger micro-batch fits no better
        search.bounds.append(any_cut)
        if search.beat is not None and any_cut <= search.beat:
            _, failed = _ranks(search, row, cuts, micro_batch_size, m, solve=False)
            if failed is not None and search.over > 1 + stages / units:
                return None
            search.pruned += 1
            return _PRUNED
        bound = _memory_bound_s(search, row, cuts, micro_batch_size, m)  # this cut's, where it is kept (no rank
        if bound is not None:  # moves it: each is shown to fit); the margin: no rounding prunes a tie's winner
            this_cut = samples / bound * (1 + BOUND_MARGIN)
            if best is not None and this_cut <= best.samples_per_step / best.step_time_s:
                return _PRUNED
            search.bounds.append(this_cut)
            if search.beat is not None and this_cut <= search.beat:
                search.pruned += 1
                return _PRUNED
    for _ in range(stages):  # a unit moved off a rank that does not fit, at most once per stage
        ranks, failed = _ranks(search, row, cuts, micro_batch_size, m)
        if failed is None:
            return priced_pipeline(row, search.mesh.pp, m, micro_batch_size, cuts, ranks)
        if search.over > 1 + stages / units:
            return None  # over by more than a unit of its stage: moving one cannot make it fit
        cuts = shifted(cuts, failed, units)
        if cuts is None:
            return None
    return None


def _ranks(search: PipelineSearch, row, cuts: list[int], micro_batch_size: int, m: int, solve: bool = True,
           upto: int | None = None) -> tuple[list[RankOutcome], int | None]:
    """Every rank of the cut (the first `upto`) priced (solved, or fixed choices evaluated), and the first stage of the
    first rank where nothing fits (None: all fit; else no ranks). Not `solve`: no ranks, the first stage whose rank's
    floor is over."""
    solved = []
    for rank, mine, chunks, holds, sends in _rank_holds(search, row, cuts, micro_batch_size, m, upto):
        outcome = _solve_rank(search, chunks, micro_batch_size, m, holds, solve)
        if outcome is None:
            return [], mine[0]
        solved.append((rank, mine, chunks, holds, sends, outcome))
    if not solve:
        return [], None
    # evaluated once every rank fits: where one does not, the cut moves and no rank's plan of it is read
    ranks = []
    for rank, mine, chunks, holds, sends, (choices, status, held, key) in solved:
        table = search.pipelined(chunks, micro_batch_size, m)[0]
        ranks.append(RankOutcome(rank, mine, chunks, search.source(chunks), table, choices,
                                 rank_evaluation(search.evals, key, table, held, choices), holds[0], status, sends,
                                 held))
    return ranks, None


def _rank_holds(search: PipelineSearch, row, cuts: list[int], micro_batch_size: int, m: int, upto: int | None = None):
    """Per rank of the cut (the first `upto`): its stages, their op ranges, what it holds (`_solve_rank`'s `holds`)
    and its sends per micro-batch; made once per cut (its floors, bound and solves each walk its ranks)."""
    pp, stages = search.mesh.pp, search.mesh.pp * stages_per_rank(row)
    made = search.holds.setdefault((row.name, tuple(cuts), micro_batch_size, m), [])
    if len(made) >= (upto or pp):
        return made[:upto or pp]
    base, starts = search.request.tables, search.starts(cuts)
    bounds = stage_boundaries(search.request.tables, search.layout, starts, micro_batch_size)
    for rank in range(len(made), upto or pp):
        mine, chunks = rank_chunks(row, pp, rank, starts, len(base.trace_1.ops))
        flight, drained = in_flight(row, pp, rank, m), row.stages_per_rank is StagesPerRank.ONE
        # PipelineStage's receive buffers, one per micro-batch: each stage's input (not the first's), output grad
        buffers = m * sum((bounds[s - 1] if s > 0 else 0) + (bounds[s] if s + 1 < stages else 0) for s in mine)
        split = weight_outputs(search.source, chunks, micro_batch_size, search.request.training,
                               deferred(row, pp, rank, m))  # the split backward's bytes: zero bubble
        holds = (flight, buffers, drained, later_flight(row, flight, m), sum(bounds[s] for s in mine), split)
        sends = sum(2 * send_s(search.cluster.profile, bounds[s], search.mesh) for s in mine if s + 1 < stages)
        made.append((rank, mine, chunks, holds, sends))
    return made


def _memory_bound_s(search: PipelineSearch, row, cuts: list[int], micro_batch_size: int, m: int) -> float | None:
    """The makespan no plan of this cut beats within its ranks' memory (autoplan.solve.slot_bound: each rank's
    fastest micro-batch that fits, bounded, with its sends), or None where a rank is not shown to fit."""
    if search.request.uniform is not None or search.decide is not None:
        return None
    slot = 0.0
    for _, _, chunks, holds, sends in _rank_holds(search, row, cuts, micro_batch_size, m):
        kind = (search.kind(chunks), micro_batch_size, m)
        if (*kind, holds) not in search.slot_bounds:
            held = _held(search, chunks, micro_batch_size, m, holds, units=False)[1]
            rows, memory = search.rows(kind, chunks), search.held_rows(kind, holds, chunks, held)[0]
            if kind not in search.times:  # the rows' table's, whatever the rank holds
                search.times[kind] = literal_times(rows.table)
            search.slot_bounds[(*kind, holds)] = rank_slot_bound(rows.table, rows.algebra.offsets, memory,
                                                                 search.request.limits.planned_bytes,
                                                                 search.times[kind])
        if search.slot_bounds[(*kind, holds)] is None:
            return None
        slot = max(slot, search.slot_bounds[(*kind, holds)] + sends)
    return makespan_s(slot, 0.0, row, search.mesh.pp, m)


def fixed_pipelines(request: PlanRequest, mesh: Mesh, layout: TpLayout | None, schedule: str,
                    cut_list: list[list[int] | None], decide) -> list[PipelineOutcome]:
    """Pipelines of fixed decisions on `mesh` (an estimate; a plan explained, its boundaries moved), one per cut
    of `cut_list` (each stage's first unit among stages.forward_units; None: balanced), `decide(table)` each
    rank's choices into its table; the tables are built once for all. Whether they fit is the caller's to say
    (their ranks' evaluations)."""
    search = PipelineSearch(request, mesh, layout, stage_cluster(request.cluster, mesh), decide=decide)
    row = SCHEDULES[schedule]
    [(micro_batch_size, accum)] = request.batch.candidates(search.cluster.mesh.dp)
    m = accum if request.batch.global_batch is not None else DEFAULT_MICROBATCHES_PER_STAGE * mesh.pp
    units = len(forward_units(request.tables.units))
    why = refusal(row, mesh.pp, m, units)
    if why is not None:
        raise UsageError(why)
    weights = unit_weights(request.tables.units, request.tables.inputs(1).ops, request.cluster.profile,
                           request.training.compute_dtype)
    outcomes = []
    for cuts in cut_list:
        cuts = balanced_cuts(weights, mesh.pp * stages_per_rank(row)) if cuts is None else cuts
        ranks, _ = _ranks(search, row, cuts, micro_batch_size, m)
        outcomes.append(priced_pipeline(row, mesh.pp, m, micro_batch_size, cuts, ranks))
    return outcomes


def _solve_rank(search: PipelineSearch, chunks, micro_batch_size: int, m: int, holds: tuple, solve: bool = True):
    """A rank solved (or its uniform strategy evaluated, or fixed choices taken) with what it holds (`holds`: flight,
    buffers, drained, later, outputs, split backward's): its choices, status, held bytes and key; None where nothing
    fits (`search.lean`)."""
    request = search.request
    paths = search.decide is not None or request.uniform is not None  # what reads the table's paths (pins, choices)
    table, held = _held(search, chunks, micro_batch_size, m, holds, paths)
    kind = (search.kind(chunks), micro_batch_size, m)
    key = (*kind, holds)
    if search.decide is not None:
        return search.decide(table), SolveStatus.FIXED, held, key
    if not solve and key not in search.solved and request.uniform is None:  # the floor alone, no solve
        floor = search.held_rows(kind, holds, chunks, held)[1]
        found = RankSolve(None if floor > request.limits.planned_bytes else [], SolveStatus.PRUNED, floor)
    else:
        if key not in search.solved:  # the uniform strategy's evaluation needs no rows
            rows = memory = None
            if request.uniform is None:
                rows, memory = search.rows(kind, chunks), search.held_rows(kind, holds, chunks, held)
            search.solved[key] = solve_rank(request, table, held, rows, memory)
        found = search.solved[key]
    if found.choices is None:
        limits, least = request.limits, request.limits.limit_for(found.floor_bytes)  # planned 0: margin takes all
        search.over = found.floor_bytes / limits.planned_bytes if limits.planned_bytes > 0 else math.inf
        search.lean = InfeasibleError(
            f"no pipelined plan for {request.model.name} fits in {format_bytes(limits.mem_limit_bytes)} per GPU on "
            f"pipeline degree {search.mesh.pp}{' with the pins' if request.pins else ''}: a rank with {holds[0]:g} "
            f"micro-batches in flight needs at least {format_bytes(found.floor_bytes)} (micro-batch {micro_batch_size})"
            f": a limit of at least {format_bytes(least)}", min_mem_bytes=least)
        return None
    return found.choices, found.status, held, key


def _held(search: PipelineSearch, chunks, micro_batch_size: int, m: int, holds: tuple,
          units: bool = True) -> tuple[CostTable, HeldAllStep]:
    """A rank's pipelined table (`PipelineSearch.pipelined`'s `units`) and what it holds all step (`_solve_rank`'s
    `holds`)."""
    flight, buffers, drained, later, outputs, split = holds
    table, held = search.pipelined(chunks, micro_batch_size, m, flight, drained, later, split, units=units)
    return table, replace(held, buffers=buffers, outputs=(int(outputs * later), int(outputs * flight)))
