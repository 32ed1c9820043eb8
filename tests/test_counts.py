"""Runs of identical units solved as counts (autoplan.solve.counts): the same fastest plans as the per-unit model,
through the public search, and every row exact over the counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

import autoplan
from autoplan.api.prepare import prepare
from autoplan.settings import SearchSettings
from autoplan.solve import counts, solver
from autoplan.solve.symmetry import canonical
from autoplan.solve.sweep import _tables

CASES = [  # (model, memory limit, search settings): models with identical blocks, limits that mix options
    ("gpt2-tiny", "40MB", dict(gpus=2, seq_len=64, profile="cpu-gloo-2")),
    ("llama-tiny", "30MB", dict(gpus=2, seq_len=64, profile="cpu-gloo-2", tp=1, granularity="fine")),
    ("hf:{deep}", "1GB", dict(gpus=2, seq_len=32)),  # 24 tiny layers, swept to micro-batch 256 where memory binds
    ("gpt2-medium", "6GB", dict(seq_len=1024, tp=1)),  # 24 blocks; at micro-batch 4 the per-unit model stops 0.04%
]                                                       # above the optimum (its 0.1% gap), counts find the optimum


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A Hugging Face Llama config of 24 layers, hidden size 64 (benchmarks/deep_stack.py's shape)."""
    folder = tmp_path_factory.mktemp("deep")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("model", "mem", "settings"), CASES)
def test_counts_find_the_per_unit_models_fastest_plans(model, mem, settings, deep, monkeypatch):
    model = model.format(deep=deep)
    monkeypatch.setattr(counts, "COUNTS", False)
    per_unit = autoplan.search(model, mem, **settings)
    monkeypatch.setattr(counts, "COUNTS", True)
    counted = autoplan.search(model, mem, **settings)
    assert counted.solver.num_variables < per_unit.solver.num_variables  # the runs were counted
    # every micro-batch as fast: the same optimum (the per-unit model's within its 0.1% gap of it)
    for a, b in zip(per_unit.solver.micro_batch_sweep, counted.solver.micro_batch_sweep, strict=True):
        assert (a.micro_batch_size, a.status == "INFEASIBLE") == (b.micro_batch_size, b.status == "INFEASIBLE")
        if a.step_time_s is not None:
            assert b.step_time_s <= a.step_time_s * (1 + 1e-9)
            assert b.step_time_s >= a.step_time_s * (1 - solver.RELATIVE_GAP_LIMIT)
    assert counted.training.micro_batch_size == per_unit.training.micro_batch_size
    assert counted.predicted.peak_mem_bytes <= counted.cluster.mem_limit_bytes


@pytest.fixture(scope="module")
def table(deep):
    """The 24-layer stack's table at micro-batch 256, where its plans mix options."""
    request = prepare(SearchSettings.create(None, model=f"hf:{deep}", mem="1GB", gpus=2, seq_len=32))
    cluster = request.cluster.with_mesh(request.meshes[0])
    return _tables(request, request.tables.for_layout(None), cluster, 256, 1)[1]


def test_every_row_over_the_counts_is_the_rows_value_of_the_canonical_plan(table):
    affine = solver.AffineModel.of(table)
    assert affine.counted and affine.runs
    cp = solver.cp_sat()
    generator = np.random.default_rng(0)
    for _ in range(5):
        plan = canonical([int(generator.integers(len(o))) for o in table.options], affine.runs, affine.order)
        model = counts.CountsModel(affine, cp)
        exprs = [model.expr(affine.rows.row(p), int(affine.rows.const[p])) for p in range(affine.rows.points)]
        step = model.step_ns()
        model.hint(plan)  # every variable's value under the plan, fixed
        cp_solver = cp.CpSolver()
        cp_solver.parameters.fix_variables_to_their_hinted_value = True
        assert cp_solver.solve(model.model) in (cp.OPTIMAL, cp.FEASIBLE)
        assert model.choices(cp_solver) == plan
        assert [cp_solver.value(e) for e in exprs] == affine.memory(plan).tolist()
        assert cp_solver.value(step) == int(affine.step_coef_ns @ affine.algebra.literals(plan)) + affine.step_const_ns
