"""Measuring a device for `autoplan profile`: op re-execution (ops), collectives (comm), overlap,
device micro-benchmarks (device), fits (fit), a resumable cache (cache), the op timings of a run
(op_timings) and the calibration steps (calibration), tied together in run."""

from autoplan.profiling.run import ProfileResult, ProfileSettings, measure_profile

__all__ = ["ProfileResult", "ProfileSettings", "measure_profile"]
