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
solves (`_Search.kind`): the pipeline dimension adds about one whole-model pricing per mesh and micro-batch,
not one per stage. A schedule whose makespan with every unit at its fastest option cannot beat the best
found (on the mesh, or without a pipeline: `beat`) is not solved; nor one whose ranks, each shown to fit, cannot
beat it within their memory (autoplan.solve.slot_bound: a relaxation of each rank's memory rows).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from autoplan.errors import InfeasibleError, UsageError
from autoplan.sizes import format_bytes
from autoplan.solve.cluster import Cluster
from autoplan.solve.request import PlanRequest
from autoplan.solve.pipeline_outcome import PipelineOutcome, RankOutcome
from autoplan.solve.slot_bound import rank_slot_bound
from autoplan.solve.solver import SolveResult, SolveStatus
from autoplan.solve.stage_solve import RankSolve, rank_evaluation, rank_memory, rank_rows, solve_rank
from autoplan.solve.stages import StageTables, balanced_cuts, forward_units, rank_chunks, shifted, slot_bounds, \
    stage_boundaries, stage_cluster, undominated, unit_weights, weight_outputs
from autoplan.solve.sweep import MeshPruned, SweepOutcome, SweepStep
from cost_models.mesh import Mesh
from cost_models.pipeline import HeldAllStep, bubble_slots, deferred, held_all_step, in_flight, later_flight, \
    makespan_s, pipelined_table, refusal, send_s, stages_per_rank
from cost_models.schedules import SCHEDULES, StagesPerRank
from cost_models.table import CostTable
from cost_models.tensor_parallel import TpLayout

__all__ = ["DEFAULT_MICROBATCHES_PER_STAGE", "PipelineOutcome", "RankOutcome", "fixed_pipelines", "search_pipeline"]

DEFAULT_MICROBATCHES_PER_STAGE = 4  # without a global batch: 4 pp micro-batches per step, a bubble under a fifth


@dataclass
class _Search:
    """What one pipelined mesh's search shares: the request, mesh, layout, stage cluster, caches."""

    request: PlanRequest
    mesh: Mesh
    layout: TpLayout | None
    cluster: Cluster
    sources: dict = field(default_factory=dict)  # chunks -> (StageTables, its TableSource)
    tables: dict = field(default_factory=dict)  # (key, micro-batch, m) -> CostTable
    priced: dict = field(default_factory=dict)  # (key, micro-batch, m) -> `pipelined`'s table
    held: dict = field(default_factory=dict)  # (key, micro-batch, m, flight...) -> `pipelined`'s held bytes
    rank_rows: dict = field(default_factory=dict)  # (key, micro-batch, m) -> stage_solve.rank_rows
    solved: dict = field(default_factory=dict)  # (key, micro-batch, m, flight) -> (choices, status) or None
    best: PipelineOutcome | None = None
    lean: InfeasibleError | None = None
    decide: object = None  # fixed choices in place of the solves: a function of a rank's table
    over: float = 0.0  # the last rank that did not fit: its floor over the planned bytes
    beat: float | None = 0.0  # samples/s of the best plan without a pipeline (None: not known yet); `pruned`: schedules
    pruned: int = 0  # whose bound cannot beat it; `bounds`: each bound over any cut compared with `beat`
    bounds: list = field(default_factory=list)
    slot_bounds: dict = field(default_factory=dict)  # (key, micro-batch, m, holds) -> slot_bound.rank_slot_bound
    memory: dict = field(default_factory=dict)  # the same -> stage_solve.rank_memory (its rows with what it holds)
    evals: dict = field(default_factory=dict)  # the same, choices -> stage_solve.rank_evaluation's

    def source(self, chunks: tuple[tuple[int, int], ...]):
        if chunks not in self.sources:
            stage = StageTables(self.request.tables, list(chunks))
            self.sources[chunks] = (stage, stage.for_layout(self.layout))
        return self.sources[chunks]

    def kind(self, chunks) -> tuple:
        """Equal for ranks whose tables are equal: their units' classes (`StageTables.key`) and pinned decisions."""
        stage, source = self.source(chunks)
        pins = self.request.pins
        return stage.key if pins is None else (stage.key, pins.decisions(source.units))

    def pipelined(self, chunks, micro_batch_size: int, m: int, *flight) -> tuple[CostTable, HeldAllStep]:
        """`cost_models.pipeline.pipelined` of the rank's table (`flight`: its flight, drained, later, split backward's
        bytes), once per kind of stage: its table once per micro-batch, what it holds once per flight too."""
        source = self.source(chunks)[1]
        key = (self.kind(chunks), micro_batch_size, m)
        if key not in self.priced:
            self.priced[key] = pipelined_table(self.table(chunks, micro_batch_size, m), m)
        if flight and (*key, *flight) not in self.held:  # no flight: the table alone
            self.held[(*key, *flight)] = held_all_step(self.table(chunks, micro_batch_size, m), *flight)
        return replace(self.priced[key], units=source.units), self.held.get((*key, *flight))

    def rows(self, kind: tuple, table: CostTable):
        """`stage_solve.rank_rows` of a rank's pipelined `table`, once per `kind` of stage, micro-batch and m."""
        if kind not in self.rank_rows:
            self.rank_rows[kind] = rank_rows(table)
        return self.rank_rows[kind]

    def held_rows(self, kind: tuple, holds: tuple, table: CostTable, held: HeldAllStep):
        """`stage_solve.rank_memory` of a rank's pipelined `table` with what it holds, once per kind and holds."""
        if (*kind, holds) not in self.memory:
            self.memory[(*kind, holds)] = rank_memory(self.rows(kind, table), held)
        return self.memory[(*kind, holds)]

    def table(self, chunks, micro_batch_size: int, microbatches: int) -> CostTable:
        source = self.source(chunks)[1]
        key = (self.kind(chunks), micro_batch_size, microbatches)
        if key not in self.tables:
            t, pins = self.request.training, self.request.pins
            table = source.table(micro_batch_size, microbatches, self.cluster, t.seq_len, t.dtype, t.optimizer)
            if pins is not None and self.decide is None and self.request.uniform is None:  # others overlay pins
                table = pins.restrict(replace(table, units=source.units))
            self.tables[key] = table
        return replace(self.tables[key], units=source.units)


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
    search = _Search(request, mesh, layout, stage_cluster(request.cluster, mesh), beat=beat, bounds=bounds)
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
    return search.best, _as_sweep(search.best, time.perf_counter() - start)


def _bound_s(search: _Search, row, cuts: list[int], micro_batch_size: int, m: int) -> tuple[float, float]:
    """The makespan with every unit at its fastest option, no sends and no optimizer step (memory aside): no plan
    of this cut beats the first, no plan of any cut the second (stages.slot_bounds)."""
    pp, base = search.mesh.pp, search.request.tables
    starts = [0] + [base.units[forward_units(base.units)[c]].first_op for c in cuts[1:]]
    tables = [search.pipelined(rank_chunks(row, pp, rank, starts, len(base.trace_1.ops))[1], micro_batch_size, m)[0]
              for rank in range(pp)]
    return tuple(makespan_s(slot, 0.0, row, pp, m) for slot in slot_bounds(tables, m))


_PRUNED = "pruned"  # a schedule not solved at a micro-batch: it cannot beat the best found
BOUND_MARGIN = 1e-7  # a memory-aware bound (a float search) prunes only what it is below by more than this


def _schedule(search: _Search, row, weights: list[float], micro_batch_size: int, m: int) -> PipelineOutcome | str | None:
    """The pipeline under `row` at one micro-batch: balanced cuts, each rank solved, a unit moved off a rank
    that does not fit (at most once per stage); None where no cut fits, _PRUNED where its bound cannot beat
    the best found."""
    stages = search.mesh.pp * stages_per_rank(row)
    units = len(forward_units(search.request.tables.units))
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
            return _priced(row, search.mesh.pp, m, micro_batch_size, cuts, ranks)
        if search.over > 1 + stages / units:
            return None  # over by more than a unit of its stage: moving one cannot make it fit
        cuts = shifted(cuts, failed, units)
        if cuts is None:
            return None
    return None


def _ranks(search: _Search, row, cuts: list[int], micro_batch_size: int, m: int, solve: bool = True,
           upto: int | None = None) -> tuple[list[RankOutcome], int | None]:
    """Every rank of the cut (the first `upto`) priced (solved, or fixed choices evaluated), and the first stage of the
    first rank where nothing fits (None: all fit). Not `solve`: no ranks, the first stage whose rank's floor is over."""
    ranks = []
    for rank, mine, chunks, holds, sends in _rank_holds(search, row, cuts, micro_batch_size, m, upto):
        outcome = _solve_rank(search, chunks, micro_batch_size, m, holds, solve)
        if outcome is None:
            return ranks, mine[0]
        if not solve:
            continue
        choices, status, table, held, key = outcome
        ranks.append(RankOutcome(rank, mine, chunks, search.source(chunks)[1], table, choices,
                                 rank_evaluation(search.evals, key, table, held, choices), holds[0], status, sends,
                                 held))
    return ranks, None


def _rank_holds(search: _Search, row, cuts: list[int], micro_batch_size: int, m: int, upto: int | None = None):
    """Per rank of the cut (the first `upto`): its stages, their op ranges, what it holds (`_solve_rank`'s `holds`)
    and its sends per micro-batch."""
    pp, stages = search.mesh.pp, search.mesh.pp * stages_per_rank(row)
    base = search.request.tables
    order = forward_units(base.units)
    starts = [0] + [base.units[order[c]].first_op for c in cuts[1:]]
    bounds = stage_boundaries(search.request.tables, search.layout, starts, micro_batch_size)
    for rank in range(upto or pp):
        mine, chunks = rank_chunks(row, pp, rank, starts, len(base.trace_1.ops))
        flight, drained = in_flight(row, pp, rank, m), row.stages_per_rank is StagesPerRank.ONE
        # PipelineStage's receive buffers, one per micro-batch: each stage's input (not the first's), output grad
        buffers = m * sum((bounds[s - 1] if s > 0 else 0) + (bounds[s] if s + 1 < stages else 0) for s in mine)
        split = weight_outputs(search.source(chunks)[1], chunks, micro_batch_size, search.request.training,
                               deferred(row, pp, rank, m))  # the split backward's bytes: zero bubble
        holds = (flight, buffers, drained, later_flight(row, flight, m), sum(bounds[s] for s in mine), split)
        sends = sum(2 * send_s(search.cluster.profile, bounds[s], search.mesh) for s in mine if s + 1 < stages)
        yield rank, mine, chunks, holds, sends


def _memory_bound_s(search: _Search, row, cuts: list[int], micro_batch_size: int, m: int) -> float | None:
    """The makespan no plan of this cut beats within its ranks' memory (autoplan.solve.slot_bound: each rank's
    fastest micro-batch that fits, bounded, with its sends), or None where a rank is not shown to fit."""
    if search.request.uniform is not None or search.decide is not None:
        return None
    slot = 0.0
    for _, _, chunks, holds, sends in _rank_holds(search, row, cuts, micro_batch_size, m):
        kind = (search.kind(chunks), micro_batch_size, m)
        if (*kind, holds) not in search.slot_bounds:
            table, held = _held(search, chunks, micro_batch_size, m, holds)
            rows, memory = search.rows(kind, table), search.held_rows(kind, holds, table, held)[0]
            search.slot_bounds[(*kind, holds)] = rank_slot_bound(rows.table, rows.algebra.offsets, memory,
                                                                 search.request.limits.planned_bytes)
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
    search = _Search(request, mesh, layout, stage_cluster(request.cluster, mesh), decide=decide)
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
        outcomes.append(_priced(row, mesh.pp, m, micro_batch_size, cuts, ranks))
    return outcomes


def _solve_rank(search: _Search, chunks, micro_batch_size: int, m: int, holds: tuple, solve: bool = True):
    """A rank solved (or its uniform strategy evaluated, or fixed choices taken) with what it holds (`holds`: flight,
    buffers, drained, later, outputs, split backward's), and its key; None where nothing fits (`search.lean`)."""
    request = search.request
    table, held = _held(search, chunks, micro_batch_size, m, holds)
    kind = (search.kind(chunks), micro_batch_size, m)
    key = (*kind, holds)
    if search.decide is not None:
        return search.decide(table), SolveStatus.FIXED, table, held, key
    if not solve and key not in search.solved and request.uniform is None:  # the floor alone, no solve
        floor = search.held_rows(kind, holds, table, held)[1]
        found = RankSolve(None if floor > request.limits.planned_bytes else [], SolveStatus.PRUNED, floor)
    else:
        if key not in search.solved:  # the uniform strategy's evaluation needs no rows
            rows = search.rows(kind, table) if request.uniform is None else None
            search.solved[key] = solve_rank(request, table, held, rows)
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
    return found.choices, found.status, table, held, key


def _held(search: _Search, chunks, micro_batch_size: int, m: int, holds: tuple) -> tuple[CostTable, HeldAllStep]:
    """A rank's pipelined table and what it holds all step (`_solve_rank`'s `holds`)."""
    flight, buffers, drained, later, outputs, split = holds
    table, held = search.pipelined(chunks, micro_batch_size, m, flight, drained, later, split)
    return table, replace(held, buffers=buffers, outputs=(int(outputs * later), int(outputs * flight)))


def _priced(row, pp: int, m: int, micro_batch_size: int, cuts: list[int], ranks: list[RankOutcome]) -> PipelineOutcome:
    slot = max(r.slot_s for r in ranks)
    optimizer = max(r.evaluation.optimizer_s for r in ranks)
    step = makespan_s(slot, optimizer, row, pp, m)
    bubble = bubble_slots(row, pp) * slot
    p2p = (m + bubble_slots(row, pp)) * max(r.send_s for r in ranks)
    return PipelineOutcome(row.name, pp, m, micro_batch_size, cuts, ranks, step, bubble, p2p)


def _as_sweep(outcome: PipelineOutcome, wall_s: float) -> SweepOutcome:
    """The pipeline in the sweep's terms: the busiest rank's table and evaluation, its step the makespan."""
    busiest = outcome.busiest
    evaluation = replace(busiest.evaluation, step_time_s=outcome.step_time_s,
                         optimizer_s=max(r.evaluation.optimizer_s for r in outcome.ranks))
    status = SolveStatus.FIXED if all(r.status == SolveStatus.FIXED for r in outcome.ranks) else busiest.status
    result = SolveResult(status, busiest.choices, outcome.step_time_s, None, wall_s, 0, 0, 0)
    return SweepOutcome(table=busiest.table, choices=busiest.choices, evaluation=evaluation, result=result,
                        steps=outcome.steps, tables=[], wall_time_s=wall_s)
