"""Fits: they recover a known model from noisy points and predict points held out from the fit.

Tolerances:
- synthetic points carry 5% multiplicative noise (lognormal, sigma 0.05). A fit over 30 points
  pins the line to ~1-2%, so a held-out point misses by about its own noise: below 3 sigma = 15%
  for every point (seeded, so the test is deterministic), and the parameters come back within 10%.
- real points (the shipped profile, measured on a shared 2-core machine) are noisier: the same op
  timed in two profile runs differs by ~10-20% (median), and an affine curve in FLOPs is a model of
  a kernel whose efficiency still grows with size. The median leave-one-out error of the matmul
  fits must stay under 25%, the level at which the fit, not the noise, would dominate a unit's time.
"""

import numpy as np
import pytest

from autoplan.profile_store import load_profile
from autoplan.profiling.fit import (
    AffineFit,
    OpPoint,
    fit_affine,
    fit_op_families,
    leave_one_out_errors,
    relative_errors,
)
from autoplan.profiling.ops import collect_cases, sweep_workload, unique_cases, zoo_workload

SYNTHETIC_NOISE = 0.05
HELDOUT_MAX_SYNTHETIC = 3 * SYNTHETIC_NOISE
PARAMETER_TOLERANCE = 0.10
REAL_MATMUL_HELDOUT_MEDIAN = 0.25


def _noisy_points(intercept, slope, work, seed=0):
    rng = np.random.default_rng(seed)
    truth = intercept + slope * work
    return truth * np.exp(rng.normal(0.0, SYNTHETIC_NOISE, size=len(work)))


@pytest.mark.parametrize("intercept, slope, smallest, largest", [
    (20e-6, 1 / 150e9, 1e3, 1e11),  # a CPU matmul: 20 us call overhead, 150 GFLOP/s, 1 kFLOP..100 GFLOP
    (100e-6, 1 / 1.5e9, 4e3, 6.4e7),  # a gloo all-gather: 100 us latency, 1.5 GB/s, 4 KB..64 MB
])
def test_fit_predicts_heldout_synthetic_points(intercept, slope, smallest, largest):
    work = np.geomspace(smallest, largest, 40)
    seconds = _noisy_points(intercept, slope, work)
    held = np.arange(len(work)) % 4 == 0
    fit = fit_affine(work[~held], seconds[~held])
    errors = relative_errors(fit, work[held], seconds[held])
    assert max(errors) < HELDOUT_MAX_SYNTHETIC, errors
    assert fit.intercept == pytest.approx(intercept, rel=PARAMETER_TOLERANCE)
    assert fit.slope == pytest.approx(slope, rel=PARAMETER_TOLERANCE)


def test_fit_keeps_parameters_non_negative():
    work = [1.0, 2.0, 4.0, 8.0]
    through_origin = fit_affine(work, [2.0, 4.0, 8.0, 16.0])
    assert through_origin.intercept == pytest.approx(0.0, abs=1e-12)
    assert through_origin.slope == pytest.approx(2.0)
    falling = fit_affine(work, [5.0, 4.9, 4.8, 4.7])  # noise around a constant: no negative slope
    assert falling.slope == 0.0 and falling.intercept == pytest.approx(4.85, rel=0.02)
    single = fit_affine([10.0], [5.0])
    assert single.predict(10.0) == pytest.approx(5.0)


def test_fit_rejects_bad_points():
    with pytest.raises(ValueError):
        fit_affine([], [])
    with pytest.raises(ValueError):
        fit_affine([1.0, 2.0], [1.0, 0.0])


def test_relative_fit_serves_small_and_large_points():
    # overhead-bound small ops and throughput-bound big ones: both within 10% of a noiseless line
    work = np.geomspace(1e4, 1e10, 12)
    fit = fit_affine(work, 10e-6 + work / 100e9)
    assert max(relative_errors(fit, work, 10e-6 + work / 100e9)) < 1e-6


