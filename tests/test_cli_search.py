"""The `autoplan search` command as a user meets it."""

import json

import pytest

from autoplan.plan.schema import plan_json_schema

REQUIRED = [("predicted", "peak_mem_bytes"), ("predicted", "step_time_s"), ("predicted", "throughput_samples_s"),
            ("solver", "status"), ("timing", "solver_s"), ("cluster", "world_size"),
            ("training", "micro_batch_size")]


def test_search_writes_plan_and_prints_table(run_cli, tmp_path):
    result = run_cli("search", "--model", "gpt2-tiny", "--mem", "60MB", "--gpus", "2", "--seq-len", "64",
                     "-o", "p.json", "--fit-to", "allocated")
    assert result.returncode == 0, result.stderr
    assert "peak memory per GPU" in result.stdout and "transformer.h.0-1" in result.stdout
    plan = json.loads((tmp_path / "p.json").read_text())
    for section, key in REQUIRED:
        assert key in plan[section]
    assert all("module" in u and "sharding" in u and "checkpoint" in u for u in plan["units"])


def test_json_flag_prints_the_plan(run_cli, tmp_path):
    result = run_cli("search", "--model", "gpt2-tiny", "--mem", "60MB", "--gpus", "2", "--seq-len", "64", "--json", "--fit-to", "allocated")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((tmp_path / "plan.json").read_text())


def test_default_cluster_is_said(run_cli):
    result = run_cli("search", "--model", "gpt2-tiny", "--mem", "80GB", "--seq-len", "64")
    assert result.returncode == 0, result.stderr
    assert "1 node(s) x 8 GPU(s)" in result.stdout and "default cluster" in result.stdout


@pytest.mark.parametrize("mem", ["abc", "-1GB", "0"])
def test_bad_memory_sizes_exit_2_and_say_what_is_accepted(run_cli, tmp_path, mem):
    result = run_cli("search", "--model", "gpt2-tiny", f"--mem={mem}")
    assert result.returncode == 2
    assert "8GB" in result.stderr and "8GiB" in result.stderr
    assert not (tmp_path / "plan.json").exists()


def test_unknown_model_lists_names_and_factory_form(run_cli):
    result = run_cli("search", "--model", "gpt5", "--mem", "8GB")
    assert result.returncode == 2
    assert "gpt2-xl" in result.stderr and "llama2-70b" in result.stderr and "package.module:factory" in result.stderr


def test_unknown_profile_lists_available(run_cli):
    result = run_cli("search", "--model", "gpt2-tiny", "--mem", "8GB", "--profile", "tpu-v9")
    assert result.returncode == 2
    assert "h100-sxm-80gb" in result.stderr and "v100-sxm2-32gb" in result.stderr


def test_infeasible_limit_exits_nonzero_writes_nothing_and_says_what_fits(run_cli, tmp_path):
    (tmp_path / "old.json").write_text("keep me")
    result = run_cli("search", "--model", "gpt2-tiny", "--mem", "100KB", "--gpus", "2", "--seq-len", "64",
                     "-o", "old.json")
    assert result.returncode == 3
    assert "smallest peak" in result.stderr and "more GPUs" in result.stderr and "at least" in result.stderr
    assert (tmp_path / "old.json").read_text() == "keep me"
    assert not list(tmp_path.glob(".old.json*"))


def test_models_lists_published_counts(run_cli):
    result = run_cli("models")
    assert result.returncode == 0
    assert "1,557,611,200" in result.stdout and "68,976,648,192" in result.stdout


def test_checked_in_json_schema_matches_the_code():
    from pathlib import Path

    checked_in = json.loads((Path(__file__).resolve().parents[1] / "autoplan" / "plan" / "plan_schema.json").read_text())
    assert checked_in == plan_json_schema(), "regenerate: python -m autoplan.plan.schema > autoplan/plan/plan_schema.json"
