"""CP-SAT model: one option per unit, memory under the limit at every time point, minimum step time.

The memory and time formulas live in cost_models (memory.timeline, step.step_time) and are shared
with the evaluator; here they are taken as affine rows over the one-hot option literals:
    memory(point p) = c_p + sum_l A[p, l] x_l        step time = sum_l t_l x_l
    host memory (offloaded state, per rank) = sum_l h_l x_l
Memory constraints are added lazily: most of a step's time points never bind, so the model starts
with the peaks of a few reference plans, and each solution is checked against every point; a point
it violates is added and the model solved again. The final plan satisfies every constraint and is
optimal for the full model (an optimum of a relaxation that is feasible for the full model).

Identical units (a model's repeated blocks) make the model highly symmetric: any permutation of
their options gives the same step time and nearly the same memory, and CP-SAT can spend its whole
time limit proving that. Such a group of units takes its options in a canonical order,
leanest (least activation and kept-gathered memory) first: those bytes are held from a unit's forward
to its backward, so at every time point between two of them the earlier one's are held too, and a
checkpointed unit's own backward (its recomputation) costs more with more held before it: swapping
a leaner option to the earlier of two identical units never raises a time point (an exchange
argument, adjacent or not); parameters, gradients, optimizer and host state do not depend on the
position.

A table with such runs is solved as counts (autoplan.solve.counts: per run, where each option's segment of the
canonical order ends), with the same plans and optimum as the per-unit model, to a proven optimum; a table without
runs keeps the per-unit model (autoplan.solve.unit_model). Its rows are built sparse above DENSE_LIMIT time points
x literals (autoplan.solve.rows): the prefix sums they share are then integer variables of their own, CP-SAT's
probing and substitutions, quadratic there, are off, and the first round starts from a seed plan that fits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from autoplan.settings import DEFAULT_TIME_LIMIT_S
from autoplan.solve.counts import COUNTS_GAP_LIMIT, CountsModel, counted
from autoplan.solve.rows import MemoryRows, table_rows
from autoplan.solve.symmetry import canonical, identical_runs
from autoplan.solve.unit_model import UnitModel
from cost_models.algebra import AffineAlgebra, SparseAlgebra
from cost_models.step import step_time
from cost_models.table import CostTable

NS_PER_S = 1_000_000_000
# Solver settings in one place. One worker keeps the search deterministic: the same inputs give
# the same plan, byte for byte.
NUM_WORKERS = 1
POINTS_ADDED_PER_ROUND = 4
# `time_limit_s` is CP-SAT's deterministic time (about a second of an idle core), so a plan never depends on how busy
# the machine is; the clock stops a solve only at this many times it, a safety net
WALL_SAFETY = 10
# The per-unit model stops once the plan is proven within 0.1% of the optimum: far below the cost model's own error,
# and it spares the search from proving optimality across many identical blocks (CP-SAT sees them
# as an orbitope it cannot break). The gap (objective - bound) is reported with every plan.
RELATIVE_GAP_LIMIT = 1e-3
# No cuts for the counts model (solved to a proven optimum: the same optimum): on its few dozen counts and kinks the
# ~1000 cuts CP-SAT adds by default cost more LP time than they save (405B-class solves 2-3x faster without; RESULTS 3)
COUNTS_CUT_LEVEL = 0

__all__ = ["SolveStatus", "SolveResult", "AffineModel", "solve_min_time", "solve_min_memory", "DEFAULT_TIME_LIMIT_S",
           "cp_sat"]


# A str Enum: a status equals, hashes, prints and is written to plan files as its value ("OPTIMAL", ...:
# CP-SAT's own status names, plus the sweep's FIXED and PRUNED).
class SolveStatus(str, Enum):
    """The solver's verdict at one micro-batch: OPTIMAL (proven, within the relative gap limit), FEASIBLE
    (a plan; the time limit ran out before it was proven optimal), INFEASIBLE (proven: no plan fits),
    UNKNOWN (the time limit ran out before any verdict), FIXED (no solve: a uniform strategy, evaluated),
    PRUNED (no solve: this micro-batch cannot beat the best plan found even with no memory limit)."""

    OPTIMAL = "OPTIMAL"
    FEASIBLE = "FEASIBLE"
    INFEASIBLE = "INFEASIBLE"
    UNKNOWN = "UNKNOWN"
    FIXED = "FIXED"  # the sweep's `strategy`
    PRUNED = "PRUNED"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass
class SolveResult:
    status: SolveStatus  # OPTIMAL | FEASIBLE (time limit hit) | INFEASIBLE | UNKNOWN
    choices: list[int] | None
    objective: float | None  # seconds (min time) or bytes (min memory)
    bound: float | None  # best proven bound, same unit
    wall_time_s: float
    num_variables: int
    num_constraints: int  # memory points in the final model (of `num_points`)
    num_points: int


@dataclass
class AffineModel:
    """The cost model of one table as matrices: memory rows per time point and a step-time row."""

    algebra: AffineAlgebra
    rows: MemoryRows  # memory per time point, bytes (autoplan.solve.rows)
    step_coef_ns: np.ndarray  # [literals], integer nanoseconds
    step_const_ns: int
    host_coef: np.ndarray | None = None  # [literals], bytes of offloaded state per rank (None: no offload)
    host_limit_bytes: int | None = None  # per rank: the node's host memory over its GPUs
    # groups of identical units, and per unit the rank of each option in the canonical order
    runs: list[list[int]] | None = None
    order: list[list[int]] | None = None
    counted: bool = False  # solved as counts per run (autoplan.solve.counts), not per unit

    @classmethod
    def of(cls, table: CostTable, memory: tuple | None = None) -> "AffineModel":
        """The table's model; `memory`: its `rows.table_rows`, where the caller has them."""
        alg, rows, _ = memory or table_rows(table)
        step = step_time(table, alg).step_s
        step_coef, step_const = alg.dense(step) if isinstance(alg, SparseAlgebra) else step.coef, step.const
        host = np.array([cost.host_bytes for costs in table.costs for cost in costs], dtype=np.int64)
        offloads = table.host_limit_bytes is not None and bool(host.any())
        runs, order = identical_runs(table)
        return cls(
            alg, rows, np.round(step_coef * NS_PER_S).astype(np.int64), int(round(step_const * NS_PER_S)),
            host if offloads else None, table.host_limit_bytes if offloads else None, runs, order,
            counted(runs))

    @property
    def mem_const(self) -> np.ndarray:
        return self.rows.const

    def mem_row(self, point: int) -> np.ndarray:
        """The point's memory coefficients over the literals (bytes)."""
        return self.rows.row(point)

    def memory(self, choices) -> np.ndarray:
        return self.rows.memory_of(self.algebra.offsets[:-1] + np.asarray(choices, dtype=int))

    def step_s(self, choices: list[int]) -> float:
        return (int(self.step_coef_ns @ self.algebra.literals(choices)) + self.step_const_ns) / NS_PER_S

    def unconstrained_fastest(self) -> list[int]:
        offsets = self.algebra.offsets
        return [int(np.argmin(self.step_coef_ns[offsets[u]:offsets[u + 1]])) for u in range(len(offsets) - 1)]

    def leanest_each(self) -> list[int]:
        """Per unit, the option with the smallest total memory coefficient (a rough min-memory plan; may
        overrun the host limit, which the model enforces: a seed only picks the first points)."""
        weight = self.rows.column_max()
        offsets = self.algebra.offsets
        return [int(np.argmin(weight[offsets[u]:offsets[u + 1]])) for u in range(len(offsets) - 1)]


