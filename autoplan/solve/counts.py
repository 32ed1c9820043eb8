"""The CP-SAT model of a table with runs of identical units solved as counts: per run, how many of its units take
each option, not one Boolean per unit and option.

A run of identical units takes its options in the canonical order, leanest first (autoplan.solve.solver's
docstring says why no plan is lost). A run's plan is then fixed by where each option's segment ends: with the
run's options ranked o_0 (leanest) .. o_{J-1} and C_k the number of its units taking o_0 .. o_k, its i-th unit
(in execution order) takes o_k for C_{k-1} <= i < C_k (C_{-1} = 0, C_{J-1} = n). The per-unit model needs n x J
Booleans and n - 1 order constraints per run, which is what CP-SAT's presolve chews on for a stack of thousands
of layers; this model needs J - 1 integers per run.

Every row (a memory point, the step time, the host bytes) stays exact. Over the run's units a row's part is
    sum_k sum_{C_{k-1} <= i < C_k} a[i, k]        (a[i, k]: the row's coefficient of unit i's option o_k)
  = sum_k F_k(C_k) - F_k(C_{k-1}),   F_k(C) = sum_{i < C} a[i, k]
  = F_{J-1}(n) + sum_{k < J-1} G_k(C_k),   G_k(C) = sum_{i < C} D_k[i],   D_k = a[., k] - a[., k+1]
and G_k, a sum over a prefix, is piecewise linear in C with a kink wherever D_k changes along the run:
    G_k(C) = D_k[0] C + sum_{b : D_k[b] != D_k[b-1]} (D_k[b] - D_k[b-1]) max(0, C - b).
Identical units have the same coefficients except near the unit a point belongs to (its own backward, the
unit gathered before it, the reduction pending beside it), so each row has a few kinks, and each kink
max(0, C_k - b) is one integer variable shared by every row that has it.

Both models have the same plans (the canonical ones) and so the same optimum. This one is small enough (gpt2-1.5b:
21 variables where the per-unit model has 868) to be solved to a proven optimum (COUNTS_GAP_LIMIT 0, not the
per-unit model's 0.1%) in less time than the per-unit model takes to come within 0.1%, so its plan is the fastest
there is; where several plans are exactly as fast (and, after the tie-break, as lean), which one CP-SAT returns
may differ from the per-unit model's. A table without runs keeps the per-unit model (autoplan.solve.solver).
"""

from __future__ import annotations

import numpy as np

from autoplan.solve.unit_model import lean_cp_model

__all__ = ["COUNTS", "COUNTS_GAP_LIMIT", "CountsModel", "counted"]

COUNTS = True  # tables with runs of identical units solved as counts (False: per unit, as before this module)
COUNTS_GAP_LIMIT = 0.0  # CP-SAT's relative gap limit for this model: solved to a proven optimum


def counted(runs: list[list[int]] | None) -> bool:
    """Whether a table with these runs of identical units (autoplan.solve.symmetry.identical_runs) is solved as
    counts."""
    return COUNTS and bool(runs)


