"""The algebra the cost formulas are written in. `NumericAlgebra` evaluates a fixed choice of one
option per unit; `AffineAlgebra` and `SparseAlgebra` build the same formulas as affine rows over the option
literals, for the solver's constraints: dense vectors (fast below a few thousand literals), or sparse terms
with the shared prefix sums named once (`define`), which keep a model of thousands of units linear in size."""

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


class SparseAffine:
    """c + sum_k terms[k] * v[k], sparse: a column k below the algebra's `size` is an option literal (unit u's
    options are a slice), one above it a named sum (`SparseAlgebra.define`). A term held by both sides of a sum
    adds as the dense vectors' entries did, so integer rows and float step times come out the same."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict[int, float], const: float = 0):
        self.terms, self.const = terms, const

    def __add__(self, other):
        if isinstance(other, SparseAffine):  # the larger side copied, the smaller's terms added (a + b == b + a)
            big, small = (self, other) if len(self.terms) >= len(other.terms) else (other, self)
            terms = dict(big.terms)
            for k, v in small.terms.items():
                terms[k] = terms[k] + v if k in terms else v
            return SparseAffine(terms, self.const + other.const)
        return SparseAffine(self.terms, self.const + other)

    __radd__ = __add__

    def __mul__(self, scale):
        return SparseAffine({k: v * scale for k, v in self.terms.items()}, self.const * scale)

    __rmul__ = __mul__


def add_all(terms: Sequence) -> object:
    """The sum of numbers and affine rows in order, in time linear in their terms (adding one at a time would copy
    the growing sum at every step: quadratic over the thousands of units of a deep model)."""
    total = 0
    for term in terms:  # numbers (one plan's timeline) or dense rows, in one pass: no generator to test them first
        if isinstance(term, SparseAffine):
            return _sparse_sum(terms)
        total = total + term
    return total


def _sparse_sum(terms: Sequence) -> SparseAffine:
    summed: dict[int, float] = {}
    const = 0
    for term in terms:
        if isinstance(term, SparseAffine):
            for k, v in term.terms.items():
                summed[k] = summed.get(k, 0) + v
            const = const + term.const
        else:
            const = const + term
    return SparseAffine(summed, const)


class SparseAlgebra(AffineAlgebra):
    """AffineAlgebra's rows as sparse terms: a defined expression (a prefix sum over units or segments, shared by
    thousands of time points) becomes a named sum, column `size + i`, so that each row holds a few terms and the
    rows grow linearly with the model (`autoplan.solve.rows` expands them where a dense row is wanted)."""

    def __init__(self, options_per_unit: Sequence[int]):
        super().__init__(options_per_unit)
        self.sums: list[dict[int, float]] = []  # the named sums' terms, over literals and earlier sums

    def pick(self, unit: int, values: Sequence[int]) -> SparseAffine:
        # int(): as the dense int64 rows stored them
        return SparseAffine({int(self.offsets[unit]) + o: int(v) for o, v in enumerate(values) if v})

    def pick_time(self, unit: int, values: Sequence[float]) -> SparseAffine:
        return SparseAffine({int(self.offsets[unit]) + o: float(v) for o, v in enumerate(values) if v})

    def define(self, expr, name: str):
        if not isinstance(expr, SparseAffine) or len(expr.terms) <= 1:
            return expr
        self.sums.append(expr.terms)
        return SparseAffine({self.size + len(self.sums) - 1: 1}, expr.const)

    def dense(self, expr: SparseAffine) -> np.ndarray:
        """A row without named sums as a dense float vector over the literals (the step time)."""
        coef = np.zeros(self.size, dtype=np.float64)
        for k, v in expr.terms.items():
            coef[k] = v
        return coef
