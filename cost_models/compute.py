"""Compute time of one traced op: measured when the profile has it, else a per-family fit, else roofline.

Fits are tried most specific first: (op kind, direction, dtype), (generic family, direction, dtype),
then the same without a dtype (fits from older or dtype-agnostic profiles). An op whose largest
allocation in that direction (largest_alloc_bytes) reaches a fit's `min_alloc_bytes` (a CPU profile's
fits over ops whose tensors are mapped fresh at each allocation) takes those first: a 32k-vocabulary
loss at micro-batch 6 ran 4.4x slower than the family's fit over mostly small ops predicted.

Roofline: time = max(FLOPs / (peak FLOP/s x matmul efficiency), bytes / (bandwidth x efficiency))
plus a per-op launch overhead (Williams et al., "Roofline", CACM 2009).
"""

from __future__ import annotations

import math

from cost_models.profile import DeviceProfile
from cost_models.records import OpRecord

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def largest_alloc_bytes(op: OpRecord, direction: str) -> int:
    """The largest single tensor the op allocates in one direction. Traced for the forward. For the
    backward the trace keeps the most it holds at once (bwd_live_bytes over bwd_in_bytes, a sum) and its
    parameters' gradients: the sum bounded by the largest forward tensor or input gradient (a loss's
    backward holds two fp32 copies of the logits, each the size of its forward's), or the parameter
    gradients if larger. A tied weight's gradient is not a parameter gradient of the op that makes it
    first (gpt2's LM head), so that op's backward counts as small here."""
    if direction == "fwd":
        return op.fwd_max_alloc_bytes
    largest_input = max((math.prod(shape) for shape in op.input_shapes), default=0) * _DTYPE_BYTES.get(op.dtype, 4)
    held = max(0, op.bwd_live_bytes - op.bwd_in_bytes)
    return max(min(held, max(op.fwd_max_alloc_bytes, largest_input)), op.param_grad_bytes)


class ComputeModel:
    def __init__(self, profile: DeviceProfile, compute_dtype: str):
        self.profile = profile
        self.peak_flops = profile.peak_flops.get(compute_dtype) or min(profile.peak_flops.values())
        self.measured = {timing.key: timing for timing in profile.op_times}
        self.fits = {(fit.family, fit.direction, fit.dtype): fit for fit in profile.op_fits if not fit.min_alloc_bytes}
        self.large_fits = {(fit.family, fit.direction, fit.dtype): fit for fit in profile.op_fits if fit.min_alloc_bytes}

    def op_time_s(self, op: OpRecord, direction: str) -> float:
        flops = op.fwd_flops if direction == "fwd" else op.bwd_flops
        moved = op.fwd_bytes if direction == "fwd" else op.bwd_bytes
        if flops == 0 and moved == 0:
            return 0.0  # views and Python-level ops (getitem, size): no kernel runs
        timing = self.measured.get(op.key)
        if timing is not None:
            return timing.fwd_s if direction == "fwd" else timing.bwd_s
        family = "matmul" if op.is_matmul else "memory"
        for fits in (self.large_fits, self.fits):
            for dtype in (op.dtype, None):
                for fit_family in (op.kind, family):
                    fit = fits.get((fit_family, direction, dtype))
                    if fit is not None and largest_alloc_bytes(op, direction) >= fit.min_alloc_bytes:
                        return fit.intercept_s + fit.s_per_unit * (flops if fit.work == "flops" else moved)
        profile = self.profile
        flop_s = flops / (self.peak_flops * profile.matmul_efficiency)
        byte_s = moved / (profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency)
        return max(flop_s, byte_s) + profile.op_overhead_s
