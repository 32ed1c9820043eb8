"""Compute time of one traced op: measured when the profile has it, else a per-family fit, else roofline.

Fits are tried most specific first: (op kind, direction, dtype), (generic family, direction, dtype),
then the same without a dtype (fits from older or dtype-agnostic profiles). An op whose largest
allocation in that direction (largest_alloc_bytes) reaches a fit's `min_alloc_bytes` (a CPU profile's
fits over ops whose tensors are mapped fresh at each allocation) takes those first: a 32k-vocabulary
loss at micro-batch 6 ran 4.4x slower than the family's fit over mostly small ops predicted.

Roofline: time = max(FLOPs / (peak FLOP/s x matmul efficiency), bytes / (bandwidth x efficiency))
plus a per-op launch overhead (Williams et al., "Roofline", CACM 2009). Where the profile says how a
GPU's matmuls and attention kernels run (a datasheet profile's `matmul` and `attention`), two terms of
that roofline are finer:
- a matmul's efficiency depends on its shape (`matmul_shape_efficiency`: tile and wave quantization of
  its M x N output over the SMs; a backward is two products, the input's gradient (M x K) and the
  weight's (N x K), each at its own shape);
- a fused attention kernel runs at its own measured rate (forward and backward together, by sequence
  length and head size), on the FLOPs it computes: a causal mask's half.
"""

from __future__ import annotations

import bisect
import math

from cost_models.profile import AttentionRate, DeviceProfile, MatmulShape
from cost_models.records import OpRecord

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ATTENTION_KINDS = ("scaled_dot_product_attention",)
# how far past its largest point a fit prices an op (OpFit.max_work): a profile's workloads are a model's shapes
# at its micro-batches, so the ops of the same model at a few times the batch stay on their fit
FIT_REACH = 8.0
_TENSOR_CORE_DTYPES = ("bf16", "fp16")  # the dtypes published attention rates are for
_SPLIT_K_DEPTH = 128  # the least reduction depth a split-K slice keeps (one K-tile of 128 rows)


def matmul_shape_efficiency(m: int, n: int, k: int, shape: MatmulShape) -> float:
    """The fraction of the full-wave rate an M x N (x K) product reaches: for each tile size cuBLAS may
    take, the useful share of the tile slots its waves occupy (tile quantization: edge tiles computed in
    full; wave quantization: the last wave's idle SMs), the best of them. A product with fewer tiles than
    SMs is split along K (split-K) into as many slices as fill a wave, each at least one K-tile deep."""
    best = 0.0
    for tile_m, tile_n in shape.tiles:
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
        splits = max(1, min(shape.sm_count // tiles, k // _SPLIT_K_DEPTH)) if tiles < shape.sm_count else 1
        slots = math.ceil(tiles * splits / shape.sm_count) * shape.sm_count
        best = max(best, m * n * splits / (slots * tile_m * tile_n))
    return best


def matmul_dims(op: OpRecord) -> tuple[int, int, int] | None:
    """(M, N, K) of a matmul op's forward product: its first input's rows (all leading dims) by its last
    dim K, and N from the FLOPs (2 M N K). None where the op does not read as one product."""
    if not op.input_shapes or len(op.input_shapes[0]) < 2 or not op.fwd_flops:
        return None
    k = op.input_shapes[0][-1]
    m = math.prod(op.input_shapes[0][:-1])
    n = round(op.fwd_flops / (2 * m * k)) if m and k else 0
    return (m, n, k) if n >= 1 else None


def attention_rate(rates: list[AttentionRate], head_dim: int, seq_len: int, causal: bool) -> float | None:
    """Forward + backward FLOP/s of a fused attention kernel at this shape: the measured rates of the nearest
    head size with this mask, interpolated in log2 of the sequence length (held at the ends)."""
    same = [r for r in rates if r.causal == causal] or rates
    if not same:
        return None
    nearest = min({r.head_dim for r in same}, key=lambda d: (abs(math.log2(d) - math.log2(head_dim)), -d))
    points = sorted((math.log2(r.seq_len), r.flops_s) for r in same if r.head_dim == nearest)
    x = math.log2(max(seq_len, 1))
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _launches(op: OpRecord, direction: str) -> bool:
    """Whether the op runs a kernel in that direction (views and Python-level ops run none)."""
    return bool(op.fwd_flops or op.fwd_bytes) if direction == "fwd" else bool(op.bwd_flops or op.bwd_bytes)


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

    def ops_time_s(self, ops: list[OpRecord], direction: str, scale: float = 1.0) -> float:
        """A unit's ops in one direction, scaled to how they run inside a step (FsdpOverhead). On a GPU the CPU
        issues each op's kernels while earlier ones run: the ops take the longer of their kernels and the CPU's
        issuing them (`op_overhead_s` an op), which is what small units are bound by. On the CPU they add."""
        if self.profile.device_type != "cuda":
            return scale * sum(self.op_time_s(op, direction) for op in ops)
        kernels = sum(self.op_time_s(op, direction, launch=False) for op in ops)
        launched = sum(1 for op in ops if _launches(op, direction))
        return max(scale * kernels, launched * self.profile.op_overhead_s)

    def op_time_s(self, op: OpRecord, direction: str, launch: bool = True) -> float:
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
                    amount = flops if fit is not None and fit.work == "flops" else moved
                    if fit is not None and largest_alloc_bytes(op, direction) >= fit.min_alloc_bytes and (
                            fit.max_work is None or amount <= FIT_REACH * fit.max_work):
                        return fit.intercept_s + fit.s_per_unit * amount
        profile = self.profile
        flop_s = self._attention_s(op, direction) if op.kind in ATTENTION_KINDS else None
        if flop_s is None:
            flop_s = flops / (self.peak_flops * profile.matmul_efficiency * self._shape_factor(op, direction))
        byte_s = moved / (profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency)
        return max(flop_s, byte_s) + (profile.op_overhead_s if launch else 0.0)

    def _shape_factor(self, op: OpRecord, direction: str) -> float:
        """A matmul's rate by shape over the flat `matmul_efficiency` (1 where the profile has no shape model).
        The backward's two products (the input's gradient, M x K; the weight's, N x K), each half its FLOPs."""
        shape, dims = self.profile.matmul, matmul_dims(op) if op.is_matmul else None
        if shape is None or dims is None:
            return 1.0
        m, n, k = dims
        full = self.profile.matmul_efficiency / shape.full_wave_efficiency  # the shape model's unit
        if direction == "fwd":
            return matmul_shape_efficiency(m, n, k, shape) / full
        inverse = (1 / matmul_shape_efficiency(m, k, n, shape) + 1 / matmul_shape_efficiency(n, k, m, shape)) / 2
        return 1 / (inverse * full)

    def _attention_s(self, op: OpRecord, direction: str) -> float | None:
        """A fused attention kernel's time at its measured rate (None: no rate for it; priced as a matmul).
        The rate is for forward and backward together, on the FLOPs the kernel computes (a causal mask's
        half); each direction takes its share of the FLOPs at that rate."""
        if not self.profile.attention or op.dtype not in _TENSOR_CORE_DTYPES or len(op.input_shapes) < 3:
            return None
        query = op.input_shapes[0]
        if len(query) < 2:
            return None
        causal = "is_causal=True" in op.variant
        rate = attention_rate(self.profile.attention, query[-1], query[-2], causal)
        flops = op.fwd_flops if direction == "fwd" else op.bwd_flops
        return flops * (0.5 if causal else 1.0) / rate if rate else None
