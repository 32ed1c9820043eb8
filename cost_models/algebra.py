"""The algebra the cost formulas are written in. `NumericAlgebra` evaluates a fixed choice of one
option per unit; the solver's CP-SAT algebra builds the same formulas as linear constraints."""

from __future__ import annotations

from typing import Protocol, Sequence


class Algebra(Protocol):
    def pick(self, unit: int, values: Sequence[int]) -> object:
        """Bytes: values[o] for the option o chosen for `unit`."""

    def pick_time(self, unit: int, values: Sequence[float]) -> object:
        """Seconds: values[o] for the option chosen for `unit`."""

    def define(self, expr: object, name: str) -> object:
        """Name an expression that many constraints share (a solver makes it one variable)."""

    def maximum(self, exprs: Sequence[object], name: str) -> object:
        """max(exprs), for times (a solver adds t >= each)."""


class NumericAlgebra:
    def __init__(self, choices: Sequence[int]):
        self.choices = list(choices)

    def pick(self, unit: int, values: Sequence[int]) -> int:
        return values[self.choices[unit]]

    def pick_time(self, unit: int, values: Sequence[float]) -> float:
        return values[self.choices[unit]]

    def define(self, expr, name: str):
        return expr

    def maximum(self, exprs, name: str):
        return max(exprs)
