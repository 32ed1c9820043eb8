"""The memory rows of one cost table: bytes at each time point as an affine function of the option literals.

Written dense (one int64 vector over the literals per time point, as AffineAlgebra builds them), the rows take
time points x literals: 13 GB and more for a stack of 3000 layers, where nearly every entry comes from a few
prefix sums over units and segments. So a large model's rows are written sparse (SparseAlgebra): each time
point a few terms over the literals and the named sums, each named sum a few terms over literals and earlier
sums, which grows linearly with the units. The solver takes a dense model's rows as they are (its model is
the same as before the rows could be sparse) and a sparse model's named sums as variables of its own.

What the solver asks of them:
- a plan's memory at every point (`memory`): exact in integers either way;
- a point's row over the literals (`row`), for a constraint; a sparse model's own terms (`terms`) and its named
  sums' definitions (`definition`), for constraints that keep them;
- per literal, its largest coefficient over the points (`column_max`, for the leanest seed plan) and the
  largest absolute row (`horizon`, the peak variable's domain): exact from dense rows; for sparse rows, from a
  sample of rows (a seed only picks the first points to constrain) and from an upper bound (a domain only needs
  to hold every peak).
"""

from __future__ import annotations

import heapq
from itertools import chain

import numpy as np

from cost_models.algebra import AffineAlgebra, SparseAffine, SparseAlgebra
from cost_models.allocator_margin import fitted_matrix, fitted_totals
from cost_models.memory import timeline
from cost_models.optimizer_points import MAX_SCRATCH_POINTS

__all__ = ["DENSE_LIMIT", "MemoryRows", "sparse_rows", "table_rows"]

# time points x literals up to which a table's rows are dense (int64: 400 MB at the limit; llama2-70b by leaf units,
# the largest model the benchmarks plan, is 4e7; a stack of 1000 tiny layers 7e7, which CP-SAT solves faster sparse)
DENSE_LIMIT = 50_000_000
SAMPLED_ROWS = 256
EXPAND_CHUNK = 10_000_000  # coefficients expanded at once (rows x literals) for `column_max` above DENSE_LIMIT


def sparse_rows(table) -> bool:
    """Whether a cost table's rows are written sparse: its time points (a forward and a backward per segment, a
    copy-out and a reduction per unit, the optimizer's) x its literals pass DENSE_LIMIT."""
    most_points = 2 * (len(table.segments) + len(table.units)) + MAX_SCRATCH_POINTS
    return most_points * sum(len(options) for options in table.options) > DENSE_LIMIT


def table_rows(table) -> tuple[AffineAlgebra, "MemoryRows", list[str]]:
    """A cost table's algebra over its option literals, its memory rows (live bytes, or the allocator's need:
    allocator_margin) and each time point's label, in the timeline's order."""
    options = [len(options) for options in table.options]
    sparse = sparse_rows(table)  # thousands of units: rows linear in them
    alg = SparseAlgebra(options) if sparse else AffineAlgebra(options)
    points = timeline(table, alg)
    labels = [point.label for point in points]
    if sparse:
        return alg, MemoryRows.of_sparse(alg, fitted_totals(table, points, alg)), labels
    coef, const = fitted_matrix(table, points, alg)  # fitted_totals' rows as one matrix, not a stack of them
    return alg, MemoryRows(alg.size, const, dense=coef), labels


class _Sparse:
    """Rows of (column, coefficient) terms as flat arrays, split into literal and named-sum columns."""

    def __init__(self, rows: list[dict[int, float]], size: int):
        self.size = size
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        count = int(lengths.sum())
        cols = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=count)
        vals = np.fromiter(chain.from_iterable(row.values() for row in rows), dtype=np.int64, count=count)
        owner = np.repeat(np.arange(len(rows)), lengths)
        lit = cols < size
        self.lit_ptr = _pointers(owner[lit], len(rows))
        self.lit_col, self.lit_val = cols[lit], vals[lit]
        self.sum_owner, self.sum_col, self.sum_val = owner[~lit], cols[~lit] - size, vals[~lit]
        self.sum_ptr = _pointers(self.sum_owner, len(rows))
        self.sums: list[list[tuple[int, int]]] = [[] for _ in rows]  # per row: (named sum, coefficient)
        for row, col, val in zip(self.sum_owner.tolist(), self.sum_col.tolist(), self.sum_val.tolist()):
            self.sums[row].append((col, val))

    def literal_part(self, x: np.ndarray) -> np.ndarray:
        return _segment_sums(self.lit_val * x[self.lit_col], self.lit_ptr)

    def sum_part(self, values: np.ndarray) -> np.ndarray:
        return _segment_sums(self.sum_val * values[self.sum_col], self.sum_ptr)


