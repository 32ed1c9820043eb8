"""What torch's selective checkpoint costs beyond the kernels it re-runs, in the step model: a profile's per-op
time (FsdpOverhead.selective_*_s_per_op, fitted by `autoplan profile`'s selective calibration case) charged to every
working op of a selectively checkpointed unit, forward and backward, and what that does to a search's choice."""

import pytest

import autoplan
from autoplan.profile_store import load_profile


@pytest.fixture(scope="module")
def profile_with(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")

    def write(fwd_s: float, bwd_s: float, base: str = "a100-sxm4-80gb") -> str:
        profile = load_profile(base)
        fsdp = profile.fsdp.model_copy(update={"selective_fwd_s_per_op": fwd_s, "selective_bwd_s_per_op": bwd_s})
        path = folder / f"{base}-{fwd_s}-{bwd_s}.json"
        path.write_text(profile.model_copy(update={"fsdp": fsdp}).model_dump_json())
        return str(path)

    return write


def _step_s(model: str, mode: str, profile: str) -> float:
    return autoplan.estimate(model, "shard", checkpoint=mode, profile=profile, gpus=8).predicted.step_time_s


def test_each_selective_block_pays_its_ops_dispatch_and_other_modes_pay_nothing(profile_with):
    bare, priced, doubled = profile_with(0.0, 0.0), profile_with(50e-6, 100e-6), profile_with(100e-6, 200e-6)
    extra = {}
    for layers in (2, 4):
        model = f"llama-tiny[n_layers={layers}]"
        for mode in ("none", "full"):
            assert _step_s(model, mode, priced) == _step_s(model, mode, bare), (layers, mode)
        extra[layers] = _step_s(model, "selective", priced) - _step_s(model, "selective", bare)
        assert _step_s(model, "selective", doubled) - _step_s(model, "selective", bare) == pytest.approx(
            2 * extra[layers])
    # two more blocks, two more blocks' ops: a llama block runs 24 ops that do work (of 42 traced; 70 aten ops)
    assert extra[4] - extra[2] == pytest.approx(2 * 24 * 150e-6)


def test_a_costly_selective_checkpoint_is_not_chosen(profile_with):
    """gpt2-1.5b under 8 GB on 8 A100s (the demo): blocks selectively checkpointed where the profile prices the
    recompute alone; none where each block's 10 working ops cost 0.25 ms each way (5 ms a block, about what an
    H200 measured for a llama block), at no more samples a second than the plan that ignores the cost claims."""
    cheap = autoplan.search("gpt2-1.5b", mem="8GB", gpus=8, profile=profile_with(0.0, 0.0))
    costly = autoplan.search("gpt2-1.5b", mem="8GB", gpus=8, profile=profile_with(250e-6, 250e-6))
    assert any(unit.checkpoint == "selective" for unit in cheap.units)
    assert not any(unit.checkpoint == "selective" for unit in costly.units)
    assert costly.predicted.throughput_samples_s <= cheap.predicted.throughput_samples_s
