"""The solver's memory rows written sparse (autoplan.solve.rows, the form a model of thousands of units takes):
the same bytes as the dense rows, and the same fastest plan."""

from __future__ import annotations

import numpy as np
import pytest

import autoplan
from autoplan.api.prepare import prepare
from autoplan.settings import SearchSettings
from autoplan.solve import rows, solver
from autoplan.solve.sweep import _tables


@pytest.fixture(scope="module")
def table():
    request = prepare(SearchSettings.create(None, model="gpt2-tiny", mem="40MB", gpus=2, seq_len=64,
                                            profile="cpu-gloo-2"))
    mesh = request.meshes[0]
    cluster = request.cluster.with_mesh(mesh)
    return _tables(request, request.tables.for_layout(None), cluster, 2, 1)[1]


def _affine(table, monkeypatch, limit: int) -> solver.AffineModel:
    monkeypatch.setattr(rows, "DENSE_LIMIT", limit)
    return solver.AffineModel.of(table)


def test_sparse_rows_hold_the_dense_rows_bytes(table, monkeypatch):
    dense = _affine(table, monkeypatch, 10**12)
    sparse = _affine(table, monkeypatch, 0)
    assert dense.rows.dense and not sparse.rows.dense and sparse.rows.num_sums > 0
    assert all(np.array_equal(dense.mem_row(p), sparse.mem_row(p)) for p in range(dense.rows.points))
    assert np.array_equal(dense.mem_const, sparse.mem_const)
    assert np.array_equal(dense.step_coef_ns, sparse.step_coef_ns) and dense.step_const_ns == sparse.step_const_ns
    generator = np.random.default_rng(0)
    for _ in range(10):
        choices = [int(generator.integers(len(options))) for options in table.options]
        assert np.array_equal(dense.memory(choices), sparse.memory(choices))
    # the peak variable's domain holds every plan's peak
    assert sparse.rows.horizon() >= dense.rows.horizon()


def test_a_search_on_sparse_rows_finds_the_same_fastest_plan(monkeypatch):
    args = dict(gpus=2, seq_len=64, profile="cpu-gloo-2", tp=1)
    dense = autoplan.search("gpt2-tiny", "40MB", **args)
    monkeypatch.setattr(rows, "DENSE_LIMIT", 0)
    sparse = autoplan.search("gpt2-tiny", "40MB", **args)
    assert sparse.training.micro_batch_size == dense.training.micro_batch_size
    assert sparse.predicted.step_time_s == pytest.approx(dense.predicted.step_time_s, rel=2e-3)
    assert sparse.predicted.peak_mem_bytes <= 40e6
