"""Tensor-parallel plans on gloo train exactly like one process on the same global batch: 1 x 2 on 2 ranks
and 2 x 2 on 4, llama-tiny's grouped-query attention split over the group, with and without sequence
parallelism, checkpointing, kept-gathered units, gradient accumulation and bf16.

One torchrun launch per world size (tp_parity_worker.py) runs every case; each test checks one case.
"""

import pytest
from tp_parity_worker import CASES
from parity_launch import assert_matches_reference, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two torchrun launches (~15 s on 2 cores)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {**launch(tmp_path_factory, "tp_parity_worker.py", 2), **launch(tmp_path_factory, "tp_parity_worker.py", 4)}


CASE_WORLD = [(name, world) for world, cases in CASES.items() for name in cases]


@pytest.mark.parametrize("case,world", CASE_WORLD)
def test_matches_single_process_reference(results, case, world):
    assert_matches_reference(results[case], case)


@pytest.mark.parametrize("case,world", CASE_WORLD)
def test_layout_is_what_runs(results, case, world):
    result = results[case]
    assert "error" not in result, result.get("error")
    assert result["wq_mesh"] == ["dp", "tp"]  # FSDP over "dp" on top of the TP split
    assert result["wq_local_fraction"] == 1 / world  # 1/2 by TP, then 1/(world/2) by FSDP
    assert result["heads"] == [2, 1]  # llama-tiny's 4 heads and 2 key/value heads, halved


def test_plans_that_do_not_match_the_layout_are_refused(results):
    assert "records tensor-parallel layout None, but at degree 2" in results["refused_layout"]
    assert "replicate does not run beside tensor parallelism" in results["refused_kind"]