cp_model = None  # ortools' CP-SAT, imported at the first solve (`cp_sat`)


def cp_sat():
    """CP-SAT, imported when a model is first built: explain, diff and estimate cost plans without solving, and
    ortools (with the pandas it imports) is a fifth of their start-up."""
    global cp_model
    if cp_model is None:
        from ortools.sat.python import cp_model as imported

        cp_model = imported
    return cp_model


def _solve_lazily(affine: AffineModel, build, check, time_limit_s: float, seeds: list[list[int]],
                  hint: list[int] | None = None, work_limit: float | None = None) -> SolveResult:
    """Solve, check the solution against every point, add violated points, repeat. `hint`: a plan known to satisfy
    every constraint, to start the first round from. `time_limit_s` (`work_limit`: a shorter budget): CP-SAT's
    deterministic time over all rounds, so the answer does not depend on the machine's load (WALL_SAFETY)."""
    start = time.perf_counter()
    work, work_limit = 0.0, time_limit_s if work_limit is None else min(work_limit, time_limit_s)
    active: set[int] = set()
    for seed in seeds:
        active.update(int(p) for p in np.argsort(-affine.memory(seed), kind="stable")[:2])  # its top 2 points
    while True:
        model, objective_scale = build(sorted(active))
        if hint is not None:  # start from the last round's plan (it violates only the new points) or the given one
            model.hint(hint)
        solver = cp_sat().CpSolver()
        solver.parameters.max_time_in_seconds = max(0.01, WALL_SAFETY * time_limit_s - (time.perf_counter() - start))
        solver.parameters.max_deterministic_time = max(0.001, work_limit - work)
        solver.parameters.num_workers = NUM_WORKERS
        solver.parameters.relative_gap_limit = COUNTS_GAP_LIMIT if affine.counted else RELATIVE_GAP_LIMIT
        solver.parameters.cut_level = COUNTS_CUT_LEVEL if affine.counted else solver.parameters.cut_level
        if not affine.rows.dense and not affine.counted:  # thousands of units: probing, substitutions quadratic
            solver.parameters.cp_model_probing_level = 0
            solver.parameters.presolve_substitution_level = 0
        status = solver.solve(model.model)
        wall = time.perf_counter() - start
        work += solver.response_proto.deterministic_time
        if status == cp_model.MODEL_INVALID:  # a bug in this module, not the user's input
            raise RuntimeError(f"CP-SAT refused the model: {model.model.validate()}")
        name = SolveStatus(solver.status_name(status))
        stats = (len(model.x), len(model.points), len(affine.mem_const))
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return SolveResult(name, None, None, None, wall, *stats)
        choices = model.choices(solver)
        violated = check(choices, solver)
        new_points = [p for p in violated if p not in active][:POINTS_ADDED_PER_ROUND]
        if not new_points:
            return SolveResult(name, choices, solver.objective_value / objective_scale,
                               solver.best_objective_bound / objective_scale, wall, *stats)
        if work >= work_limit or wall >= WALL_SAFETY * time_limit_s:
            return SolveResult(SolveStatus.UNKNOWN, None, None, None, wall, *stats)
        active.update(new_points)
        hint = choices


