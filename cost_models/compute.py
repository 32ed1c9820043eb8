"""Compute time of one traced op: measured when the profile has it, else a per-family fit, else roofline.

Fits are tried most specific first: (op kind, direction, dtype), (generic family, direction, dtype),
then the same without a dtype (fits from older or dtype-agnostic profiles).

Roofline: time = max(FLOPs / (peak FLOP/s x matmul efficiency), bytes / (bandwidth x efficiency))
plus a per-op launch overhead (Williams et al., "Roofline", CACM 2009).
"""

from __future__ import annotations

from cost_models.profile import DeviceProfile
from cost_models.records import OpRecord


class ComputeModel:
    def __init__(self, profile: DeviceProfile, compute_dtype: str):
        self.profile = profile
        self.peak_flops = profile.peak_flops.get(compute_dtype) or min(profile.peak_flops.values())
        self.measured = {timing.key: timing for timing in profile.op_times}
        self.fits = {(fit.family, fit.direction, fit.dtype): fit for fit in profile.op_fits}

    def op_time_s(self, op: OpRecord, direction: str) -> float:
        flops = op.fwd_flops if direction == "fwd" else op.bwd_flops
        moved = op.fwd_bytes if direction == "fwd" else op.bwd_bytes
        if flops == 0 and moved == 0:
            return 0.0  # views and Python-level ops (getitem, size): no kernel runs
        timing = self.measured.get(op.key)
        if timing is not None:
            return timing.fwd_s if direction == "fwd" else timing.bwd_s
        family = "matmul" if op.is_matmul else "memory"
        for dtype in (op.dtype, None):
            for fit_family in (op.kind, family):
                fit = self.fits.get((fit_family, direction, dtype))
                if fit is not None:
                    return fit.intercept_s + fit.s_per_unit * (flops if fit.work == "flops" else moved)
        profile = self.profile
        flop_s = flops / (self.peak_flops * profile.matmul_efficiency)
        byte_s = moved / (profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency)
        return max(flop_s, byte_s) + profile.op_overhead_s
