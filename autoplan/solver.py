"""CP-SAT model: one option per unit, memory under the limit at every time point, minimum step time.

Variables, constraints and objective are built separately; the formulas themselves live in
cost_models (memory.timeline, step.step_time) and are shared with the evaluator, so the solver's
objective is exactly the cost model's prediction for the plan it returns (up to the 1 ns rounding).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from cost_models.memory import CATEGORIES, timeline
from cost_models.step import step_time
from cost_models.table import CostTable

NS_PER_S = 1_000_000_000
# Solver settings in one place. One worker keeps the search deterministic: the same inputs give
# the same plan, byte for byte.
DEFAULT_TIME_LIMIT_S = 10.0
NUM_WORKERS = 1


@dataclass
class SolveResult:
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    choices: list[int] | None
    objective_s: float | None
    bound_s: float | None
    wall_time_s: float
    num_variables: int
    num_constraints: int


class _CpSatAlgebra:
    """Builds the cost formulas as CP-SAT linear expressions over the option variables."""

    def __init__(self, model: cp_model.CpModel, choose: list[list[cp_model.IntVar]], horizon: int):
        self.model = model
        self.choose = choose
        self.horizon = horizon

    def _linear(self, unit: int, values: Sequence[int]):
        base = min(values)
        expr = base
        for var, value in zip(self.choose[unit], values):
            if value != base:
                expr = expr + (value - base) * var
        return expr

    def pick(self, unit: int, values: Sequence[int]):
        return self._linear(unit, [int(v) for v in values])

    def pick_time(self, unit: int, values: Sequence[float]):
        return self._linear(unit, [round(v * NS_PER_S) for v in values])

    def define(self, expr, name: str):
        if isinstance(expr, int):
            return expr
        var = self.model.new_int_var(0, self.horizon, name)
        self.model.add(var == expr)
        return var

    def maximum(self, exprs, name: str):
        if all(isinstance(e, int) for e in exprs):
            return max(exprs)
        var = self.model.new_int_var(0, self.horizon, name)
        for expr in exprs:
            # [Constraint] t >= expr  (linearises t = max(compute, communication))
            self.model.add(var >= expr)
        return var


def _build(table: CostTable, mem_limit_bytes: int | None):
    model = cp_model.CpModel()
    # [Variables] choose[u][o] = 1 iff unit u takes option o
    choose = [
        [model.new_bool_var(f"x_{u}_{o}") for o in range(len(options))]
        for u, options in enumerate(table.options)
    ]
    for u, row in enumerate(choose):
        # [Constraint] exactly one option per unit
        model.add_exactly_one(row)
    horizon = 2**50  # bytes or ns: 1 PB, 13 days; sums stay far from int64 overflow
    alg = _CpSatAlgebra(model, choose, horizon)
    points = timeline(table, alg)
    peak = model.new_int_var(0, horizon, "peak_mem_bytes")
    for point in points:
        point_total = sum((point.parts[c] for c in CATEGORIES), 0)
        # [Constraint] memory(point) <= peak <= limit, at every time point of the step
        model.add(point_total <= peak)
    if mem_limit_bytes is not None:
        model.add(peak <= mem_limit_bytes)
    step = step_time(table, alg)
    return model, choose, step.step_s, peak


def _run(model: cp_model.CpModel, time_limit_s: float) -> tuple[cp_model.CpSolver, int, float]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = NUM_WORKERS
    start = time.perf_counter()
    status = solver.solve(model)
    return solver, status, time.perf_counter() - start


def _result(table, model, choose, solver, status, wall, scale) -> SolveResult:
    stats = model.proto
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(name, None, None, None, wall, len(stats.variables), len(stats.constraints))
    choices = [next(o for o, var in enumerate(row) if solver.value(var)) for row in choose]
    return SolveResult(
        name, choices, solver.objective_value / scale, solver.best_objective_bound / scale, wall,
        len(stats.variables), len(stats.constraints),
    )


def solve_min_time(table: CostTable, mem_limit_bytes: int, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> SolveResult:
    """[Objective] minimise the step time subject to peak memory <= mem_limit_bytes."""
    model, choose, step_s, _peak = _build(table, mem_limit_bytes)
    model.minimize(step_s)
    solver, status, wall = _run(model, time_limit_s)
    return _result(table, model, choose, solver, status, wall, NS_PER_S)


def solve_min_memory(
    table: CostTable,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_step_s: float | None = None,
    mem_limit_bytes: int | None = None,
) -> SolveResult:
    """[Objective] minimise the peak memory (the smallest limit any plan fits in), optionally among
    plans no slower than `max_step_s`: the tie-break that keeps memory headroom at no cost in time."""
    model, choose, step_s, peak = _build(table, mem_limit_bytes)
    if max_step_s is not None:
        # [Constraint] step time <= the optimum found (rounded up to the next ns)
        model.add(step_s <= math.ceil(max_step_s * NS_PER_S))
    model.minimize(peak)
    solver, status, wall = _run(model, time_limit_s)
    return _result(table, model, choose, solver, status, wall, 1)
