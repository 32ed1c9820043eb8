"""Pipelined plans on gloo train exactly like one process on the same global batch: 2 pipeline ranks x 2
data-parallel ranks (4 processes) through `autoplan.apply`, torch's 1F1B, GPipe, interleaved 1F1B, interleaved
zero-bubble and ZB-V schedules, FSDP2 inside each stage, Llama and GPT-2, and with tensor parallelism.

One torchrun launch (pp_parity_worker.py) runs every case; each test checks one case.
"""

import pytest
from pp_parity_worker import CASES
from parity_launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one torchrun launch of 4 ranks (~20 s on 2 cores)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory, "pp_parity_worker.py", 4)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process_reference(results, case):
    result = results[case]
    assert "error" not in result, result.get("error")
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert result["max_param_diff"] < 5e-5


@pytest.mark.parametrize("case", list(CASES))
def test_each_pipeline_rank_holds_its_stages_only(results, case):
    result = results[case]
    assert "error" not in result, result.get("error")
    _, stages, options = CASES[case]
    ranks = options.get("ranks") or [i % 2 for i in range(len(stages))]  # looped unless the case says (ZB-V)
    expected = [[i for i, rank in enumerate(ranks) if rank == p] for p in (0, 1)]
    assert result["stages_by_rank"] == [expected[0], expected[0], expected[1], expected[1]]
    held = result["params_held"]
    assert held[0] == held[1] and held[2] == held[3]  # a stage's data-parallel ranks hold the same parameters
    assert not set(held[0]) & set(held[2])  # no parameter in two pipeline ranks
    assert sorted(held[0] + held[2]) == result["all_params"]  # and every parameter in one
