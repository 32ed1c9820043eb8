"""The micro-batch sweep: one CP-SAT solve per candidate micro-batch size, the fastest plan kept.

Memory grows with the micro-batch, so the sweep stops at the first size nothing fits in, and a size
that cannot beat the best plan so far even with no memory limit is skipped without a solve. Among
plans as fast as the best, the one with the lowest peak memory is preferred (a best-effort second
solve). The result is solver terms (a table and one option index per unit); `autoplan.plan.assemble`
turns it into a plan file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autoplan.errors import InfeasibleError, SolverTimeout, UsageError
from autoplan.sizes import format_bytes
from autoplan.solve.cluster import Cluster
from autoplan.solve.pins import PinResolution
from autoplan.solve.request import Limits, PlanRequest, Uniform
from autoplan.solve.solver import AffineModel, SolveResult, SolveStatus, solve_min_memory, solve_min_time
from autoplan.solve.tables import TableSource
from cost_models.choices import searched_options
from cost_models.evaluate import Evaluation, evaluate, uniform_choices
from cost_models.memory_floor import memory_floor
from cost_models.step import lower_bound_step_s
from cost_models.table import CostTable

__all__ = ["MeshPruned", "SweepStep", "SweepOutcome", "sweep", "TIE_BREAK_WORK"]

# the tie-break towards lower memory is best-effort: proving the leanest of many equally fast plans
# over near-identical blocks can take CP-SAT any time limit (405B: all 10 s); without it the fastest
# plan found stands. Its budget is CP-SAT's deterministic time (about a second of an idle core), not the
# clock: a wall-clock second ran out or not with the machine's load (and with the meshes searched side by
# side), so the same search on a busy machine chose another of the equally fast plans
TIE_BREAK_WORK = 1.0


class MeshPruned(Exception):
    """A mesh not searched to the end: no plan of it can beat the best plan another mesh found (the message says
    why), so it cannot be chosen."""


@dataclass
class SweepStep:
    """What the sweep did at one micro-batch size."""

    micro_batch_size: int
    grad_accum_steps: int
    status: SolveStatus  # the solver's status, FIXED for a uniform strategy, PRUNED when skipped
    step_time_s: float | None
    throughput_samples_s: float | None


@dataclass
class SweepOutcome:
    """The chosen plan in solver terms, and how the sweep got there."""

    table: CostTable  # the chosen micro-batch's cost table
    choices: list[int]  # option index per unit of `table`
    evaluation: Evaluation
    result: SolveResult  # the min-time solve (or the fixed strategy) at the chosen micro-batch
    steps: list[SweepStep] = field(default_factory=list)
    tables: list[CostTable] = field(default_factory=list)  # every micro-batch where some plan fits
    wall_time_s: float = 0.0
    num_variables: int = 0  # the size of the model that gave the plan (its micro-batch's min-time solve)
    num_constraints: int = 0


def _searched(table: CostTable) -> CostTable:
    """`table` with each unit's options cut to those the search considers (choices.searched_options)."""
    keep = [searched_options(options) for options in table.options]
    if all(len(k) == len(options) for k, options in zip(keep, table.options)):
        return table
    return replace(table, options=[[opts[i] for i in k] for opts, k in zip(table.options, keep)],
                   costs=[[costs[i] for i in k] for costs, k in zip(table.costs, keep)])


