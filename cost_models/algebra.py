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
        self._slices = [slice(lo, hi) for lo, hi in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    def _row(self, unit: int, values: Sequence, dtype) -> Affine:
        coef = np.zeros(self.size, dtype=dtype)
        coef[self._slices[unit]] = values
        return Affine(coef)

    def pick(self, unit: int, values: Sequence[int]) -> Affine:
        return self._row(unit, values, np.int64)

    def pick_time(self, unit: int, values: Sequence[float]) -> Affine:
        return self._row(unit, values, np.float64)

    def pick_sum(self, values: Sequence[Sequence[int]]) -> Affine | int:
        """The sum over every unit u of pick(u, values[u]): the units' slices side by side (integers: exact), one
        array where adding a row per unit made two each."""
        if not values:
            return 0
        coef = np.array([value for unit_values in values for value in unit_values], dtype=np.int64)
        assert len(coef) == self.size, "a value per option of every unit"
        return Affine(coef)

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


SUM_BLOCK = 1 << 15  # entries of the block of rows `summed_rows` sums at once (256 KiB of float64: in a core's L2)


def summed_rows(steps: Sequence[tuple[list, object]], size: int, ceil: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row i of the sums (...((0 + t_1[i]) + t_2[i]) + ...) of int64 dense rows and numbers, as an int64 matrix (a
    row per i) and the constants, each rounded up where `ceil` (np.ceil, then int64, as each row would be). A step
    is (objects, weight): t[i] is objects[i] times the weight, as `Affine.__mul__` makes it (None: the object itself),
    or a list of weights, a weight per row. Each entry takes the IEEE operations of adding its row's terms one at a
    time: a number adds zeros to the coefficients, which changes no sum (no coefficient is -0.0, whose ceiling is 0
    anyway), and a block of rows turns to floats at the first step that makes floats in it, where a row whose terms
    were numbers so far would have stayed integers a step longer (the same figures below 2**53 bytes). A block of
    rows a step at a time, in buffers that stay in the caches: an array per row and operation costs a Python call
    each (thousands per table), a matrix of all the rows per step leaves the caches and costs its memory traffic."""
    count = len(steps[0][0])
    coef = np.empty((count, size), dtype=np.int64)
    block = max(1, SUM_BLOCK // size)
    buffers = {kind: np.empty(block * size, dtype=kind) for kind in (np.int64, np.float64)}
    stacked, zeros = np.empty(block * size, dtype=np.int64), np.zeros(size, dtype=np.int64)
    for lo in range(0, count, block):
        rows = min(count, lo + block) - lo
        total = None
        for objects, weights in steps:
            objects, weights = objects[lo:lo + rows], weights[lo:lo + rows] if isinstance(weights, list) else weights
            first = objects[0]
            if not isinstance(weights, list) and all(obj is first for obj in objects):  # one term for all: a row
                terms = first.coef if isinstance(first, Affine) else zeros
                terms = terms if weights is None else terms * weights
            else:
                np.concatenate([obj.coef if isinstance(obj, Affine) else zeros for obj in objects],
                               out=stacked[:rows * size])
                terms = _scaled(stacked[:rows * size].reshape(rows, size), weights)
            kind = terms.dtype if total is None else np.promote_types(total.dtype, terms.dtype)
            summed = buffers[kind.type][:rows * size].reshape(rows, size)  # the sum's buffer may be its operand
            if total is None:  # 0 + t: t
                np.copyto(summed, terms)
            else:
                np.add(total, terms, out=summed)
            total = summed
        if ceil:
            np.ceil(total, out=coef[lo:lo + rows], casting="unsafe")  # integral floats: cast exactly, as astype does
        else:
            coef[lo:lo + rows] = total
    return coef, _summed_consts(steps, ceil)


def _summed_consts(steps: Sequence[tuple[list, object]], ceil: bool) -> np.ndarray:
    """The constants of `summed_rows`: numpy's float64 and int64 operations are Python's on floats and ints."""
    const = np.zeros(len(steps[0][0]), dtype=np.int64)
    for objects, weights in steps:
        consts = [obj.const if isinstance(obj, Affine) else obj for obj in objects]
        if isinstance(weights, list):
            const = const + np.array([c if w is None else c * w for c, w in zip(consts, weights)])
        else:
            const = const + (np.array(consts) if weights is None else np.array(consts) * weights)
    return np.ceil(const).astype(np.int64) if ceil else const


def _scaled(terms: np.ndarray, weights) -> np.ndarray:
    """int64 rows times weights (None: as they are; a list: a weight per row), in place: their buffer read as float64
    (an elementwise ufunc gives what it would give without the overlap)."""
    if weights is None:
        return terms
    out = terms.view(np.float64)
    if not isinstance(weights, list):
        return np.multiply(terms, weights, out=out)
    for weight in dict.fromkeys(weights):  # the rows of each weight (each row in one group: none read once written)
        rows = [i for i, w in enumerate(weights) if w == weight]
        out[rows] = terms[rows] if weight is None else terms[rows] * weight
    return out


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

    def pick_sum(self, values: Sequence[Sequence[int]]) -> SparseAffine | int:
        return add_all([self.pick(unit, unit_values) for unit, unit_values in enumerate(values)])

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