def solve_min_time(table: CostTable, mem_limit_bytes: int, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                   affine: AffineModel | None = None) -> SolveResult:
    """[Objective] minimise the step time subject to memory(p) <= mem_limit_bytes at every point p."""
    affine = affine or AffineModel.of(table)

    def build(points):
        model = (CountsModel if affine.counted else UnitModel)(affine, cp_sat())  # solve/counts.py, unit_model.py
        for point in points:
            model.add_point(point, mem_limit_bytes)
        model.model.minimize(model.step_ns())
        return model, NS_PER_S

    def check(choices, solver):
        memory = affine.memory(choices)
        return [p for p in np.argsort(-memory, kind="stable") if memory[p] > mem_limit_bytes]

    seeds = [affine.unconstrained_fastest(), affine.leanest_each()]
    fitting = _fitting(affine, seeds, mem_limit_bytes)
    result = _solve_lazily(affine, build, check, time_limit_s, seeds, hint=fitting)
    if result.status == SolveStatus.UNKNOWN and fitting is not None:  # no better plan in time: the seed, which fits
        # bound: no plan is faster than each unit's fastest option
        result = replace(result, status=SolveStatus.FEASIBLE, choices=fitting, objective=affine.step_s(fitting),
                         bound=affine.step_s(affine.unconstrained_fastest()))
    return result


def _fitting(affine: AffineModel, seeds: list[list[int]], mem_limit_bytes: int) -> list[int] | None:
    """For a sparse model (thousands of units), the first seed that fits, as a hint: there CP-SAT may spend its
    whole time limit before it finds a first plan by itself (1000 layers of a tiny Llama). Dense models take
    no hint, as they always did: their plans stay the ones they were."""
    if affine.rows.dense:
        return None
    for seed in (canonical(seed, affine.runs, affine.order) for seed in seeds):
        host_fits = affine.host_coef is None or int(affine.host_coef @ affine.algebra.literals(seed)) <= \
            affine.host_limit_bytes
        if host_fits and affine.memory(seed).max() <= mem_limit_bytes:
            return seed
    return None


def solve_min_memory(table: CostTable, time_limit_s: float = DEFAULT_TIME_LIMIT_S, max_step_s: float | None = None,
                     mem_limit_bytes: int | None = None, affine: AffineModel | None = None,
                     start_from: list[int] | None = None, work_limit: float | None = None) -> SolveResult:
    """[Objective] minimise the peak memory (the smallest limit any plan fits in), optionally among
    plans no slower than `max_step_s`: the tie-break that keeps memory headroom at no cost in time.
    `start_from` is a plan meeting both (the fastest plan found), given to CP-SAT as a hint. It helps on
    some models; on others (405B at micro-batch 2) CP-SAT still spends its whole limit on this solve,
    so the search gives it a short budget (`work_limit`, deterministic: see _solve_lazily)."""
    affine = affine or AffineModel.of(table)
    horizon = affine.rows.horizon()
    state = {}

    def build(points):
        model = (CountsModel if affine.counted else UnitModel)(affine, cp_sat())  # solve/counts.py, unit_model.py
        peak = model.model.new_int_var(0, mem_limit_bytes if mem_limit_bytes is not None else horizon, "peak")
        for point in points:
            model.add_point(point, peak)
        if max_step_s is not None:
            # [Constraint] step time <= the optimum found (rounded up to the next ns)
            model.model.add(model.step_ns() <= math.ceil(max_step_s * NS_PER_S))
        model.model.minimize(peak)
        if start_from is not None:  # complete the hint: CP-SAT follows a partial one poorly
            model.model.add_hint(peak, int(affine.memory(start_from).max()))
        state["peak"] = peak
        return model, 1

    def check(choices, solver):
        memory = affine.memory(choices)
        peak = solver.value(state["peak"])
        return [p for p in np.argsort(-memory, kind="stable") if memory[p] > peak]

    seeds = [affine.leanest_each()] if max_step_s is None else [affine.leanest_each(), affine.unconstrained_fastest()]
    return _solve_lazily(affine, build, check, time_limit_s, seeds, hint=start_from, work_limit=work_limit)
