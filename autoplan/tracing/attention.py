"""Attention priced as the kernel that will run it (cost_models.attention), while a model is traced.

On meta tensors F.scaled_dot_product_attention always takes torch's math path, which saves the S x S
scores; a model that passes a mask (Hugging Face's sliding-window models) or unrepeated K and V would be
priced as that even where a fused kernel runs it. Here every attention call reaches the model's
executor (autoplan.models.attention.dispatch) and is run as the kernel `AttentionPolicy` picks:
- flash as torch's CPU flash kernel on meta, which saves what flash kernels save (q, k, v, the output
  and the log-sum-exp, and a mask the CPU's is given), K and V unrepeated, a causal mask dropped (on CUDA
  causality and a window are the kernel's arguments); a CUDA flash kernel with a sliding window has its
  FLOPs scaled to the band it visits;
- efficient as its own meta kernel: the same, K and V repeated to the query heads, and the bias saved
  (and its gradient computed where it is learned);
- math as torch's composite (or the model's eager attention, for soft-capping), op by op.
The op's record says which (`OpRecord.attention`), and a kernel other than flash is part of its key, so
that a profile's timing of one kernel is not taken for another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoplan.errors import UsageError
from autoplan.models.attention import SDPA, SdpaCall, kernel_inputs
from autoplan.tracing.counting import CostMode
from autoplan.tracing.flops import EFFICIENT, FLASH_CPU
from cost_models.attention import (
    AttentionKernel,
    AttentionRefused,
    AttentionSite,
    choose_kernel,
    flop_scale,
    needs_flash_attn,
)

__all__ = ["AttentionPolicy", "DEVICES"]

DEVICES = ("cuda", "cpu")


@dataclass
class AttentionPolicy:
    """Which kernel prices each attention call: `request` (a kernel; None: torch's pick) on `device` ("cuda"
    or "cpu", the profile's). `sites` collects the calls seen, so that a trace can be reused for another
    device where every call would take the same kernel there (same_on)."""

    request: str | None = None
    device: str = "cuda"
    sites: set[AttentionSite] = field(default_factory=set)

    def key(self) -> tuple[str | None, str]:
        return self.request, self.device

    def kernel(self, site: AttentionSite, where: str) -> AttentionKernel:
        try:
            return choose_kernel(self.request, self.device, site)
        except AttentionRefused as exc:
            raise UsageError(f"{where}: {exc}. Give `attention` a kernel that runs it (or leave it out: the kernel "
                             "torch picks for each call)") from None

    def same_on(self, device: str) -> bool:
        """Whether every call seen prices the same on `device` as on this policy's."""
        for site in self.sites:
            try:
                other = choose_kernel(self.request, device, site)
            except AttentionRefused:
                return False
            mine = choose_kernel(self.request, self.device, site)
            if other != mine or flop_scale(mine, self.device, site) != flop_scale(other, device, site) or (
                    mine is AttentionKernel.FLASH and (site.bias or site.window is not None)):
                return False
        return True

    def executor(self, mode: CostMode):
        """The executor (autoplan.models.attention.attention_executor) for one trace under `mode`."""
        def run(site: AttentionSite, call: SdpaCall) -> torch.Tensor:
            record = mode.records[mode.current]
            kernel = self.kernel(site, f"attention in module {record.module or '<root>'!r}")
            self.sites.add(site)
            extra = " in flash-attn's kernel" if needs_flash_attn(kernel, self.device, site) else ""
            record.attention = f"{kernel}{extra}: {site.describe()}"
            scale = flop_scale(kernel, self.device, site)
            if kernel is not AttentionKernel.FLASH or scale != 1.0:
                record.variant += f"[{kernel}" + (f", window {site.window}" if scale != 1.0 else "") + "]"
            return _run(kernel, self.device, site, call, mode, scale)

        return run


def _run(kernel: AttentionKernel, device: str, site: AttentionSite, call: SdpaCall, mode: CostMode,
         scale: float) -> torch.Tensor:
    if kernel is AttentionKernel.MATH and call.eager is not None:
        return call.eager()
    inputs = kernel_inputs(kernel, device, site, call)
    if kernel is AttentionKernel.MATH:
        return SDPA(call.query, inputs.key, inputs.value, attn_mask=inputs.mask, dropout_p=call.dropout_p,
                    is_causal=inputs.is_causal, scale=call.scale, enable_gqa=inputs.enable_gqa)
    mask = inputs.mask
    if mask is not None and mask.dtype == torch.bool:  # as torch's SDPA hands a boolean mask to its kernels
        zero = torch.zeros((), dtype=call.query.dtype, device=mask.device)
        mask = torch.where(mask.logical_not(), float("-inf"), zero)
    if kernel is AttentionKernel.EFFICIENT:  # its own meta kernel: it saves the bias and computes its gradient
        q = call.query
        bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], inputs.key.shape[2]) if mask is not None else None
        return EFFICIENT(q, inputs.key, inputs.value, bias, True, call.dropout_p, inputs.is_causal, scale=call.scale)[0]
    mode.scale_next(scale)
    out, _logsumexp = FLASH_CPU(call.query, inputs.key, inputs.value, call.dropout_p, inputs.is_causal, attn_mask=mask,
                                scale=call.scale)
    return out