def sweep(request: PlanRequest, source: TableSource, cluster: Cluster,
          progress: Callable[[SweepStep, float | None], None] | None = None) -> SweepOutcome:
    """The fastest plan over the request's micro-batches whose predicted peak is at most its planned bytes, on
    `cluster` (one of the request's meshes) with `source`'s tables (the model's, or their tensor-parallel view).
    A uniform strategy (`request.uniform`) replaces the solve by that plan. The pins restrict the options of
    the units they name (with a strategy: those units take their pins). Raises InfeasibleError (with the
    smallest limit that would fit) when nothing fits, SolverTimeout when the solver's time ran out before
    any verdict. `progress(step, best)` is told each micro-batch's outcome and the best throughput so far."""
    swept = _Swept()
    for micro_batch_size, accum in request.batch.candidates(cluster.mesh.dp):
        unpinned, table = _tables(request, source, cluster, micro_batch_size, accum)
        swept.unpinned.append(unpinned)
        if swept.best is not None and table.samples_per_step / lower_bound_step_s(table) <= swept.best[0]:
            # even with no memory limit this micro-batch cannot beat the best plan: skip the solve
            swept.steps.append(SweepStep(micro_batch_size, accum, SolveStatus.PRUNED, None, None))
            swept.seen.append(table)
            _tell(progress, swept.steps, swept.best)
            continue
        planned = request.limits.planned_for(table)
        if swept.best is not None and request.uniform is None and memory_floor(table) > planned:
            # nothing fits, as a solve would say: even each unit's least bytes overrun a time point (no rows built)
            swept.steps.append(SweepStep(micro_batch_size, accum, SolveStatus.INFEASIBLE, None, None))
            _tell(progress, swept.steps, swept.best)
            break  # a larger micro-batch needs more memory still
        affine = AffineModel.of(table)
        swept.first = swept.first or (table, affine)
        if request.uniform is None:
            result = solve_min_time(table, planned, request.limits.time_limit_s, affine=affine)
        else:
            result = _fixed_strategy(table, affine, request.uniform, planned, request.pins)
        swept.wall_s += result.wall_time_s
        if result.choices is None:
            swept.steps.append(SweepStep(micro_batch_size, accum, result.status, None, None))
            _tell(progress, swept.steps, swept.best)
            if result.status != SolveStatus.INFEASIBLE:
                swept.seen.append(table)
                continue  # the time limit ran out: no verdict on this size, try the next
            if not swept.seen:
                swept.seen.append(table)
            break  # a larger micro-batch needs more memory still
        swept.seen.append(table)
        throughput = table.samples_per_step / result.objective
        swept.steps.append(SweepStep(micro_batch_size, accum, result.status, result.objective, throughput))
        if swept.best is None or throughput > swept.best[0] * (1 + 1e-9):
            swept.best = (throughput, table, result, affine)
        _tell(progress, swept.steps, swept.best)
    return _outcome(request, cluster, swept)


@dataclass
class _Swept:
    """What the sweep has done so far."""

    steps: list[SweepStep] = field(default_factory=list)
    seen: list[CostTable] = field(default_factory=list)
    unpinned: list[CostTable] = field(default_factory=list)  # every option: for the baselines, to explain pins
    best: tuple | None = None  # (throughput, table, result, affine)
    first: tuple[CostTable, AffineModel] | None = None  # the first table solved and its model
    wall_s: float = 0.0


def _tables(request: PlanRequest, source: TableSource, cluster: Cluster, micro_batch_size: int,
            accum: int) -> tuple[CostTable, CostTable]:
    """The cost table at one micro-batch with every option, and with the options the sweep solves over: the
    pins' (without a strategy) and the modes the search offers (a unit pinned to another keeps it)."""
    uniform, training = request.uniform, request.training
    table = source.table(micro_batch_size, accum, cluster, training.seq_len, training.dtype, training.optimizer,
                         offload=True if uniform is not None and uniform.offload else None)
    table = request.limits.with_margin(table, source)  # the allocator's margin per time point, where fitted to it
    searched = table
    if request.pins is not None and uniform is None:
        searched = request.pins.restrict(searched)
    if uniform is None:
        searched = _searched(searched)
    return table, searched


def _outcome(request: PlanRequest, cluster: Cluster, swept: _Swept) -> SweepOutcome:
    """The best plan found (among those as fast, the leanest), or why there is none."""
    if swept.best is None:
        table = swept.unpinned[0]  # its model where it was solved (no option cut, no pins): not made again
        affine = swept.first[1] if swept.first is not None and swept.first[0] is table else None
        raise _nothing_found(request, cluster, swept.steps, table, affine)
    _, table, result, affine = swept.best
    choices, wall_s = result.choices, swept.wall_s
    if request.uniform is None:  # among plans as fast as the best, the one with the lowest peak memory
        lean = _leanest(table, affine, result, request.limits)
        wall_s += lean.wall_time_s
        choices = lean.choices or result.choices
    fitting = [t for t, step in zip(swept.unpinned, swept.steps) if step.status != SolveStatus.INFEASIBLE]
    return SweepOutcome(table=table, choices=choices, evaluation=evaluate(table, choices), result=result,
                        steps=swept.steps, tables=fitting or swept.unpinned, wall_time_s=wall_s,
                        num_variables=result.num_variables, num_constraints=result.num_constraints)


