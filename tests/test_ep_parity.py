"""Expert-parallel plans on gloo train exactly like one process on the same global batch: moe-tiny's 8
experts split 2 ways over 2 ranks (also with a kept-gathered stack, checkpointing, gradient accumulation and bf16),
2 and 4 ways over 4 ranks, FSDP2 sharding the experts over the ranks left and everything else over all;
with fewer experts than ranks, FSDP (with or without the split) shards them on their second dimension.

One torchrun launch per world size (ep_parity_worker.py) runs every case; each test checks one case.
"""

import pytest
from ep_parity_worker import CASES
from parity_launch import assert_matches_reference, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two torchrun launches


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {**launch(tmp_path_factory, "ep_parity_worker.py", 2), **launch(tmp_path_factory, "ep_parity_worker.py", 4)}


CASE_WORLD = [(name, world) for world, cases in CASES.items() for name in cases]


@pytest.mark.parametrize("case,world", CASE_WORLD)
def test_matches_single_process_reference(results, case, world):
    assert_matches_reference(results[case], case)


@pytest.mark.parametrize("case,world", [(c, w) for c, w in CASE_WORLD if CASES[w][c][0] > 1])
def test_experts_are_split_by_expert_then_sharded(results, case, world):
    result = results[case]
    assert "error" not in result, result.get("error")
    assert result["w1_mesh"] == ["dp_mod_ep", "ep"]  # FSDP over dp / ep on top of the expert split
    assert result["w1_local_fraction"] == 1 / world  # 1/ep by expert, then 1/(dp/ep) by FSDP
    assert result["wq_mesh"] in (["dp"], [])  # attention shards over all of dp


def test_fewer_experts_than_ranks_shard_on_their_second_dimension(results):
    # one expert per rank of the ep group, two ranks holding it: dim 1 split, no rank padded to a whole expert
    assert results["dp4_ep2_two_experts"]["w1_placements"] == ["S(1)", "S(0)"]
    # FSDP alone: two experts over four ranks
    assert results["dp4_fsdp_two_experts"]["w1_placements"] == ["S(1)"]
    assert results["dp4_fsdp_two_experts"]["w1_local_fraction"] == 1 / 4


def test_plans_that_cannot_split_experts_are_refused(results):
    assert "replicate does not run beside expert parallelism" in results["refused_kind"]
    assert "has no mixture-of-experts layers" in results["refused_dense"]
