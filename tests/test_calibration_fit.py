"""The calibration fit (autoplan/profiling/calibration_fit.py): whole-step times against their parts."""

import numpy as np
import pytest

import autoplan
from cost_models.profile import FsdpOverhead
from autoplan.api.traced import TracedModel
from autoplan.profiling.calibration import (
    CALIBRATION_DEPTHS,
    CALIBRATION_SEQ_LEN,
    PLAN_PROFILE,
    calibration_cases,
    calibration_model,
    uniform_plan,
)
from autoplan.profiling.calibration_fit import fit_phase

# shard / shard_keep / replicate-like cases: 2 and 4 blocks, two micro-batch sizes
OPS_S = [0.002, 0.008, 0.004, 0.016] * 3
UNITS = [3, 3, 5, 5] * 3
CALLS = [5, 5, 9, 9] + [3, 3, 5, 5] + [3, 3, 5, 5]


def test_recovers_compute_scale_unit_and_call_costs_from_noisy_steps():
    rng = np.random.default_rng(0)
    calls = [5, 5, 9, 9] + [3, 3, 5, 5] + [0, 0, 0, 0]  # forward all-gathers: none when replicated
    residual_s = [(1.4 * o + 0.003 * u + 0.001 * c) * (1 + rng.normal(0, 0.02))
                  for o, u, c in zip(OPS_S, UNITS, calls)]
    fit = fit_phase(OPS_S, UNITS, calls, residual_s)
    assert fit.compute_scale == pytest.approx(1.4, rel=0.1)
    assert fit.unit_s == pytest.approx(0.003, rel=0.25)
    assert fit.collective_s == pytest.approx(0.001, rel=0.3)
    assert fit.max_rel_err < 0.06


def test_never_fits_a_negative_coefficient():
    # steps that get cheaper with more units (a negative unit cost would fit best): none is fitted
    residual_s = [1.3 * o - 0.0002 * u for o, u in zip(OPS_S, UNITS)]
    fit = fit_phase(OPS_S, UNITS, CALLS, residual_s)
    assert fit.unit_s == 0.0 and fit.collective_s >= 0.0 and 1.0 < fit.compute_scale <= 1.3
    # compute that does not lengthen the step (launch-bound ops): the scale stays 1, the rest is per unit
    residual_s = [0.030 - o / 4 + 0.010 * (u - 3) for o, u in zip(OPS_S, UNITS)]
    fit = fit_phase(OPS_S, UNITS, CALLS, residual_s)
    assert fit.compute_scale == 1.0 and fit.unit_s + fit.collective_s > 0


def test_separates_the_recompute_of_checkpointed_units_from_the_backward():
    """Backward cases with and without checkpointing: the forward ops re-run in the backward get their
    own scale (they need not run at the backward ops' speed)."""
    rng = np.random.default_rng(1)
    bwd_ops = [2 * o for o in OPS_S] + [2 * o for o in OPS_S[:8]]
    recompute = [0.0] * 12 + OPS_S[:8]  # shard+ckpt and replicate+ckpt: every block's forward again
    units = UNITS + UNITS[:8]
    calls = CALLS + CALLS[:4] + CALLS[8:]
    residual_s = [(1.1 * b + 1.7 * r + 0.002 * u + 0.0015 * c) * (1 + rng.normal(0, 0.02))
                  for b, r, u, c in zip(bwd_ops, recompute, units, calls)]
    fit = fit_phase(bwd_ops, units, calls, residual_s, recompute_s=recompute)
    assert fit.compute_scale == pytest.approx(1.1, rel=0.1)
    assert fit.recompute_scale == pytest.approx(1.7, rel=0.15)
    assert fit.unit_s == pytest.approx(0.002, rel=0.3)
    # without checkpointed cases there is nothing to fit it on
    assert fit_phase(bwd_ops[:12], units[:12], calls[:12], residual_s[:12]).recompute_scale is None
    # recompute that costs nothing is not physical: held at the ops' own time, the rest refitted
    residual_s = [1.1 * b + 0.002 * u for b, u in zip(bwd_ops, units)]
    fit = fit_phase(bwd_ops, units, calls, residual_s, recompute_s=recompute)
    assert fit.recompute_scale == 1.0 and fit.compute_scale > 0


