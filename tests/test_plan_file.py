"""A plan file is data, and a corrupt one is refused with what is wrong (issue 26, items 5, 6 and 8): nesting too
deep for Python's parser, NaN, infinite or negative figures, a key given twice, a schema_version that is not a
number; and its wall-clock times are kept apart, so two identical searches write the same bytes above them."""

import json
import math

import pytest

import autoplan
from autoplan.cli.main import main
from autoplan.errors import PlanFileError
from autoplan.plan.schema import load_plan

TINY = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "40MB", "--fit-to", "allocated"]


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    autoplan.search("gpt2-tiny", "40MB", gpus=2, seq_len=64, fit_to="allocated").save(path)
    return path.read_text()


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_deeply_nested_plan_is_refused_by_estimate_explain_and_diff(run_cli, tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text('{"schema_version": 1, "model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = run_cli("estimate", "--plan", "deep.json")  # as a user runs it: the whole output, exit status
    assert result.returncode == 2, result.stderr[-2000:]
    assert "nests arrays or objects too deeply to read" in result.stderr and "deep.json" in result.stderr
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr
    for argv in (["explain", deep], ["diff", deep, deep]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and "nests arrays or objects too deeply to read" in err and out == ""


@pytest.mark.parametrize("where, value, field", [
    (("predicted", "step_time_s"), math.nan, "predicted.step_time_s"),
    (("predicted", "step_time_s"), math.inf, "predicted.step_time_s"),
    (("predicted", "peak_mem_bytes"), -100, "predicted.peak_mem_bytes"),
    (("predicted", "throughput_samples_s"), -1.5, "predicted.throughput_samples_s"),
    (("units", 0, "params"), -5, "units.0.params"),
    (("units", 1, "predicted", "fwd_s"), -math.inf, "units.1.predicted.fwd_s"),
    (("units", 0, "param_shapes", "transformer.wte.weight", 0), -512, "units.0.param_shapes"),
    (("solver", "objective_s"), math.nan, "solver.objective_s"),
    (("baselines", 0, "peak_mem_bytes"), -1, "baselines.0.peak_mem_bytes"),
    (("cluster", "mem_headroom"), 1.5, "cluster.mem_headroom"),
])
def test_nan_infinite_and_negative_figures_are_refused(plan_text, tmp_path, capsys, where, value, field):
    data = json.loads(plan_text)
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))  # Python writes NaN and Infinity, as a careless tool would
    for argv in (["estimate", "--plan", path], ["diff", path, path], ["explain", path]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and f"plan file {path} is corrupt or incomplete" in err and field in err, err
        assert out == ""


def test_a_key_given_twice_is_refused(plan_text, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(plan_text.replace('"schema_version": 1,', '"schema_version": 1, "units": [],', 1))
    code, _, err = cli(capsys, "estimate", "--plan", path)
    assert code == 2 and "the key 'units' appears twice in one object" in err and str(path) in err


@pytest.mark.parametrize("version, says", [
    ('"1"', 'has schema_version "1", not a version number: autoplan writes a whole number (1 for this one, unquoted)'),
    ("true", "has schema_version true, not a version number"),
    ("1.0", "has schema_version 1.0, not a version number"),
    ("0", "has schema_version 0; versions start at 1"),
    ("7", "has schema_version 7, newer than this autoplan reads (1); upgrade autoplan"),
])
def test_a_schema_version_that_is_not_a_version_is_named_for_what_it_is(plan_text, tmp_path, capsys, version, says):
    path = tmp_path / "plan.json"
    path.write_text(plan_text.replace('"schema_version": 1,', f'"schema_version": {version},', 1))
    code, _, err = cli(capsys, "estimate", "--plan", path)
    assert code == 2 and says in err, err
    if version != "7":
        assert "newer" not in err


def test_two_identical_searches_write_the_same_bytes_above_their_timing(tmp_path, capsys):
    """The wall-clock times are the one part two identical searches do not reproduce: they are in `timing`, last."""
    for name in ("a.json", "b.json"):
        assert cli(capsys, "search", *TINY, "--profile", "cpu-gloo-2", "-o", tmp_path / name)[0] == 0
    a, b = ((tmp_path / name).read_text() for name in ("a.json", "b.json"))
    assert a != b  # the timings differ ...
    head_a = a.rpartition('  "timing": {')[0]
    head_b = b.rpartition('  "timing": {')[0]
    assert head_a == head_b and "wall_time_s" not in head_a  # ... and nothing else does
    assert list(json.loads(a))[-1] == "timing" and json.loads(a)["timing"]["solver_s"] > 0
    plan = load_plan(tmp_path / "a.json")
    assert plan.solver_wall_time_s == plan.timing.solver_s and "solver: OPTIMAL in" in plan.table()


def test_an_older_plan_with_its_times_in_the_solver_record_still_loads(plan_text, tmp_path):
    data = json.loads(plan_text)
    timing = data.pop("timing")
    data["solver"]["wall_time_s"] = timing["solver_s"]  # where plans before the timing section kept it
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert plan.timing is None and plan.solver_wall_time_s == timing["solver_s"]
    assert f"in {timing['solver_s']:.2f} s" in plan.table()
    assert autoplan.estimate(plan=path).predicted.peak_mem_bytes == plan.predicted.peak_mem_bytes  # it estimates


def test_an_older_plan_is_refused_when_its_figures_are_corrupt(plan_text, tmp_path):
    data = json.loads(plan_text)
    data["solver"]["wall_time_s"] = -3.0
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="solver.wall_time_s"):
        load_plan(path)
