"""A pipelined plan's per-stage peak against what its stages hold when run (issue 28): each stage's first rank of a
searched plan run alone on torch's fake process group, as `autoplan apply` runs it (torch.distributed.pipelining's
PipelineStage, FSDP2 inside each stage). Parameters dominate these stages (llama 4 x 256 at 128 tokens per
micro-batch), so FSDP under the pipeline decides the peak: the parameters kept gathered for the step, the gradients
accumulated unsharded, and the reductions after the last backward with no micro-batch in flight."""

import pytest

import autoplan
from autoplan.run.fake_world import FakeWorldOptions, run_fake_world

MODEL = "llama-tiny[n_layers=4,d_model=256,n_heads=4,n_kv_heads=2,ffn_hidden=704]"


def _plan(schedule: str):
    return autoplan.search(MODEL, "100GB", gpus=4, pp=2, tp=1, schedule=schedule, profile="cpu-gloo-2", seq_len=64,
                           batch_size=2, global_batch=16, allow_over_device_mem=True)


def test_a_pipelined_plan_records_its_units_gathered_for_the_step():
    plan = _plan("1f1b")
    # what the pricing prices and apply then runs: FSDP2 gathers each unit once per step, not per micro-batch
    assert plan.pipeline is not None and all(not unit.reshard_after_forward for unit in plan.units)


@pytest.mark.slow  # four fake-world runs of a few seconds each
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_stages_measured_peak_is_its_predicted_peak(schedule):
    plan = _plan(schedule)
    for rank in (0, 2):  # the first rank of each pipeline rank (pp 2 x dp 2)
        result = run_fake_world(plan, steps=1, warmup=1, options=FakeWorldOptions(rank=rank))
        assert "busiest point" in result.predicted_peak_point
        assert abs(result.error) <= 0.03, (schedule, rank, result.predicted_peak_bytes, result.measured_peak_bytes)
