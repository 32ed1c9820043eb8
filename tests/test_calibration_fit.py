"""The calibration fit (autoplan/profiling/calibration.py): whole-step times against their parts."""

import numpy as np
import pytest

import autoplan
from autoplan.api.traced import TracedModel
from autoplan.profiling.calibration import (
    CALIBRATION_DEPTHS,
    CALIBRATION_SEQ_LEN,
    PLAN_PROFILE,
    calibration_cases,
    calibration_model,
    fit_phase,
    uniform_plan,
)

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
    from autoplan.profiling.calibration import MAX_SCALE, MIN_SCALE

    residual_s = [0.06 * o + 0.01 * u for o, u in zip(OPS_S, UNITS)]  # each unit 10 ms of CPU, ops 2-16 ms
    fit = fit_phase(OPS_S, UNITS, CALLS, residual_s)
    assert fit.compute_scale == 1.0 and fit.unit_s > 0
    residual_s = [6.0 * o + 0.001 * u for o, u in zip(OPS_S, UNITS)]
    assert fit_phase(OPS_S, UNITS, CALLS, residual_s).compute_scale == 1.0
    assert MIN_SCALE < 1.4 < MAX_SCALE  # the first test's scale is fitted as it is


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_calibration_plans_are_the_uniform_plans_search_writes(device_type):
    """The calibration steps run plans built without a search: the same decisions, micro-batch and
    predictions as `autoplan search --strategy S [--checkpoint] --batch-size MB` on 2 ranks."""
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
        assert any(unit.checkpoint == "full" for unit in plan.units) == checkpoint