def test_family_fits_group_by_kind_and_generic_family_per_dtype():
    points = [OpPoint("Linear", "matmul", dtype, "fwd", flops, 0, 1e-5 + flops / rate)
              for dtype, rate in (("fp32", 1e11), ("bf16", 1e12)) for flops in (1e6, 1e8, 1e10)]
    points += [OpPoint("gelu", "memory", "fp32", "fwd", 0, nbytes, 2e-6 + nbytes / 2e10)
               for nbytes in (1e4, 1e6, 1e8)]
    fits = {(r.fit.family, r.fit.direction, r.fit.dtype): r for r in fit_op_families(points)}
    assert set(fits) == {("Linear", "fwd", "fp32"), ("Linear", "fwd", "bf16"), ("matmul", "fwd", "fp32"),
                         ("matmul", "fwd", "bf16"), ("gelu", "fwd", "fp32"), ("memory", "fwd", "fp32")}
    assert fits[("Linear", "fwd", "fp32")].fit.work == "flops"
    assert fits[("gelu", "fwd", "fp32")].fit.work == "bytes"
    assert 1 / fits[("Linear", "fwd", "bf16")].fit.s_per_unit == pytest.approx(1e12, rel=1e-6)
    assert fits[("Linear", "fwd", "fp32")].heldout_max_rel_err < 1e-6


@pytest.fixture(scope="module")
def shipped_points():
    """(profile, fit points) for the shipped CPU profile's ops of the tiny models and sweep blocks."""
    profile = load_profile("cpu-gloo-2")
    measured = {t.key: t for t in profile.op_times}
    workloads = [zoo_workload(name, (1, 2)) for name in ("gpt2-tiny", "llama-tiny", "bert-tiny")]
    workloads += [sweep_workload(width, tokens) for width in (256, 512, 1024) for tokens in (512, 2048)]
    points = []
    for dtype in ("fp32", "bf16"):
        cases = unique_cases([case for w in workloads for case in collect_cases(w, dtype)])
        for case in cases:
            timing = measured.get(case.key)
            if timing is None:
                continue
            record = case.record
            for direction, seconds, flops, nbytes in (
                ("fwd", timing.fwd_s, record.fwd_flops, record.fwd_bytes),
                ("bwd", timing.bwd_s, record.bwd_flops, record.bwd_bytes),
            ):
                if seconds > 0:
                    family = "matmul" if record.is_matmul else "memory"
                    points.append(OpPoint(record.kind, family, dtype, direction, flops, nbytes, seconds))
    return profile, points


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_linear_fit_predicts_heldout_measured_points(shipped_points, dtype, direction):
    _, points = shipped_points
    linear = [p for p in points if p.kind == "Linear" and p.dtype == dtype and p.direction == direction]
    assert len(linear) >= 20, "the shipped profile should hold the tiny models' and sweep blocks' Linears"
    errors = leave_one_out_errors([float(p.flops) for p in linear], [p.seconds for p in linear])
    assert float(np.median(errors)) < REAL_MATMUL_HELDOUT_MEDIAN, sorted(errors)


def test_shipped_fits_reproduce_their_own_points(shipped_points):
    """The fits stored in the profile are the ones its points give (no stale or hand-edited fits)."""
    profile, points = shipped_points
    stored = {(f.family, f.direction, f.dtype): f for f in profile.op_fits if not f.min_alloc_bytes}
    for dtype in ("fp32", "bf16"):
        fit = stored[("Linear", "fwd", dtype)]
        linear = [p for p in points if p.kind == "Linear" and p.dtype == dtype and p.direction == "fwd"]
        errors = relative_errors(AffineFit(fit.intercept_s, fit.s_per_unit), [p.flops for p in linear],
                                 [p.seconds for p in linear])
        assert float(np.median(errors)) < REAL_MATMUL_HELDOUT_MEDIAN
