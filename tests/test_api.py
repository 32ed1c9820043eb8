"""The public Python API: exports, trace reuse, Plan as plain data, the frontier, the documented examples."""

import doctest
import json
import re
import sys
from pathlib import Path

import pytest

import autoplan
import autoplan.tracing.tracer
from autoplan.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def traced():
    return autoplan.trace("gpt2-tiny", seq_len=64)


def test_the_api_is_exported():
    for name in ("trace", "TracedModel", "search", "estimate", "Estimate", "frontier", "FrontierPoint", "Plan",
                 "load_plan", "load_profile", "ExampleInputs", "plots", "TraceError", "InfeasibleError"):
        assert name in autoplan.__all__ and hasattr(autoplan, name), name


def test_a_traced_model_is_traced_once_and_searches_as_search_does(traced, monkeypatch):
    calls = []
    original = autoplan.tracing.tracer.trace_pair
    traced_module = sys.modules["autoplan.tracing.cache"]  # what TracedModel traces with (the disk cache is off)
    monkeypatch.setattr(traced_module, "trace_pair", lambda *a, **k: calls.append(a) or original(*a, **k))
    fresh = autoplan.search("gpt2-tiny", "20MB", gpus=2, seq_len=64, fit_to="allocated").model_dump(mode="json")
    assert len(calls) == 1
    reused = [autoplan.search(traced, limit, gpus=2, fit_to="allocated").model_dump(mode="json")
              for limit in ("20MB", "40MB")]
    reused.append(autoplan.search(traced, "20MB", gpus=4, granularity="fine", fit_to="allocated").model_dump(mode="json"))
    assert len(calls) == 1  # the TracedModel's bf16 traces served all three
    for plan in (fresh, reused[0]):
        del plan["timing"]  # wall-clock times, kept apart from the rest
    assert fresh == reused[0]
    autoplan.search(traced, "20MB", gpus=2, dtype="fp32", fit_to="allocated")
    assert len(calls) == 2  # another compute dtype is another trace


def test_a_traced_model_keeps_its_sequence_length(traced):
    with pytest.raises(UsageError, match="traced at sequence length 64"):
        autoplan.search(traced, "20MB", seq_len=32)
    with pytest.raises(UsageError, match="example_inputs"):
        autoplan.search(traced, "20MB", example_inputs={"x": 1})


def test_plan_prints_and_gives_plain_data(traced):
    plan = autoplan.search(traced, "20MB", gpus=2, fit_to="allocated")
    assert str(plan) == plan.table()
    assert "peak memory per GPU" in plan.table() and "traced by fx" in plan.table()
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data
    rows = plan.unit_table()
    assert [row["module"] for row in rows] == [unit.module for unit in plan.units]
    assert {"sharding", "checkpoint", "params", "activation_bytes", "fwd_s", "comm_s"} <= set(rows[0])
    timeline = plan.timeline_table()
    assert timeline[-1]["point"] == "optimizer step"
    assert max(row["total_bytes"] for row in timeline) == plan.predicted.peak_mem_bytes


def test_old_plan_files_without_a_tracer_still_load(traced, tmp_path):
    data = autoplan.search(traced, "20MB", gpus=2, fit_to="allocated").to_dict()
    del data["model"]["tracer"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert autoplan.load_plan(tmp_path / "old.json").model.tracer == "fx"


def test_frontier_is_monotone_and_never_below_a_fitting_baseline(traced):
    points = autoplan.frontier(traced, ["80MB", "100KB", "10MB", "20MB"], gpus=2, fit_to="allocated")
    assert [p.mem_limit_bytes for p in points] == [100_000, 10_000_000, 20_000_000, 80_000_000]
    assert points[0].plan is None and set(points[0].baselines.values()) == {None}
    throughputs = [p.throughput_samples_s for p in points[1:]]
    assert throughputs == sorted(throughputs)
    for point in points[1:]:
        for value in point.baselines.values():
            assert value is None or point.throughput_samples_s >= value * (1 - 1e-9)
        assert set(point.to_dict()) == {"mem_limit_bytes", "autoplan", "all-shard", "all-shard+sel", "all-shard+ckpt", "all-replicate"}


def _run_doctests(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write plan.json
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_api_docstring_examples_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")

    for name in ("autoplan", "autoplan.api.search", "autoplan.api.traced", "autoplan.api.estimate",
                 "autoplan.api.frontier"):
        _run_doctests(sys.modules[name], tmp_path, monkeypatch)


def test_readme_python_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "the README has no ```python example"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "plan.json").exists()