def _tell(progress, steps: list[SweepStep], best) -> None:
    if progress is not None:
        progress(steps[-1], None if best is None else best[0])


def _leanest(table: CostTable, affine: AffineModel, fastest: SolveResult, limits: Limits) -> SolveResult:
    """Among plans as fast as `fastest`, the one with the lowest peak memory (a best-effort, short solve)."""
    return solve_min_memory(table, time_limit_s=limits.time_limit_s, max_step_s=fastest.objective,
                            mem_limit_bytes=limits.planned_for(table), affine=affine, start_from=fastest.choices,
                            work_limit=TIE_BREAK_WORK)


def _nothing_found(request: PlanRequest, cluster: Cluster, steps: list[SweepStep], table: CostTable,
                   affine: AffineModel | None = None) -> SolverTimeout | InfeasibleError:
    """Why no micro-batch gave a plan: the solver's time ran out before a verdict, the pins make it so (the
    pins that cannot all hold), or nothing fits (with the smallest limit that would)."""
    limits, pins = request.limits, request.pins
    if any(step.status not in (SolveStatus.INFEASIBLE, SolveStatus.PRUNED) for step in steps):
        return SolverTimeout(
            f"the solver found no plan within `time_limit_s` {limits.time_limit_s:g} s per micro-batch size "
            f"({', '.join(f'{s.micro_batch_size}: {s.status.lower()}' for s in steps)}); raise `time_limit_s`, or "
            "give `batch_size` to try a single micro-batch size")
    if request.uniform is not None:
        return _uniform_infeasible(request, cluster, table)
    pinned = pins is not None
    if pinned:
        explained = pins.explain_infeasible(table, limits.planned_for(table), request.model.name,
                                            limits.mem_limit_bytes, limits.headroom, limits.time_limit_s)
        if explained is not None:
            return explained
    error = _infeasible(table, limits, request.model.name, cluster, request.batch.fixed, affine)
    if pinned:
        error.args = (error.args[0] + " The pins are not the cause: without them no plan fits either.",)
    return error


def _fixed_strategy(table: CostTable, affine: AffineModel, uniform: Uniform, mem_limit_bytes: int,
                    pins: PinResolution | None = None) -> SolveResult:
    """A uniform plan (the pinned units as pinned) evaluated in place of a solve, reported in the solver's terms."""
    choices = _uniform_plan(table, uniform, pins)
    result = evaluate(table, choices)
    fits = result.fits(mem_limit_bytes, table.host_limit_bytes)
    stats = (affine.algebra.size, 0, len(affine.mem_const))
    if not fits:
        return SolveResult(SolveStatus.INFEASIBLE, None, None, None, 0.0, *stats)
    return SolveResult(SolveStatus.FIXED, choices, result.step_time_s, result.step_time_s, 0.0, *stats)


def _uniform_plan(table: CostTable, uniform: Uniform, pins: PinResolution | None) -> list[int]:
    """The uniform strategy's choice of each unit of `table`, the pinned units as pinned."""
    choices = uniform_choices(table, uniform.strategy, uniform.checkpoint, exact=True, offload=uniform.offload)
    if choices is None and uniform.offload:
        raise UsageError("`offload` needs a profile that prices the host link (its `host_link`); this one has none")
    if choices is None:
        raise UsageError(f"`strategy` {uniform.strategy} is not available on this cluster (it needs `nodes` 2 or more)")
    return choices if pins is None else pins.overlay(table, choices)