def test_a_scale_far_from_the_ops_own_time_is_held_at_one():
    """Steps bound by something else than their kernels (a GPU whose CPU issues a small model's ops slower than
    they run) fit a compute scale near 0 that would price a large model's ops at a tenth of their time: outside
    [MIN_SCALE, MAX_SCALE] the scale is held at 1 and the per-unit cost takes the rest."""
    from autoplan.profiling.calibration_fit import MAX_SCALE, MIN_SCALE

    residual_s = [0.06 * o + 0.01 * u for o, u in zip(OPS_S, UNITS)]  # each unit 10 ms of CPU, ops 2-16 ms
    fit = fit_phase(OPS_S, UNITS, CALLS, residual_s)
    assert fit.compute_scale == 1.0 and fit.unit_s > 0
    residual_s = [6.0 * o + 0.001 * u for o, u in zip(OPS_S, UNITS)]
    assert fit_phase(OPS_S, UNITS, CALLS, residual_s).compute_scale == 1.0
    assert MIN_SCALE < 1.4 < MAX_SCALE  # the first test's scale is fitted as it is


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_calibration_plans_are_the_uniform_plans_search_writes(device_type):
    """The calibration steps run plans built without a search: the same decisions, micro-batch and
    predictions as `autoplan search --strategy S [--checkpoint MODE] --batch-size MB` on 2 ranks."""
    traced = {depth: TracedModel(calibration_model(depth, device_type), seq_len=CALIBRATION_SEQ_LEN[device_type])
              for depth in CALIBRATION_DEPTHS}
    for strategy, checkpoint, depth, micro_batch in calibration_cases(device_type):
        plan = uniform_plan(traced[depth], strategy, checkpoint, 2, micro_batch)
        searched = autoplan.search(traced[depth], mem="1TB", gpus=2, batch_size=micro_batch, strategy=strategy,
                                   checkpoint=checkpoint, profile=PLAN_PROFILE, allow_over_device_mem=True)
        assert plan.units == searched.units and plan.training == searched.training
        assert plan.model == searched.model and plan.predicted == searched.predicted
        assert plan.cluster.world_size == searched.cluster.world_size and plan.cluster.profile == PLAN_PROFILE
        shardings = {unit.sharding for unit in plan.units}  # the root takes plain shard for shard_keep
        assert strategy in shardings and shardings <= {strategy, "shard"}
        assert {unit.checkpoint for unit in plan.units} - {"none"} == {checkpoint} - {"none"}  # not the root


def test_calibration_fit_recovers_a_per_op_cost_of_selective_blocks():
    """fit_calibration on steps made from its own parts with known costs: the selective plan's per-op cost comes
    back, and a profile measured before the selective case (its steps absent) fits none."""
    from autoplan.profile_store import load_profile
    from autoplan.profiling.calibration import case_key
    from autoplan.profiling.calibration_fit import fit_calibration

    bare = load_profile("cpu-gloo-2").model_copy(update={"fsdp": FsdpOverhead()})
    keys = {case_key(s, c, d, mb): (s, c) for s, c, d, mb in calibration_cases("cpu")}
    parts = fit_calibration(bare, {key: {"fwd": 1.0, "bwd": 1.0, "step": 1.0} for key in keys}, 2)["cases"]
    per_op = {"fwd": 40e-6, "bwd": 70e-6}

    def step(case, phase):
        recompute = 1.3 * case["ops_recompute_s"] if phase == "bwd" else 0.0
        return (case[f"comm_{phase}_s"] + 1.2 * case[f"ops_{phase}_s"] + recompute + 0.001 * case["units"]
                + per_op[phase] * case["selective_ops"])

    measured = {case_key(c["strategy"], c["checkpoint"], c["depth"], c["micro_batch"]):
                {"fwd": step(c, "fwd"), "bwd": step(c, "bwd"), "step": 0.01} for c in parts}
    assert any(c["selective_ops"] for c in parts) and not any(c["selective_ops"] for c in parts
                                                              if c["checkpoint"] != "selective")
    fitted = fit_calibration(bare, measured, 2)
    assert fitted["selective_fwd_s_per_op"] == pytest.approx(40e-6, rel=0.02)
    assert fitted["selective_bwd_s_per_op"] == pytest.approx(70e-6, rel=0.02)
    assert fitted["compute_recompute_scale"] == pytest.approx(1.3, rel=0.02)
    before = {key: times for key, times in measured.items() if keys[key][1] != "selective"}
    old = fit_calibration(bare, before, 2)
    assert old["selective_fwd_s_per_op"] == old["selective_bwd_s_per_op"] == 0.0
    assert len(old["cases"]) == len(parts) - 4 and old["compute_fwd_scale"] == pytest.approx(1.2, rel=0.02)


def test_the_selective_per_op_cost_is_fitted_against_its_twin_not_the_fits_misses():
    """A fit that misses every shard plan by 40% (its collectives priced wrong, as a rough profile's are) does not
    pass that miss into the selective cost: each selective step is taken against the same plan without
    checkpointing, where the two differ only by its recompute and the per-op cost."""
    from autoplan.profiling.calibration_fit import PhaseFit, fit_selective

    fit = PhaseFit(compute_scale=1.0, unit_s=0.0, collective_s=0.0, max_rel_err=0.4, recompute_scale=1.5)

    def case(ops_s, recompute_s, selective_ops, took_s):
        return {"ops_bwd_s": ops_s, "ops_recompute_s": recompute_s, "selective_ops": selective_ops, "units": 3,
                "calls_bwd": 6, "comm_bwd_s": 0.001, "measured": {"bwd": took_s + 0.001}}

    pairs = []
    for ops_s, n in ((0.004, 20), (0.016, 20), (0.008, 40), (0.032, 40)):
        twin_took = 1.4 * ops_s  # the fit says ops_s: 40% missed
        pairs.append((case(ops_s, 0.2 * ops_s, n, twin_took + 1.5 * 0.2 * ops_s + 50e-6 * n),
                      case(ops_s, 0.0, 0, twin_took)))
    assert fit_selective(fit, pairs, "bwd") == pytest.approx(50e-6)
    # a selective step no slower than its twin's recompute allows costs nothing per op, not a negative amount
    pairs = [(case(0.004, 0.001, 20, 0.0045), case(0.004, 0.0, 0, 0.0045))]
    assert fit_selective(fit, pairs, "bwd") == 0.0
