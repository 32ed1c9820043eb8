"""Affine fits time = intercept + slope * work, for op families (work: FLOPs or bytes) and collectives
(work: bytes; intercept = latency alpha, slope = per-byte cost beta).

The fit minimises the sum of absolute relative errors, sum(|a + b x - y| / y), with a, b >= 0:
- relative, because the points span four or more orders of magnitude in time, and an absolute-error
  fit would follow the largest points only and miss the small ops (most ops of a small model) by
  several times over;
- absolute rather than squared (a median-like fit), because a few points sit far off any line for
  reasons the work count does not see (an embedding's bytes count its whole table though it reads
  a few rows; a kernel with a slow path at small sizes), and a squared loss lets them pull the line
  away from all the others. Solved by iteratively reweighted least squares.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from cost_models.profile import OpFit

IRLS_ITERATIONS = 50
IRLS_MIN_RESIDUAL = 1e-3  # caps a point's weight: an exact fit of one point must not take over


@dataclass(frozen=True)
class AffineFit:
    intercept: float
    slope: float

    def predict(self, work: float) -> float:
        return self.intercept + self.slope * work


def fit_affine(work: Iterable[float], seconds: Iterable[float]) -> AffineFit:
    """Non-negative intercept and slope minimising the sum of absolute relative errors."""
    x = np.asarray(list(work), dtype=float)
    y = np.asarray(list(seconds), dtype=float)
    if len(x) == 0 or len(x) != len(y) or np.any(y <= 0) or np.any(x < 0):
        raise ValueError("fit_affine needs matching, non-empty points with positive times and non-negative work")
    weights = np.ones_like(y)
    fit = _weighted_fit(x, y, weights)
    for _ in range(IRLS_ITERATIONS):
        # weight 1/|r| turns the squared loss sum(w r^2) into sum(|r|) at the fixed point
        weights = 1.0 / np.maximum(np.abs((fit.predict(x) - y) / y), IRLS_MIN_RESIDUAL)
        refit = _weighted_fit(x, y, weights)
        converged = np.isclose(refit.intercept, fit.intercept, rtol=1e-6, atol=0.0) and np.isclose(
            refit.slope, fit.slope, rtol=1e-6, atol=0.0)
        fit = refit
        if converged:
            break
    return fit


def _weighted_fit(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> AffineFit:
    """argmin sum(w ((a + b x - y) / y)^2) over a, b >= 0."""
    root = np.sqrt(weights)
    if len(np.unique(x)) >= 2:
        design = np.stack([root / y, root * x / y], axis=1)
        (intercept, slope), *_ = np.linalg.lstsq(design, root, rcond=None)
        if intercept >= 0 and slope >= 0:
            return AffineFit(float(intercept), float(slope))
    # a constraint is active: fit the one remaining parameter alone, keep the better of the two
    candidates = [AffineFit(0.0, _through_origin(x / y, weights)), AffineFit(_through_origin(1.0 / y, weights), 0.0)]
    return min(candidates, key=lambda fit: float(np.sum(weights * ((fit.predict(x) - y) / y) ** 2)))


def _through_origin(scaled: np.ndarray, weights: np.ndarray) -> float:
    """argmin_c sum(w (c s - 1)^2) over c >= 0."""
    denominator = float(np.sum(weights * scaled * scaled))
    return max(0.0, float(np.sum(weights * scaled)) / denominator) if denominator > 0 else 0.0


def relative_errors(fit: AffineFit, work: Iterable[float], seconds: Iterable[float]) -> list[float]:
    return [abs(fit.predict(w) - s) / s for w, s in zip(work, seconds)]


HELDOUT_FOLDS = 5


def heldout_errors(work: list[float], seconds: list[float], folds: int = HELDOUT_FOLDS) -> list[float]:
    """|predicted - measured| / measured for each point, predicted by a fit to the other folds. Folds
    interleave the points in order of work, so every fold spans the whole range (no extrapolation)."""
    order = sorted(range(len(work)), key=lambda i: work[i])
    errors = []
    for fold in range(min(folds, len(work))):
        held = set(order[fold::folds])
        rest = [i for i in order if i not in held]
        if not rest:
            continue
        fit = fit_affine([work[i] for i in rest], [seconds[i] for i in rest])
        errors += [abs(fit.predict(work[i]) - seconds[i]) / seconds[i] for i in held]
    return errors


def leave_one_out_errors(work: list[float], seconds: list[float]) -> list[float]:
    """|predicted - measured| / measured for each point, predicted by a fit to all the other points."""
    errors = []
    for held in range(len(work)):
        rest_w = work[:held] + work[held + 1:]
        rest_s = seconds[:held] + seconds[held + 1:]
        if rest_w:
            fit = fit_affine(rest_w, rest_s)
            errors.append(abs(fit.predict(work[held]) - seconds[held]) / seconds[held])
    return errors


@dataclass(frozen=True)
class OpPoint:
    """One measured op in one direction: its kind, generic family, work and median time."""

    kind: str
    family: str  # "matmul" or "memory"
    dtype: str
    direction: str
    flops: int
    bytes: int
    seconds: float
    max_alloc_bytes: int = 0  # the op's largest allocation in this direction (compute.largest_alloc_bytes)

    def work(self, unit: str) -> int:
        return self.flops if unit == "flops" else self.bytes


@dataclass(frozen=True)
class FitReport:
    """One fitted family with its held-out quality: median and worst relative error of its points
    predicted by fits that did not see them (heldout_errors)."""

    fit: OpFit
    points: int
    heldout_median_rel_err: float | None
    heldout_max_rel_err: float | None


GENERIC_FAMILIES = ("matmul", "memory")
MIN_POINTS_PER_KIND = 2  # a single point fixes a ratio, not an intercept and a slope


def fit_op_families(points: list[OpPoint], fresh_alloc_bytes: int | None = None) -> list[FitReport]:
    """One fit per (op kind, direction, dtype) with enough points, and per (generic family, direction,
    dtype) over all points of that family. Work is FLOPs for matmul-like kinds, bytes otherwise.
    `fresh_alloc_bytes` (the CPU's mmap threshold; None on a GPU): each op kind also gets a fit over its
    points whose largest allocation is at least that, OpFit.min_alloc_bytes (their rate differs)."""
    groups: dict[tuple[str, str, str], list[OpPoint]] = defaultdict(list)
    for point in points:
        groups[(point.kind, point.direction, point.dtype)].append(point)
        if point.family != point.kind:  # torch.matmul's kind is "matmul" already
            groups[(point.family, point.direction, point.dtype)].append(point)
    reports = []
    for (family, direction, dtype), group in sorted(groups.items()):
        matmul_share = sum(p.family == "matmul" for p in group) / len(group)
        unit = "flops" if matmul_share >= 0.5 else "bytes"
        usable = [p for p in group if p.work(unit) > 0 and p.seconds > 0]
        subsets = [(0, usable)]
        # per op kind only: a generic family's large points mix kinds whose time is not set by their bytes
        # (a tied embedding's backward, about constant in the batch, gave "memory" a 50 ms intercept)
        if fresh_alloc_bytes and family not in GENERIC_FAMILIES:
            subsets.append((fresh_alloc_bytes, [p for p in usable if p.max_alloc_bytes >= fresh_alloc_bytes]))
        for min_alloc, subset in subsets:
            if len({p.work(unit) for p in subset}) < MIN_POINTS_PER_KIND:
                continue
            work = [float(p.work(unit)) for p in subset]
            seconds = [p.seconds for p in subset]
            fit = fit_affine(work, seconds)
            errors = heldout_errors(work, seconds) if len(subset) >= 3 else []
            reports.append(FitReport(
                OpFit(family=family, direction=direction, work=unit, dtype=dtype,
                      intercept_s=fit.intercept, s_per_unit=fit.slope, min_alloc_bytes=min_alloc,
                      max_work=max(work)),
                points=len(subset),
                heldout_median_rel_err=statistics.median(errors) if errors else None,
                heldout_max_rel_err=max(errors) if errors else None,
            ))
    return reports