def _uniform_infeasible(request: PlanRequest, cluster: Cluster, table: CostTable) -> InfeasibleError:
    """Why a uniform strategy gives no plan: that plan's own peak and need at the smallest micro-batch tried, not the
    smallest any plan reaches (which the strategy rules out)."""
    limits, uniform = request.limits, request.uniform
    plan = evaluate(table, _uniform_plan(table, uniform, request.pins))
    wanted = limits.fitted_of(plan, table)
    needed = math.ceil(wanted / (1 - limits.headroom))
    what = ", ".join([f"every unit {uniform.strategy}", f"checkpointing {uniform.checkpoint or 'none'}"]
                     + (["offloaded"] if uniform.offload else []) + [f"micro-batch {table.micro_batch_size}"])
    margin = ""
    if limits.fits_needed:
        margin = f"; torch's caching allocator needs {format_bytes(wanted)} to run it (with {limits.allocator_conf})"
        if plan.peak_mem_bytes <= limits.mem_limit_bytes * (1 - limits.headroom):
            margin += ": the live bytes alone would fit, so the allocator's margin is what does not"
    helps = [f"a limit of at least {format_bytes(needed)}",
             "leave out `strategy` (and `checkpoint`, `offload`) for the solver to choose per unit",
             f"more GPUs (sharding divides parameters, gradients and optimizer states over {cluster.mesh.fsdp_ranks} "
             "now)", "a shorter `seq_len`"]
    if request.batch.fixed and table.micro_batch_size > 1:
        helps.insert(1, "a smaller `batch_size`")
    return InfeasibleError(
        f"the uniform plan for {request.model.name} ({what}) does not fit in {format_bytes(limits.mem_limit_bytes)} "
        f"per GPU less {limits.headroom:.0%} headroom: its peak is {format_bytes(plan.peak_mem_bytes)}"
        f"{_peak_state(plan)}{margin}. What would help: " + "; ".join(helps) + ".", min_mem_bytes=needed)


def _peak_state(evaluation: Evaluation) -> str:
    """What a plan holds at its peak, by memory category, as an error says it."""
    parts = evaluation.peak_point.parts
    return (f" (at its peak: parameters, gradients and optimizer states "
            f"{format_bytes(parts['params'] + parts['grads'] + parts['optimizer'])}, activations "
            f"{format_bytes(parts['activations'])}, gathered parameters {format_bytes(parts['gathered'])}, "
            f"temporaries {format_bytes(parts['temporaries'])})")


def _infeasible(table: CostTable, limits: Limits, model_name: str, cluster: Cluster,
                fixed_batch: bool, affine: AffineModel | None = None) -> InfeasibleError:
    mem_limit_bytes, headroom = limits.mem_limit_bytes, limits.headroom
    smallest = solve_min_memory(table, time_limit_s=limits.time_limit_s, affine=affine)
    lean = evaluate(table, smallest.choices) if smallest.choices else None
    peak = lean.peak_mem_bytes if lean is not None else None
    # the limit that leaves the headroom (and, fitting to what the caching allocator needs, its margin)
    wanted = limits.fitted_of(lean, table) if lean is not None else None
    needed = math.ceil(wanted / (1 - headroom)) if peak is not None else None
    state = _peak_state(lean) if lean is not None else ""
    helps = [f"a limit of at least {format_bytes(needed)}" if needed else "a larger limit",
             f"more GPUs (sharding divides parameters, gradients and optimizer states over {cluster.mesh.fsdp_ranks} "
             "now)", "a shorter `seq_len`", "`dtype` bf16 (no fp32 master weights)"]
    if fixed_batch and table.micro_batch_size > 1:
        helps.insert(1, "a smaller `batch_size`")
    margin = ""
    if peak is not None and limits.fits_needed:
        margin = (f"; torch's caching allocator needs {format_bytes(wanted)} to run it (with "
                  f"{limits.allocator_conf})")
        if peak <= mem_limit_bytes * (1 - headroom):
            margin += (": the live bytes alone would fit, so the allocator's margin is what does not (`fit_to` "
                       "allocated plans to the live bytes alone, at the risk of running out on the GPU)")
    return InfeasibleError(
        f"no plan for {model_name} fits in {format_bytes(mem_limit_bytes)} per GPU less {headroom:.0%} headroom: the "
        f"smallest peak any plan reaches (sharding, checkpointing and offload where they help, micro-batch "
        f"{table.micro_batch_size}) is {format_bytes(peak) if peak else 'unknown'}{state}{margin}. What would help: "
        + "; ".join(helps) + ".",
        min_mem_bytes=needed,
    )
