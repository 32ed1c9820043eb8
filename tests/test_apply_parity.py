"""`autoplan.apply` on 2 gloo ranks trains exactly like one process on the same global batch.

One torchrun launch (apply_parity_worker.py) runs every case; each test here checks one case.
"""

import pytest
from apply_parity_worker import CASES
from parity_launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one torchrun launch for the module (~8 s)

# What each case's probed unit must look like: (fraction of a weight held locally, parameters left
# gathered after the forward, forward calls of an inner module per micro-batch).
EXPECTED_PROBE = {
    "shard": (0.5, False, 1),
    "shard_keep": (0.5, True, 1),
    "replicate": (1.0, False, 1),
    "checkpoint": (0.5, False, 2),
    "hybrid_2x1": (1.0, False, 1),  # 2 nodes x 1 GPU: replicated across nodes
    "hybrid_1x2": (0.5, False, 1),  # 1 node x 2 GPUs: sharded within the node
    "mixed": (1.0, False, 2),  # layers.0.attn: replicate + checkpoint, nested in a sharded block
    "sgd": (1.0, False, 2),
    "dry_run_from_4": (0.5, False, 1),  # hybrid over 2 nodes x 2 GPUs, on 2 ranks: one node of 2
    "selective": (0.5, False, 2),  # re-run in the backward, its matmul outputs taken from the forward
    "offload": (1.0, False, 2),  # layers.1: replicate + selective + offload
    "bf16_mixed": (0.5, False, 1),
    "bf16": (0.5, False, 1),
}
LOW_PRECISION = {"bf16_mixed", "bf16"}
# The offload case: its offloaded units, how many parameters they hold, and the optimizer's groups
# (the root's norm and lm_head on the device, the offloaded units' 19 parameters on the host).
OFFLOADED = {"offload": (("tok_embeddings.", "layers.0.", "layers.1."), 19, [2, 19])}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory, "apply_parity_worker.py", 2)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process_reference(results, case):
    result = results[case]
    assert "error" not in result, result.get("error")
    if case in LOW_PRECISION:
        loss_tol, param_tol = 1e-2, 2e-2  # bf16 rounding against the fp32 reference
    else:
        loss_tol, param_tol = 1e-5, 5e-5
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=loss_tol)
    assert result["max_param_diff"] < param_tol


@pytest.mark.parametrize("case", list(CASES))
def test_decision_is_what_runs(results, case):
    result = results[case]
    assert "error" not in result, result.get("error")
    fraction, gathered, calls = EXPECTED_PROBE[case]
    assert result["probe_local_fraction"] == fraction
    assert result["probe_gathered_after_forward"] is gathered
    assert result["probe_inner_forward_calls_per_micro_batch"] == calls
    assert result["param_dtype"] == ("torch.bfloat16" if case == "bf16" else "torch.float32")
    prefixes, count, groups = OFFLOADED.get(case, ((), 0, None))
    assert len(result["offloaded_params"]) == count
    assert all(name.startswith(prefixes) for name in result["offloaded_params"])
    if groups is None:
        assert len(result["optimizer_groups"]) == 1
    else:
        assert result["optimizer_groups"] == groups


def test_refuses_another_world_size(results):
    message = results["refused_world_size"]
    assert message is not None and "world of 4 ranks, but 2 are running it" in message
