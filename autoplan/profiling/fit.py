"""Affine fits time = intercept + slope * work, for op families (work: FLOPs or bytes) and collectives
(work: bytes; intercept = latency alpha, slope = per-byte cost beta).

Least squares on relative error, minimising sum(((a + b x - y) / y)^2) with a, b >= 0: the points
span four or more orders of magnitude in time, and an absolute-error fit would follow the largest
points only and miss the small ops (which are most ops of a small model) by several times over.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from autoplan.profiles import OpFit


@dataclass(frozen=True)
class AffineFit:
    intercept: float
    slope: float

    def predict(self, work: float) -> float:
        return self.intercept + self.slope * work


def fit_affine(work: Iterable[float], seconds: Iterable[float]) -> AffineFit:
    """Non-negative intercept and slope minimising squared relative error (see module docstring)."""
    x = np.asarray(list(work), dtype=float)
    y = np.asarray(list(seconds), dtype=float)
    if len(x) == 0 or len(x) != len(y) or np.any(y <= 0) or np.any(x < 0):
        raise ValueError("fit_affine needs matching, non-empty points with positive times and non-negative work")
    if len(np.unique(x)) >= 2:
        design = np.stack([1.0 / y, x / y], axis=1)
        (intercept, slope), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
        if intercept >= 0 and slope >= 0:
            return AffineFit(float(intercept), float(slope))
    # a constraint is active: fit the one remaining parameter alone, keep the better of the two
    slope_only = _through_origin(x / y)
    intercept_only = _through_origin(1.0 / y)
    candidates = [AffineFit(0.0, slope_only), AffineFit(intercept_only, 0.0)]
    return min(candidates, key=lambda fit: _sq_rel_error(fit, x, y))


def _through_origin(scaled: np.ndarray) -> float:
    """argmin_c sum((c * s - 1)^2) over c >= 0."""
    denominator = float(np.sum(scaled * scaled))
    return max(0.0, float(np.sum(scaled)) / denominator) if denominator > 0 else 0.0


def _sq_rel_error(fit: AffineFit, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum(((fit.intercept + fit.slope * x - y) / y) ** 2))


def relative_errors(fit: AffineFit, work: Iterable[float], seconds: Iterable[float]) -> list[float]:
    return [abs(fit.predict(w) - s) / s for w, s in zip(work, seconds)]


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

    def work(self, unit: str) -> int:
        return self.flops if unit == "flops" else self.bytes


@dataclass(frozen=True)
class FitReport:
    """One fitted family with its held-out quality: median and worst leave-one-out relative error."""

    fit: OpFit
    points: int
    heldout_median_rel_err: float | None
    heldout_max_rel_err: float | None


MIN_POINTS_PER_KIND = 2  # a single point fixes a ratio, not an intercept and a slope


def fit_op_families(points: list[OpPoint]) -> list[FitReport]:
    """One fit per (op kind, direction, dtype) with enough points, and per (generic family, direction,
    dtype) over all points of that family. Work is FLOPs for matmul-like kinds, bytes otherwise."""
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
        if len({p.work(unit) for p in usable}) < MIN_POINTS_PER_KIND:
            continue
        work = [float(p.work(unit)) for p in usable]
        seconds = [p.seconds for p in usable]
        fit = fit_affine(work, seconds)
        errors = leave_one_out_errors(work, seconds) if len(usable) >= 3 else []
        reports.append(FitReport(
            OpFit(family=family, direction=direction, work=unit, dtype=dtype,
                  intercept_s=fit.intercept, s_per_unit=fit.slope),
            points=len(usable),
            heldout_median_rel_err=statistics.median(errors) if errors else None,
            heldout_max_rel_err=max(errors) if errors else None,
        ))
    return reports
