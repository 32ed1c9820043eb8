"""The op timings of a profile run: each op of the workloads timed (or read from the cache), the ones
far off their kind's fit timed again, and the results turned into fit points and OpTimings.

Kept apart from run.py, which ties the whole profile together (ops, device numbers, collectives,
calibration) and would otherwise hold every step of every measurement.
"""

from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from autoplan.profiling.cache import MeasurementCache
from autoplan.profiling.fit import OpPoint, fit_affine, fit_op_families
from autoplan.profiling.ops import OpCase, has_work, measure_case, work
from autoplan.profiling.timing import Repeats
from cost_models.compute import largest_alloc_bytes
from cost_models.profile import DeviceProfile, OpTiming

__all__ = ["REMEASURE_REL_ERR", "measure_ops", "remeasure_outliers", "points_and_timings", "add_new_ops"]

REMEASURE_REL_ERR = 0.3  # a fresh point this far off its kind's fit is timed again


def measure_ops(cases: list[OpCase], device: torch.device, repeats: Repeats, cache: MeasurementCache,
                progress: bool = True) -> tuple[dict[str, dict], set[str]]:
    """op key -> {"fwd_s", "bwd_s"} (None where not measurable), and the keys measured in this run."""
    seconds: dict[str, dict] = {}
    fresh: set[str] = set()
    for case in tqdm(cases, desc="ops", unit="op", disable=not progress):
        key = f"op:{case.key}"
        if key not in cache:
            result = measure_case(case, device, repeats)
            cache.put(key, {"fwd_s": result.fwd_s, "bwd_s": result.bwd_s})
            fresh.add(case.key)
        seconds[case.key] = cache.get(key)
    return seconds, fresh


def remeasure_outliers(cases: list[OpCase], seconds: dict[str, dict], fresh: set[str], device: torch.device,
                       repeats: Repeats, cache: MeasurementCache, progress: bool = True) -> int:
    """Time again the ops measured in this run that sit far off their kind's fit, keeping the lower of
    the two medians: on a shared machine a neighbour's burst can cover a whole measurement (all its
    repeats), and only a second measurement, later, tells that apart from an op that is really slow.
    Updates `seconds` in place; returns how many ops were re-measured."""
    series: dict[tuple[str, str, str], list[tuple[str, float, float]]] = {}
    for case in cases:
        record = case.record
        unit = "flops" if record.is_matmul else "bytes"
        for direction in ("fwd", "bwd"):
            value, amount = seconds[case.key][f"{direction}_s"], work(record, direction, unit)
            if value and amount:
                series.setdefault((record.kind, direction, record.dtype), []).append((case.key, amount, value))
    suspects: set[str] = set()
    for points in series.values():
        if len(points) >= 3:
            fit = fit_affine([amount for _, amount, _ in points], [value for _, _, value in points])
            suspects |= {key for key, amount, value in points
                         if key in fresh and abs(fit.predict(amount) - value) / value > REMEASURE_REL_ERR}
    again = [case for case in cases if case.key in suspects]
    for case in tqdm(again, desc="re-measuring outliers", unit="op", disable=not progress):
        result = measure_case(case, device, repeats)
        entry = dict(seconds[case.key])
        for direction, value in (("fwd_s", result.fwd_s), ("bwd_s", result.bwd_s)):
            if value is not None and entry[direction] is not None:
                entry[direction] = min(entry[direction], value)
        cache.put(f"op:{case.key}", entry)
        seconds[case.key] = entry
    return len(again)


def points_and_timings(cases: list[OpCase], seconds: dict[str, dict]) -> tuple[list[OpPoint], list[OpTiming]]:
    """Fit points per measured direction, and an OpTiming for each op measured in every direction that
    has work (an op whose backward could not be re-run alone is left to the fits)."""
    points, timings = [], []
    for case in cases:
        record, times = case.record, seconds[case.key]
        complete = True
        for direction in ("fwd", "bwd"):
            if not has_work(record, direction):
                continue
            value = times[f"{direction}_s"]
            if value is None or value <= 0:
                complete = False
                continue
            points.append(OpPoint(
                kind=record.kind, family="matmul" if record.is_matmul else "memory", dtype=record.dtype,
                direction=direction, flops=record.fwd_flops if direction == "fwd" else record.bwd_flops,
                bytes=record.fwd_bytes if direction == "fwd" else record.bwd_bytes, seconds=value,
                max_alloc_bytes=largest_alloc_bytes(record, direction),
            ))
        if complete:
            timings.append(OpTiming(key=case.key, fwd_s=times["fwd_s"] or 0.0, bwd_s=times["bwd_s"] or 0.0))
    return points, timings


def add_new_ops(profile: DeviceProfile, cases: list[OpCase], device: torch.device, repeats: Repeats,
                fresh_alloc_bytes: int | None, select: Callable[[OpCase], bool] = lambda case: True,
                progress: bool = True) -> tuple[DeviceProfile, list[str]]:
    """`profile` with the selected ops of `cases` that it has no timing for measured, and the op fits it
    lacks added (fitted over the profile's timings and the new ones; `fresh_alloc_bytes` as in
    fit.fit_op_families), its own fits kept; and the keys measured. `cases` are the profile's workloads
    (run.op_cases with its settings). For a change that gives ops new keys (op_variant) or adds a kind of
    fit, without timing every op again; the rest of the profile (device numbers, collectives,
    calibration) stays as measured."""
    known = {timing.key: {"fwd_s": timing.fwd_s, "bwd_s": timing.bwd_s} for timing in profile.op_times}
    seconds, added = {}, []
    for case in tqdm(cases, desc="ops", unit="op", disable=not progress):
        if case.key in known:
            seconds[case.key] = known[case.key]
        elif select(case):
            result = measure_case(case, device, repeats)
            seconds[case.key] = {"fwd_s": result.fwd_s, "bwd_s": result.bwd_s}
            added.append(case.key)
    points, timings = points_and_timings([case for case in cases if case.key in seconds], seconds)
    new_times = {timing.key: timing for timing in timings if timing.key in added}
    op_times = list(profile.op_times) + [new_times[key] for key in added if key in new_times]
    has = {(fit.family, fit.direction, fit.dtype, fit.min_alloc_bytes) for fit in profile.op_fits}
    op_fits = list(profile.op_fits) + [
        report.fit for report in fit_op_families(points, fresh_alloc_bytes)
        if (report.fit.family, report.fit.direction, report.fit.dtype, report.fit.min_alloc_bytes) not in has]
    return profile.model_copy(update={"op_times": op_times, "op_fits": op_fits}), added