def _pointers(owner: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=rows))]).astype(np.int64)


def _segment_sums(terms: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    running = np.concatenate([[0], np.cumsum(terms, dtype=np.int64)])
    return running[ptr[1:]] - running[ptr[:-1]]


class MemoryRows:
    """The memory rows of a table's time points (see the module docstring): dense rows over the literals (a matrix and
    the constants, as `allocator_margin.fitted_matrix` makes them), or sparse rows with named sums (`of_sparse`)."""

    def __init__(self, size: int, const: np.ndarray, dense: np.ndarray | None = None,
                 defs: _Sparse | None = None, rows: _Sparse | None = None):
        self.size, self.points, self.const = size, len(const), const
        self._dense, self._defs, self._rows = dense, defs, rows
        self._expanded: dict[int, np.ndarray] = {}
        self._column_max: np.ndarray | None = None  # column_max, once (the rows are not changed once made)

    @classmethod
    def of_sparse(cls, algebra: SparseAlgebra, rows: list) -> "MemoryRows":
        rows = [row if isinstance(row, SparseAffine) else SparseAffine({}, row) for row in rows]
        memory = cls(algebra.size, np.array([row.const for row in rows], dtype=np.int64),
                     defs=_Sparse(algebra.sums, algebra.size), rows=_Sparse([row.terms for row in rows], algebra.size))
        if (memory.points + memory.num_sums) * memory.size <= DENSE_LIMIT:  # a small model written sparse (tests)
            memory._dense = memory._expand_all()
        return memory

    @property
    def num_sums(self) -> int:
        return len(self._defs.sums) if self._defs is not None else 0

    @property
    def dense(self) -> bool:
        """Whether the expanded rows are held (the model is at most DENSE_LIMIT points x literals)."""
        return self._dense is not None

    def sum_values(self, x: np.ndarray) -> np.ndarray:
        """The named sums' values under the literal vector x, in definition order (each refers to earlier ones)."""
        values = self._defs.literal_part(x)
        for k, refs in enumerate(self._defs.sums):
            for j, c in refs:
                values[k] += c * values[j]
        return values

    def memory(self, x: np.ndarray) -> np.ndarray:
        """Every point's bytes under the literal vector x."""
        if self._dense is not None:
            return self._dense @ x + self.const
        return self._rows.literal_part(x) + self._rows.sum_part(self.sum_values(x)) + self.const

    def memory_of(self, chosen: np.ndarray) -> np.ndarray:
        """Every point's bytes under the plan whose chosen literals are `chosen` (one per unit): dense rows summed over
        those columns (integers: the same sums as `memory` of its literal vector, without the product over the rest)."""
        if self._dense is not None:
            return self._dense[:, chosen].sum(axis=1) + self.const
        x = np.zeros(self.size, dtype=np.int64)
        x[chosen] = 1
        return self.memory(x)

    def row(self, point: int) -> np.ndarray:
        """The point's coefficients over the literals."""
        if self._dense is not None:
            return self._dense[point]
        if point not in self._expanded:
            self._expanded[point] = self._expand(point)
        return self._expanded[point]

    def rows_at(self, points: list[int]) -> np.ndarray:
        """The points' coefficients over the literals, one row each (a new array)."""
        if self._dense is not None:
            return self._dense[points]
        return np.stack([self.row(point) for point in points]) if points else np.zeros((0, self.size), np.int64)

    def terms(self, point: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The point's own terms: (literal, coefficient) and (named sum, coefficient)."""
        rows = self._rows
        lo, hi = rows.lit_ptr[point], rows.lit_ptr[point + 1]
        return list(zip(rows.lit_col[lo:hi].tolist(), rows.lit_val[lo:hi].tolist())), rows.sums[point]

    def definition(self, k: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Named sum k's terms: (literal, coefficient) and (earlier named sum, coefficient)."""
        defs = self._defs
        lo, hi = defs.lit_ptr[k], defs.lit_ptr[k + 1]
        return list(zip(defs.lit_col[lo:hi].tolist(), defs.lit_val[lo:hi].tolist())), defs.sums[k]

    def _expand(self, point: int) -> np.ndarray:
        return self._expand_many([point])[0]

    def _expand_many(self, points: list[int]) -> np.ndarray:
        """The points' rows over the literals, together: each named sum's weights (one per row) pushed down to the
        earlier sums it refers to, latest sum first (a heap of the sums reached: each is visited once, so a row
        costs its sums' terms, not their number squared as a scan for the latest did)."""
        defs = self._defs
        coef = np.zeros((len(points), self.size), dtype=np.int64)
        weights: dict[int, np.ndarray] = {}
        for i, point in enumerate(points):
            literals, sums = self.terms(point)
            for col, c in literals:
                coef[i, col] += c
            for k, c in sums:
                weights.setdefault(k, np.zeros(len(points), dtype=np.int64))[i] += c
        heap = [-k for k in weights]
        heapq.heapify(heap)
        while heap:
            k = -heapq.heappop(heap)
            w = weights.pop(k)
            lo, hi = defs.lit_ptr[k], defs.lit_ptr[k + 1]
            coef[:, defs.lit_col[lo:hi]] += w[:, None] * defs.lit_val[None, lo:hi]  # a sum's literals are distinct
            for j, c in defs.sums[k]:  # earlier sums (j < k)
                if j not in weights:
                    weights[j] = np.zeros(len(points), dtype=np.int64)
                    heapq.heappush(heap, -j)
                weights[j] += c * w
        return coef

    def _expand_all(self) -> np.ndarray:
        """Every row over the literals: the named sums expanded in order, then each row from them."""
        defs, rows = self._defs, self._rows
        expanded = np.zeros((self.num_sums, self.size), dtype=np.int64)
        owner = np.repeat(np.arange(self.num_sums), np.diff(defs.lit_ptr))
        expanded[owner, defs.lit_col] = defs.lit_val  # a sum's literals are distinct (dict keys)
        for k, refs in enumerate(defs.sums):
            for j, c in refs:
                expanded[k] += c * expanded[j]
        dense = np.zeros((self.points, self.size), dtype=np.int64)
        dense[np.repeat(np.arange(self.points), np.diff(rows.lit_ptr)), rows.lit_col] = rows.lit_val
        by_sum = np.argsort(rows.sum_col, kind="stable")  # the rows' named-sum terms, one named sum at a time
        cols, owners, vals = rows.sum_col[by_sum], rows.sum_owner[by_sum], rows.sum_val[by_sum]
        bounds = np.flatnonzero(np.diff(cols)) + 1
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(cols)]) if len(cols) else ():
            # a row holds a named sum once (dict keys), so the rows indexed here are distinct
            dense[owners[lo:hi]] += vals[lo:hi, None] * expanded[cols[lo]]
        return dense

    def floor(self, offsets) -> int:
        """The largest point's bytes when every unit takes, at each point, its smallest option there (units'
        literals between `offsets`): a lower bound on any plan's peak."""
        dense = self._dense if self._dense is not None else self._expand_all()
        return int((self.const + np.minimum.reduceat(dense, np.asarray(offsets[:-1]), axis=1).sum(axis=1)).max())

    def column_max(self) -> np.ndarray:
        """Per literal, its largest coefficient over the points (above DENSE_LIMIT: over a sample of points)."""
        if self._column_max is not None:  # asked by each solve's seeds
            return self._column_max
        if self._dense is not None:
            self._column_max = self._dense.max(axis=0)
            return self._column_max
        sample = np.unique(np.linspace(0, self.points - 1, min(SAMPLED_ROWS, self.points)).astype(int)).tolist()
        step = max(1, EXPAND_CHUNK // self.size)
        self._column_max = np.max([self._expand_many(sample[i:i + step]).max(axis=0)
                                   for i in range(0, len(sample), step)], axis=0)
        return self._column_max

    def horizon(self) -> int:
        """At least every point's bytes under any plan: exact rows' largest absolute sum below DENSE_LIMIT, above
        it the same through the named sums' absolute sums (an upper bound)."""
        if self._dense is not None:
            return int(self.const.max() + np.abs(self._dense).sum(axis=1).max())
        bound = self.sum_bounds()
        rows = self._rows
        lit = _segment_sums(np.abs(rows.lit_val), rows.lit_ptr)
        sums = _segment_sums(np.abs(rows.sum_val) * bound[rows.sum_col], rows.sum_ptr)
        return int(self.const.max() + (lit + sums).max())

    def sum_bounds(self) -> np.ndarray:
        """Per named sum, the sum of its expanded coefficients' absolute values (at least |its value| under any
        plan)."""
        defs = self._defs
        bound = _segment_sums(np.abs(defs.lit_val), defs.lit_ptr)
        for k, refs in enumerate(defs.sums):
            for j, c in refs:
                bound[k] += abs(c) * bound[j]
        return bound
