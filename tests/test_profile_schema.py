"""The profile schema shared by datasheet and measured profiles: round-trip, backward compatibility,
the shipped measured profile, and how the compute model picks measured times and fits."""

import json

import pytest

from autoplan.errors import UsageError
from autoplan.profile_store import available_profiles, load_profile, save_profile
from cost_models.compute import ComputeModel
from cost_models.profile import PROFILE_SCHEMA_VERSION, CollectiveFit, DeviceProfile, OpFit, OpTiming
from cost_models.records import OpRecord

COLLECTIVES = {"all_gather", "reduce_scatter", "all_reduce"}


def test_measured_profile_round_trips(tmp_path):
    profile = load_profile("cpu-gloo-2")
    path = tmp_path / "copy.json"
    save_profile(profile, path)
    again = load_profile(str(path))
    assert again == profile
    assert again.model_dump_json() == profile.model_dump_json()


def test_profile_without_fit_dtypes_still_loads(tmp_path):
    """Profiles written before OpFit had a dtype (and the datasheets) load unchanged."""
    data = json.loads(load_profile("a100-sxm4-80gb").model_dump_json())
    data["op_fits"] = [{"family": "matmul", "direction": "fwd", "work": "flops", "intercept_s": 1e-5,
                        "s_per_unit": 1e-12}]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).op_fits[0].dtype is None


def test_wrong_schema_version_is_a_usage_error(tmp_path):
    data = json.loads(load_profile("cpu-gloo-2").model_dump_json())
    data["schema_version"] = PROFILE_SCHEMA_VERSION + 1
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="schema_version"):
        load_profile(str(path))


def test_shipped_measured_cpu_profile_is_complete():
    profile = load_profile("cpu-gloo-2")
    assert profile.source == "measured" and profile.device_type == "cpu"
    assert profile.provenance.host and profile.provenance.torch_version and profile.provenance.date
    assert profile.provenance.settings["backend"] == "gloo" and profile.provenance.settings["nproc"] == 2
    assert {f.collective for f in profile.collectives if f.group_size == 2} == COLLECTIVES
    assert all(f.scope == "intra_node" and f.alpha_s > 0 and f.beta_s_per_byte > 0 for f in profile.collectives)
    assert set(profile.peak_flops) == {"fp32", "bf16"}
    assert profile.optimizer_bytes_s and profile.overlap.compute_slowdown >= 1.0
    assert len(profile.op_times) > 200
    assert {(f.family, f.direction, f.dtype) for f in profile.op_fits} >= {
        (family, direction, dtype) for family in ("matmul", "memory", "Linear") for direction in ("fwd", "bwd")
        for dtype in ("fp32", "bf16")}


def test_datasheet_profiles_stay_marked_as_datasheets():
    profiles = available_profiles()
    for name in ("a100-sxm4-80gb", "h100-sxm-80gb", "v100-sxm2-32gb"):
        profile = load_profile(str(profiles[name]))
        assert profile.source == "datasheet" and profile.device_type == "cuda"


def _profile(**changes) -> DeviceProfile:
    return load_profile("a100-sxm4-80gb").model_copy(update=changes)


def test_compute_model_prefers_measured_then_dtype_fit_then_generic_then_roofline():
    op = OpRecord("fc", "Linear", "", ((1, 8, 16),), "bf16", fwd_flops=10**9, fwd_bytes=10**6, is_matmul=True,
                  variant="(in_features=16, out_features=32, bias=True)")
    fits = [
        OpFit(family="matmul", direction="fwd", work="flops", dtype=None, intercept_s=0.0, s_per_unit=4e-12),
        OpFit(family="matmul", direction="fwd", work="flops", dtype="bf16", intercept_s=0.0, s_per_unit=3e-12),
        OpFit(family="Linear", direction="fwd", work="flops", dtype="fp32", intercept_s=0.0, s_per_unit=9e-12),
        OpFit(family="Linear", direction="fwd", work="flops", dtype="bf16", intercept_s=1e-6, s_per_unit=1e-12),
    ]
    measured = [OpTiming(key=op.key, fwd_s=0.5, bwd_s=0.25)]
    assert ComputeModel(_profile(op_times=measured, op_fits=fits), "bf16").op_time_s(op, "fwd") == 0.5
    assert ComputeModel(_profile(op_fits=fits), "bf16").op_time_s(op, "fwd") == pytest.approx(1e-6 + 1e-3)
    assert ComputeModel(_profile(op_fits=fits[:3]), "bf16").op_time_s(op, "fwd") == pytest.approx(3e-3)
    assert ComputeModel(_profile(op_fits=fits[:1]), "bf16").op_time_s(op, "fwd") == pytest.approx(4e-3)
    roofline = ComputeModel(_profile(), "bf16").op_time_s(op, "fwd")
    assert roofline not in (0.5, 1e-6 + 1e-3, 3e-3, 4e-3) and roofline > 0


