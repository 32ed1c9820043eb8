"""Measuring a device for `autoplan profile`: op re-execution (ops), collectives (comm), overlap,
device micro-benchmarks (device), the link to host memory (host_link), fits (fit), a resumable cache
(cache), the op timings of a run (op_timings), the calibration steps (calibration) and the measurements
on the ranks (ranks), tied together in run; defaults holds what a profile measures by default and under `--quick`.

The names below are imported on first use, so that `autoplan.profiling.defaults` (plain data) can be
read without importing torch."""

from __future__ import annotations

__all__ = ["ProfileResult", "ProfileSettings", "measure_profile"]


def __getattr__(name: str):
    if name in __all__:
        from autoplan.profiling import run

        return getattr(run, name)
    raise AttributeError(f"module 'autoplan.profiling' has no attribute {name!r}")
