"""The algebra the cost formulas are written in. `NumericAlgebra` evaluates a fixed choice of one
option per unit; the solver's CP-SAT algebra builds the same formulas as linear constraints."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Algebra(Protocol):
    def pick(self, unit: int, values: Sequence[int]) -> object:
        """Bytes: values[o] for the option o chosen for `unit`."""

    def pick_time(self, unit: int, values: Sequence[float]) -> object:
        """Seconds: values[o] for the option chosen for `unit`."""

    def define(self, expr: object, name: str) -> object:
        """Name an expression that many constraints share (a solver makes it one variable)."""


class NumericAlgebra:
    def __init__(self, choices: Sequence[int]):
        self.choices = list(choices)

    def pick(self, unit: int, values: Sequence[int]) -> int:
        return values[self.choices[unit]]

    def pick_time(self, unit: int, values: Sequence[float]) -> float:
        return values[self.choices[unit]]

    def define(self, expr, name: str):
        return expr


class Affine:
    """c + sum_l coef[l] * x[l] over the one-hot option literals x (unit u's options are a slice)."""

    __slots__ = ("coef", "const")

    def __init__(self, coef: np.ndarray, const: float = 0):
        self.coef, self.const = coef, const

    def __add__(self, other):
        if isinstance(other, Affine):
            return Affine(self.coef + other.coef, self.const + other.const)
        return Affine(self.coef, self.const + other)

    __radd__ = __add__

    def __mul__(self, scale):
        return Affine(self.coef * scale, self.const * scale)

    __rmul__ = __mul__


class AffineAlgebra:
    """The cost formulas as affine functions of the option literals: one row per memory point and
    one for the step time, for the solver's constraints and for fast evaluation of many plans."""

    def __init__(self, options_per_unit: Sequence[int]):
        self.offsets = np.concatenate([[0], np.cumsum(options_per_unit)]).astype(int)
        self.size = int(self.offsets[-1])

    def _row(self, unit: int, values: Sequence, dtype) -> Affine:
        coef = np.zeros(self.size, dtype=dtype)
        coef[self.offsets[unit]:self.offsets[unit + 1]] = values
        return Affine(coef)

    def pick(self, unit: int, values: Sequence[int]) -> Affine:
        return self._row(unit, values, np.int64)

    def pick_time(self, unit: int, values: Sequence[float]) -> Affine:
        return self._row(unit, values, np.float64)

    def define(self, expr, name: str):
        return expr

    def literals(self, choices: Sequence[int]) -> np.ndarray:
        """The 0/1 literal vector of a plan (one option index per unit)."""
        x = np.zeros(self.size, dtype=np.int64)
        x[self.offsets[:-1] + np.asarray(choices, dtype=int)] = 1
        return x