def test_a_fit_prices_ops_within_its_reach_and_leaves_larger_ones_to_the_next():
    """A kind measured only at small sizes (its points at the launch floor) has a slope that says nothing of a
    large op: beyond FIT_REACH times its largest point the generic family's fit prices it, else the roofline."""
    from cost_models.compute import FIT_REACH

    def mul(numel):
        return OpRecord("mul", "mul", "", ((numel,), (numel,)), "bf16", bwd_bytes=6 * numel)

    small, large = mul(10**4), mul(10**8)
    kind = OpFit(family="mul", direction="bwd", work="bytes", dtype="bf16", intercept_s=5e-5, s_per_unit=1e-10,
                 max_work=6e4)
    generic = OpFit(family="memory", direction="bwd", work="bytes", dtype="bf16", intercept_s=0.0, s_per_unit=3e-13,
                    max_work=6e9)
    model = ComputeModel(_profile(op_fits=[kind, generic]), "bf16")
    assert model.op_time_s(small, "bwd") == pytest.approx(5e-5 + 6e4 * 1e-10)  # the kind's own, within its reach
    assert model.op_time_s(large, "bwd") == pytest.approx(6e8 * 3e-13)  # 6e8 bytes: far beyond 8 x 6e4
    assert 6e8 > FIT_REACH * kind.max_work
    # a fit without a recorded reach (profiles made before it) prices every size, as it did
    unbounded = kind.model_copy(update={"max_work": None})
    assert ComputeModel(_profile(op_fits=[unbounded, generic]), "bf16").op_time_s(large, "bwd") == pytest.approx(
        5e-5 + 6e8 * 1e-10)
    # beyond every fit's reach: the roofline
    roofline = ComputeModel(_profile(op_fits=[kind]), "bf16").op_time_s(large, "bwd")
    assert roofline == pytest.approx(ComputeModel(_profile(), "bf16").op_time_s(large, "bwd"))


def test_collective_fit_bytes_are_the_full_buffer():
    fit = CollectiveFit(collective="all_gather", group_size=2, scope="intra_node", alpha_s=1e-4, beta_s_per_byte=1e-9)
    profile = _profile(collectives=[fit])
    from cost_models.comm import CommModel

    assert CommModel(profile).collective_s("all_gather", 1e6, 2, "intra_node") == pytest.approx(1e-4 + 1e-3)


def test_profile_without_fsdp_overheads_loads_with_zero_overheads_and_overlap(tmp_path):
    """Profiles written before the FSDP2 overhead fields load: nothing extra modelled, overlap on."""
    data = json.loads(load_profile("a100-sxm4-80gb").model_dump_json())
    for name in ("fsdp", "optimizer_tensor_s"):
        data.pop(name)
    data["overlap"].pop("enabled")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    profile = load_profile(str(path))
    assert profile.fsdp.unit_fwd_s == profile.fsdp.unit_bwd_s == profile.optimizer_tensor_s == 0.0
    assert profile.fsdp.compute_fwd_scale == profile.fsdp.compute_bwd_scale == 1.0
    assert profile.overlap.enabled


def test_shipped_cpu_profile_has_fsdp_overheads_and_no_overlap():
    profile = load_profile("cpu-gloo-2")
    assert not profile.overlap.enabled  # gloo on CPU: FSDP2 waits for each all-gather
    assert profile.fsdp.unit_fwd_s > 0 and profile.fsdp.unit_bwd_s > 0 and profile.optimizer_tensor_s > 0
    # calibrated on whole training steps: ops run slower inside a two-rank step than one at a time
    assert profile.fsdp.compute_fwd_scale > 1 and profile.fsdp.compute_bwd_scale > 1
    assert len(profile.fsdp.calibration["cases"]) == 20  # 5 plans x 2 depths x 2 micro-batches
    assert profile.fsdp.compute_recompute_scale > 1  # a checkpointed block's forward again, inside the backward
    for name in ("a100-sxm4-80gb", "h100-sxm-80gb", "v100-sxm2-32gb"):
        gpu = load_profile(name)
        assert gpu.overlap.enabled and 0 < gpu.fsdp.unit_fwd_s < 1e-4
