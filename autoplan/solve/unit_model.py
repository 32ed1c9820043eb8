"""The per-unit CP-SAT model (autoplan.solve.solver's docstring gives its variables, constraints and objective),
and the CP-SAT model both it and the counts model (autoplan.solve.counts) are built on.

A solve rebuilds its model at every round of its lazily added memory points, and the search solves hundreds of
tables: ortools' `CpModel()` spends about half a millisecond per model binding a deprecated CamelCase alias of each
of its methods to the instance (`_add_pre_pep8_methods`), which nothing here calls. `lean_cp_model` makes the same
model without them: the same protocol buffer is solved, so the same plans."""

from __future__ import annotations

import numpy as np

__all__ = ["UnitModel", "lean_cp_model"]

_LEAN: dict[type, type] = {}  # ortools' CpModel -> its subclass without the deprecated aliases


def lean_cp_model(cp_model):
    """An empty `cp_model.CpModel` without the deprecated CamelCase aliases of its methods (the module docstring)."""
    base = cp_model.CpModel
    if base not in _LEAN:
        _LEAN[base] = type("LeanCpModel", (base,), {"_add_pre_pep8_methods": lambda self: None})
    return _LEAN[base]()


class UnitModel:
    """The per-unit model of a table without runs of identical units (or with, where the counts are off): one
    Boolean per unit and option (the interface autoplan.solve.counts.CountsModel shares: expr, add_point, step_ns,
    hint, choices)."""

    def __init__(self, affine, cp_model):
        self.affine, self.cp = affine, cp_model
        self.model = lean_cp_model(cp_model)
        offsets = affine.algebra.offsets
        # [Variables] x[l] = 1 iff the option of literal l is chosen for its unit
        self.x = [self.model.new_bool_var(f"x_{l}") for l in range(affine.algebra.size)]
        for unit in range(len(offsets) - 1):
            # [Constraint] exactly one option per unit
            self.model.add_exactly_one(self.x[offsets[unit]:offsets[unit + 1]])
        for run in affine.runs or []:
            for a, b in zip(run, run[1:]):
                # [Constraint] identical units take options in the canonical order, in execution order:
                #   rank(option of a) <= rank(option of b), with rank(u) = sum_i rank_i x[u, i]
                ranks_a, ranks_b = affine.order[a], affine.order[b]
                self.model.add(
                    self.cp.LinearExpr.weighted_sum(self.x[offsets[a]:offsets[a + 1]], ranks_a)
                    <= self.cp.LinearExpr.weighted_sum(self.x[offsets[b]:offsets[b + 1]], ranks_b))
        if affine.host_coef is not None:
            # [Constraint] offloaded state of the node's ranks fits its host memory:
            #   gpus_per_node * sum_l h_l x_l <= host_mem   (per rank: <= host_mem // gpus_per_node)
            self.model.add(self.expr(affine.host_coef, 0) <= affine.host_limit_bytes)
        self.points: list[int] = []
        self.sums: list | None = None

    def expr(self, coef: np.ndarray, const: int):
        nonzero = np.flatnonzero(coef)
        return self.cp.LinearExpr.weighted_sum([self.x[i] for i in nonzero], [int(coef[i]) for i in nonzero]) + const

    def add_point(self, point: int, bound) -> None:
        # [Constraint] memory(point) <= bound  (the limit, or the peak variable)
        rows = self.affine.rows
        if rows.dense:
            self.model.add(self.expr(rows.row(point), int(rows.const[point])) <= bound)
        else:
            self.model.add(self._sparse(*rows.terms(point)) + int(rows.const[point]) <= bound)
        self.points.append(point)

    def _sparse(self, literals, sums):
        """A row's own terms, its named sums as variables (made at the first use: `_sums`)."""
        if self.sums is None:
            self.sums = self._sum_variables()
        variables = [self.x[col] for col, _ in literals] + [self.sums[k] for k, _ in sums]
        return self.cp.LinearExpr.weighted_sum(variables, [c for _, c in literals] + [c for _, c in sums])

    def _sum_variables(self) -> list:
        """[Variables] s[k] = named sum k (a prefix sum of bytes over units or segments), above DENSE_LIMIT: each
        memory row is then a few terms, not one per literal, and the model grows linearly with the units."""
        rows, sums = self.affine.rows, []
        for k, bound in enumerate(rows.sum_bounds().tolist()):
            literals, refs = rows.definition(k)
            sums.append(self.model.new_int_var(-bound, bound, f"s_{k}"))
            # [Constraint] s[k] = sum of its literals' and earlier sums' terms
            variables = [self.x[col] for col, _ in literals] + [sums[j] for j, _ in refs]
            self.model.add(sums[k] == self.cp.LinearExpr.weighted_sum(
                variables, [c for _, c in literals] + [c for _, c in refs]))
        return sums

    def step_ns(self):
        return self.expr(self.affine.step_coef_ns, self.affine.step_const_ns)

    def hint(self, choices: list[int]) -> None:
        x = self.affine.algebra.literals(choices)
        for literal, value in zip(self.x, x):
            self.model.add_hint(literal, int(value))
        if self.sums:  # a complete hint: CP-SAT follows a partial one poorly
            for variable, value in zip(self.sums, self.affine.rows.sum_values(x).tolist()):
                self.model.add_hint(variable, value)

    def choices(self, solver) -> list[int]:
        offsets = self.affine.algebra.offsets
        values = [solver.value(v) for v in self.x]
        return [int(np.argmax(values[offsets[u]:offsets[u + 1]])) for u in range(len(offsets) - 1)]
