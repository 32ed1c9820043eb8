"""algebra.summed_rows sums many rows' terms a block of rows at a time; each entry must come out as adding that
row's terms one at a time with Affine operations gives it (the memory rows' exactness, issue 22)."""

import math
import random

import numpy as np
import pytest

from cost_models import algebra
from cost_models.algebra import Affine, summed_rows


def _one_at_a_time(steps, count, ceil):
    rows = []
    for i in range(count):
        expr = 0
        for objects, weights in steps:
            weight = weights[i] if isinstance(weights, list) else weights
            expr = expr + (objects[i] if weight is None else objects[i] * weight)
        if ceil:
            expr = Affine(np.ceil(expr.coef).astype(np.int64), math.ceil(expr.const))
        rows.append(expr)
    return np.stack([row.coef for row in rows]), np.array([row.const for row in rows], dtype=np.int64)


def _steps(seed, count, size, weighted):
    rng = random.Random(seed)
    pool = [Affine(np.array([rng.randrange(-10**11, 10**12) for _ in range(size)], dtype=np.int64),
                   rng.randrange(0, 10**9)) for _ in range(6)] + [0, 7, 12345]
    shared = pool[0]
    steps = [([shared] * count, 1.013 if weighted else None)]  # one object for every row
    for k in range(4):
        objects = [rng.choice(pool) for _ in range(count)]
        if weighted and k == 2:  # a weight per row, as the activations weighted per checkpoint mode
            steps.append((objects, [rng.choice([None, 1.075, 1.1949]) for _ in range(count)]))
        else:
            steps.append((objects, rng.choice([None, 1.041, 1.48]) if weighted else None))
    return steps + [([pool[1] * 0.053 if weighted else 0] * count, None)]


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("block", [algebra.SUM_BLOCK, 40])  # 40 entries: blocks of a few rows, the last one short
def test_summed_rows_are_the_rows_added_one_at_a_time(weighted, block, monkeypatch):
    monkeypatch.setattr(algebra, "SUM_BLOCK", block)
    for seed in range(5):
        count, size = 23, 9
        steps = _steps(seed, count, size, weighted)
        coef, const = summed_rows(steps, size, ceil=weighted)
        want_coef, want_const = _one_at_a_time(steps, count, ceil=weighted)
        assert coef.dtype == np.int64 and const.dtype == np.int64
        assert np.array_equal(coef, want_coef) and np.array_equal(const, want_const)
