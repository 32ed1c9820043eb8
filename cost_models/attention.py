"""Which attention kernel runs an attention call, and what that kernel costs beyond torch's formulas.

A training step's attention runs one of three kernels, and they differ in what they keep for the
backward (the largest activation of a long sequence) and in what they compute:
- flash (FlashAttention; torch's SDPA flash backend, and flash-attn's kernel where torch's has no
  sliding window or soft-capping): saves q, k, v, the output and the log-sum-exp, O(S) per head;
  takes grouped/multi-query K and V unrepeated; causal and sliding-window masks are its own
  arguments, and a window's blocks outside the band are skipped. On CUDA it takes no other mask or
  bias, 16-bit inputs of one head size (at most 256). torch's CPU flash kernel takes any mask (and
  saves it) but no dropout and no soft-capping.
- efficient (the memory-efficient CUDA kernel): O(S) per head too, takes an additive mask or bias
  (saved for the backward, one per call), K and V repeated to the query heads; no soft-capping. The
  CPU has none.
- math (torch's composite, or a model's eager attention): saves the S x S scores; runs anything.

The default is what torch would pick on the device for the call (CUDA: flash where torch's own flash
kernel runs it, else efficient, else math; CPU: flash, else math). FLOPs are torch's FlopCounter
formulas (the full S x S square, causal or not, as FlopCounterMode counts them); a flash kernel with a
window W < S visits only the band, so its count is scaled by the band's share of the causal triangle.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.options import _Category

__all__ = ["AttentionKernel", "AttentionRefused", "AttentionSite", "KERNEL_ALIASES", "band_share", "choose_kernel",
           "flop_scale", "needs_flash_attn", "repeats_kv", "unsupported"]


class AttentionKernel(_Category):
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


# Hugging Face's attn_implementation names for the kernels (`sdpa`: torch's pick, the default)
KERNEL_ALIASES = {"eager": "math", "flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": None}
_SIXTEEN_BIT = ("bfloat16", "float16")
_FLASH_MAX_HEAD_DIM = 256


class AttentionRefused(ValueError):
    """The kernel asked for cannot run this attention call; the message says why."""


@dataclass(frozen=True)
class AttentionSite:
    """What decides an attention call's kernel and cost (per call, not per batch)."""

    heads: int
    kv_heads: int  # fewer than heads: grouped/multi-query K and V, as the call passes them
    head_dim: int
    v_head_dim: int
    q_len: int
    kv_len: int
    dtype: str  # torch dtype name without "torch.": "bfloat16"
    causal: bool = False
    window: int | None = None  # a causal sliding window shorter than kv_len (a longer one is plain causal)
    bias: str = ""  # an arbitrary additive mask or bias (it carries causality itself): "position bias", "mask"
    bias_grad: bool = False  # the bias is learned: its gradient is computed (T5's relative position bias)
    softcap: bool = False  # tanh soft-capping of the scores (Gemma-2)
    dropout: bool = False

    def describe(self) -> str:
        parts = ["causal" if self.causal else (self.bias or "bidirectional")]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.bias and self.causal:
            parts.append(self.bias)
        if self.bias_grad:
            parts[0 if not self.causal else -1] = "learned " + (self.bias or "mask")
        if self.softcap:
            parts.append("soft-capped")
        if self.kv_heads != self.heads:
            parts.append(f"K/V {self.kv_heads} of {self.heads} heads")
        if self.dropout:
            parts.append("dropout")
        return ", ".join(parts)


def band_share(length: int, window: int) -> float:
    """The (query, key) pairs a causal window of `window` keys visits, over the causal triangle's."""
    if window >= length:
        return 1.0
    band = window * (window + 1) // 2 + (length - window) * window
    return band / (length * (length + 1) // 2)


def unsupported(kernel: AttentionKernel | str, device: str, site: AttentionSite) -> str | None:
    """Why `kernel` cannot run `site` on `device` ("cuda" or "cpu"), or None when it can."""
    kernel = AttentionKernel(kernel)
    if kernel is AttentionKernel.MATH:
        return None
    if kernel is AttentionKernel.EFFICIENT:
        if device != "cuda":
            return "the memory-efficient kernel is CUDA's; torch's CPU attention is flash or math"
        if site.softcap:
            return "torch's memory-efficient kernel has no soft-capping (flash-attn's flash kernel has)"
        return None
    if site.head_dim != site.v_head_dim:
        return f"flash kernels take one head size for q, k and v (here {site.head_dim} and {site.v_head_dim})"
    if device != "cuda":
        if site.softcap:
            return "torch's CPU flash kernel has no soft-capping"
        if site.bias_grad:
            return f"torch's CPU flash kernel takes no mask that needs a gradient (this call's {site.bias} is learned)"
        if site.dropout:
            return "torch's CPU flash kernel takes no dropout"
        return None
    if site.bias:
        return f"flash kernels take no arbitrary mask or bias (this call has a {site.bias})"
    if site.dtype not in _SIXTEEN_BIT:
        return f"flash kernels run 16-bit inputs, not {site.dtype}"
    if site.head_dim > _FLASH_MAX_HEAD_DIM:
        return f"flash kernels take heads of at most {_FLASH_MAX_HEAD_DIM}, not {site.head_dim}"
    return None


def needs_flash_attn(kernel: AttentionKernel | str, device: str, site: AttentionSite) -> bool:
    """Flash on CUDA with a sliding window or soft-capping: flash-attn's kernel, which torch's flash lacks."""
    return AttentionKernel(kernel) is AttentionKernel.FLASH and device == "cuda" and (
        site.window is not None or site.softcap)


def choose_kernel(request: str | None, device: str, site: AttentionSite) -> AttentionKernel:
    """The kernel asked for (AttentionRefused when it cannot run the call), or torch's pick (None)."""
    if request is not None:
        why = unsupported(request, device, site)
        if why is not None:
            raise AttentionRefused(f"{request} attention cannot run this call ({site.describe()}): {why}")
        return AttentionKernel(request)
    for kernel in AttentionKernel:
        if unsupported(kernel, device, site) is None and not needs_flash_attn(kernel, device, site):
            return kernel
    return AttentionKernel.MATH


def flop_scale(kernel: AttentionKernel | str, device: str, site: AttentionSite) -> float:
    """The share of torch's FLOP count the kernel does: a CUDA flash kernel skips a window's outside blocks."""
    if AttentionKernel(kernel) is AttentionKernel.FLASH and device == "cuda" and site.window is not None:
        return band_share(site.kv_len, site.window)
    return 1.0


def repeats_kv(kernel: AttentionKernel | str, site: AttentionSite) -> bool:
    """Whether the kernel takes K and V repeated to the query heads (they are then copies it saves)."""
    return AttentionKernel(kernel) is AttentionKernel.EFFICIENT and site.kv_heads != site.heads
