"""Plans with selectively checkpointed and offloaded units, run as rank 0 of an 8-rank world on torch's fake
process group (`autoplan apply --fake-world`), in this process: the bf16-mixed path that the 2-rank fp32
parity tests do not take, the optimizer's host group, and the host memory measured against the plan's.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import autoplan
from autoplan.cli.main import main
from autoplan.run.fake_world import run_fake_world

TOLERANCE = 0.03  # as tests/test_fake_world.py: a missed term is 10% or more of these peaks


def _plan(**fields):
    return autoplan.search("llama-tiny", "100GB", gpus=8, profile="cpu-gloo-2", seq_len=64, batch_size=2,
                           allow_over_device_mem=True, strategy="shard", **fields)


def test_selective_checkpointing_measured_as_predicted_in_a_fake_world():
    plan = _plan(checkpoint="selective")
    assert {unit.checkpoint for unit in plan.units if unit.module} == {"selective"}
    result = run_fake_world(plan, steps=1, warmup=1)
    assert abs(result.no_gloo_error) <= TOLERANCE, result
    assert result.measured_host_bytes == 0 and result.predicted_host_bytes == 0
    assert not dist.is_initialized()


def test_offloaded_units_hold_their_state_on_the_host_as_predicted(tmp_path, capsys):
    plan = _plan(checkpoint="selective", offload=True)
    assert all(unit.offload for unit in plan.units if unit.params)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert main(["apply", str(path), "--fake-world", "--warmup", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "host memory (offloaded)" in out and "the host is the device" in out
    result = run_fake_world(plan, steps=1, warmup=1)
    # parameters, gradients and AdamW's two states of this rank's shards, as the plan says (measured: plus
    # AdamW's 4-byte step counter per parameter tensor)
    assert result.measured_host_bytes == pytest.approx(plan.predicted.host_mem_bytes, rel=0.01)
    assert result.measured_host_bytes >= plan.predicted.host_mem_bytes
    # on the CPU the host is the device: the peak holds the offloaded state, measured and predicted alike (by
    # the plan's CPU profile; the NCCL costing beside it moves the state off the device, so it is not compared)
    assert abs(result.error) <= TOLERANCE, result