class CountsModel:
    """A CP-SAT model over the option literals of units outside the runs and the segment ends C of each run (the
    interface of autoplan.solve.solver's per-unit model: expr, add_point, step_ns, hint, choices)."""

    def __init__(self, affine, cp_model):
        self.affine, self.cp = affine, cp_model
        self.model = lean_cp_model(cp_model)
        offsets = affine.algebra.offsets
        in_run = {u for run in affine.runs for u in run}
        # [Variables] x[l] = 1 iff the option of literal l is chosen, for units outside the runs
        self.free = [u for u in range(len(offsets) - 1) if u not in in_run]
        self.lits = {}
        for unit in self.free:
            unit_lits = [self.model.new_bool_var(f"x_{l}") for l in range(offsets[unit], offsets[unit + 1])]
            self.lits.update(zip(range(offsets[unit], offsets[unit + 1]), unit_lits))
            # [Constraint] exactly one option per unit
            self.model.add_exactly_one(unit_lits)
        # per run, its units' literals in canonical order: ranked[r][i, k] is unit i's literal of option o_k
        self.ranked, self.ends = [], []
        for r, run in enumerate(affine.runs):
            order = np.argsort(affine.order[run[0]], kind="stable")  # options by rank, leanest first
            self.ranked.append(offsets[np.asarray(run)][:, None] + order[None, :])
            # [Variables] C[r][k] = the number of the run's units taking options o_0 .. o_k (k < J - 1)
            ends = [self.model.new_int_var(0, len(run), f"c_{r}_{k}") for k in range(len(order) - 1)]
            for a, b in zip(ends, ends[1:]):
                # [Constraint] segments in canonical order: C[r][k] <= C[r][k+1] (C[r][J-1] = n)
                self.model.add(a <= b)
            self.ends.append(ends)
        self.x = list(self.lits.values()) + [c for ends in self.ends for c in ends]
        self.kinks: dict[tuple[int, int, int], object] = {}  # (run, k, b) -> max(0, C[r][k] - b)
        self.points: list[int] = []
        if affine.host_coef is not None:
            # [Constraint] offloaded state of the node's ranks fits its host memory (solver.py's per-unit form)
            self.model.add(self.expr(affine.host_coef, 0) <= affine.host_limit_bytes)

    def expr(self, coef: np.ndarray, const: int):
        """The row sum_l coef[l] x[l] + const over the counts: the free units' literals, each run's constant
        F_{J-1}(n) and its G_k(C_k) (the module docstring)."""
        cp = self.cp
        free = [l for l in self.lits if coef[l]]
        variables, weights = [self.lits[l] for l in free], [int(coef[l]) for l in free]
        for r, ranked in enumerate(self.ranked):
            a = coef[ranked]  # [units of the run, options in canonical order]
            const += int(a[:, -1].sum())
            d = a[:, :-1] - a[:, 1:]  # D_k along the run, one column per k
            ks, bs = np.nonzero(np.diff(d, axis=0).T)  # its kinks, by k, then by where along the run
            steps = (d[bs + 1, ks] - d[bs, ks]).tolist()
            kinks = np.searchsorted(ks, np.arange(len(self.ends[r]) + 1)).tolist()  # each k's kinks: a slice
            ks, bs, firsts = ks.tolist(), (bs + 1).tolist(), d[0].tolist()
            for k, end in enumerate(self.ends[r]):
                if firsts[k]:
                    variables.append(end)
                    weights.append(firsts[k])
                for i in range(kinks[k], kinks[k + 1]):
                    variables.append(self._kink(r, k, bs[i]))
                    weights.append(steps[i])
        return cp.LinearExpr.weighted_sum(variables, weights) + const

    def _kink(self, r: int, k: int, b: int):
        """[Variables] h = max(0, C[r][k] - b), made at its first use."""
        key = (r, k, b)
        if key not in self.kinks:
            h = self.model.new_int_var(0, len(self.affine.runs[r]) - b, f"h_{r}_{k}_{b}")
            # [Constraint] h = max(0, C[r][k] - b)
            self.model.add_max_equality(h, [0, self.ends[r][k] - b])
            self.kinks[key] = h
        return self.kinks[key]

    def add_point(self, point: int, bound) -> None:
        # [Constraint] memory(point) <= bound  (the limit, or the peak variable)
        rows = self.affine.rows
        self.model.add(self.expr(rows.row(point), int(rows.const[point])) <= bound)
        self.points.append(point)

    def step_ns(self):
        return self.expr(self.affine.step_coef_ns, self.affine.step_const_ns)

    def hint(self, choices: list[int]) -> None:
        """Every variable hinted (CP-SAT follows a partial hint poorly): the literals, each run's segment ends for
        `choices` put in the canonical order, the kinks from them."""
        offsets = self.affine.algebra.offsets
        for l, variable in self.lits.items():
            unit = int(np.searchsorted(offsets, l, side="right")) - 1
            self.model.add_hint(variable, int(l - offsets[unit] == choices[unit]))
        values = {}
        for r, run in enumerate(self.affine.runs):
            ranks = np.asarray(self.affine.order[run[0]])[[choices[u] for u in run]]
            for k, end in enumerate(self.ends[r]):
                values[(r, k)] = int((ranks <= k).sum())
                self.model.add_hint(end, values[(r, k)])
        for (r, k, b), h in self.kinks.items():
            self.model.add_hint(h, max(0, values[(r, k)] - b))

    def choices(self, solver) -> list[int]:
        """Per unit, its option: the free units' from their literals, a run's from its segment ends."""
        offsets = self.affine.algebra.offsets
        out = [0] * (len(offsets) - 1)
        for unit in self.free:
            values = [solver.value(self.lits[l]) for l in range(offsets[unit], offsets[unit + 1])]
            out[unit] = int(np.argmax(values))
        for r, run in enumerate(self.affine.runs):
            ends = [solver.value(end) for end in self.ends[r]] + [len(run)]
            k = 0
            for i, unit in enumerate(run):
                while i >= ends[k]:
                    k += 1
                out[unit] = int(self.ranked[r][i, k] - offsets[unit])
        return out
