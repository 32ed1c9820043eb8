"""Context-parallel plans on gloo train exactly like one process on the same global batch: 1 x 2 on 2 ranks,
2 x 2 and 1 x 2 x tensor-parallel 2 on 4; llama-tiny's causal grouped-query attention run as ring attention
over load-balanced chunks (autoplan.run.context), with checkpointing, kept-gathered units, gradient
accumulation and bf16.

One torchrun launch per world size (cp_parity_worker.py) runs every case; each test checks one case.
"""

import json

import pytest
from cp_parity_worker import CASES
from parity_launch import assert_matches_reference, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two torchrun launches (~20 s on 2 cores)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {**launch(tmp_path_factory, "cp_parity_worker.py", 2), **launch(tmp_path_factory, "cp_parity_worker.py", 4)}


CASE_WORLD = [(name, world) for world, cases in CASES.items() for name in cases]


@pytest.mark.parametrize("case,world", CASE_WORLD)
def test_matches_single_process_reference(results, case, world):
    assert_matches_reference(results[case], case)


@pytest.mark.parametrize("case,world", CASE_WORLD)
def test_sequence_split_and_parameters_sharded_over_data_and_context(results, case, world):
    result = results[case]
    assert "error" not in result, result.get("error")
    assert result["attention_seq"] == 8  # each rank's attention sees half of the 16 tokens
    assert result["wq_mesh"] == (["dp_cp", "tp"] if "tp2" in case else ["dp_cp"])
    assert result["wq_local_fraction"] == 1 / world  # FSDP over data x context (and TP's half)


def test_kinds_that_do_not_shard_over_the_whole_dimension_are_refused(results):
    assert "replicate does not run beside context parallelism" in results["refused_kind"]


def test_autoplan_apply_runs_a_searched_context_parallel_plan(tmp_path, capfd):
    """The search's cp 2 plan, run by `autoplan apply` on 2 ranks: the whole path (plan file, launcher, worker's
    step inside the context, report) with a batch of one data-parallel rank and memory near the prediction."""
    import autoplan
    from autoplan.cli.main import main

    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    plan = autoplan.search("llama-tiny", "60MB", gpus=2, seq_len=64, profile="cpu-gloo-2", cp=2, tp=1, batch_size=2)
    assert plan.cluster.cp_degree == 2
    plan.save(plan_path)
    code = main(["apply", str(plan_path), "--steps", "1", "--warmup", "1", "--report", str(report_path)])
    _, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    report = json.loads(report_path.read_text())
    assert report["status"] == "ok" and report["world_size"] == 2
    assert report["global_batch_size"] == 2  # micro-batch 2 x one data-parallel rank: the cp ranks share it
    measured, predicted = report["measured"], report["predicted"]
    assert all(loss == loss and 5 < loss < 8 for loss in measured["losses"])  # llama-tiny's ln(512) ~ 6.2
    assert measured["peak_mem_bytes"] == pytest.approx(predicted["peak_mem_bytes"], rel=0.1)
