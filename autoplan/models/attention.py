"""How a model's attention runs: one path for the kernel autoplan prices and the kernel `apply` runs.

Every attention call ends in `F.scaled_dot_product_attention` (the zoo's, most models' own) or in a
Hugging Face attention function (`hf_attention`), and both reach `dispatch`. It describes the call
(cost_models.attention.AttentionSite: heads, lengths, causal, a sliding window, a bias, soft-capping)
and hands it to the executor in force: while tracing, the pricing one (autoplan.tracing.attention),
which runs the priced kernel on meta tensors; in `apply`, `RuntimeAttention`, which runs the same
kernel for real (torch's SDPA backend under `sdpa_kernel`, flash-attn's kernel for a window or
soft-capping on CUDA, the model's eager attention for soft-capped math) or refuses. Both prepare the
kernel's inputs with `kernel_inputs`, so what is priced is what runs.

A mask only says what it is when autoplan made it: Hugging Face's masks are built by the mask function
`autoplan.models.hf_attention` installs, which skips masks equal to plain causal attention (a sliding
window at least as long as the keys) and tags the causal and sliding-window masks it must build
(`tag_mask`). Any other mask is an arbitrary bias to the kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autoplan.errors import UsageError
from cost_models.attention import (
    AttentionKernel,
    AttentionRefused,
    AttentionSite,
    choose_kernel,
    needs_flash_attn,
    unsupported,
)

__all__ = ["SDPA", "SdpaCall", "MaskTag", "RuntimeAttention", "attention_executor", "cpu_refusal", "dispatch",
           "kernel_inputs", "mask_tag", "pending_site", "site_of", "tag_mask", "patched_sdpa"]

SDPA = F.scaled_dot_product_attention  # torch's own, whatever replaces the name while autoplan runs a model


@dataclass(frozen=True)
class MaskTag:
    """A mask autoplan built: causal (with a window) or bidirectional attention in mask form."""

    causal: bool
    window: int | None = None


_TAGS: dict[int, tuple[weakref.ref, MaskTag]] = {}


def tag_mask(mask: torch.Tensor, tag: MaskTag) -> torch.Tensor:
    key = id(mask)
    _TAGS[key] = (weakref.ref(mask, lambda _ref: _TAGS.pop(key, None)), tag)
    return mask


def mask_tag(mask: torch.Tensor | None) -> MaskTag | None:
    entry = _TAGS.get(id(mask)) if mask is not None else None
    return entry[1] if entry is not None and entry[0]() is mask else None


@dataclass
class SdpaCall:
    """The tensors of one attention call, as F.scaled_dot_product_attention takes them."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None  # a tagged structural mask, or a bias
    dropout_p: float = 0.0
    scale: float | None = None
    softcap: float | None = None
    eager: Callable | None = None  # the model's eager attention, for soft-capped math: () -> output [B, H, S, D]


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def site_of(call: SdpaCall, causal: bool, bias: str = "", window: int | None = None) -> AttentionSite:
    q, k, v = call.query, call.key, call.value
    tag = mask_tag(call.attn_mask)
    if tag is not None:
        causal, window = tag.causal, tag.window
    elif call.attn_mask is not None and not bias:
        bias = "mask"
    if window is not None and window >= k.shape[-2]:
        window = None
    return AttentionSite(heads=q.shape[-3], kv_heads=k.shape[-3], head_dim=q.shape[-1], v_head_dim=v.shape[-1],
                         q_len=q.shape[-2], kv_len=k.shape[-2], dtype=_dtype_name(q), causal=causal,
                         window=window if causal else None, bias=bias,
                         bias_grad=bool(bias) and call.attn_mask is not None and call.attn_mask.requires_grad,
                         softcap=call.softcap is not None, dropout=call.dropout_p > 0)


_PENDING: contextvars.ContextVar[tuple[torch.Tensor, AttentionSite, SdpaCall] | None] = contextvars.ContextVar(
    "autoplan_pending_attention", default=None)
_EXECUTOR: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("autoplan_attention", default=None)
# the executors entered in any thread, innermost last: on CUDA autograd runs the backward, and with it a
# checkpointed unit's recomputed forward, in a thread of its own, which sees none of the forward's context
# variables; without this the recompute would run torch's own kernel choice (cuDNN where the forward ran flash)
_ENTERED: list[Callable] = []


@contextlib.contextmanager
def pending_site(site: AttentionSite, call: SdpaCall):
    """Tells the F.scaled_dot_product_attention call of `call.query` that comes next what it is."""
    token = _PENDING.set((call.query, site, call))
    try:
        yield
    finally:
        _PENDING.reset(token)


@contextlib.contextmanager
def attention_executor(executor: Callable):
    """`executor(site, call)` runs every attention call dispatched while this is entered."""
    token = _EXECUTOR.set(executor)
    _ENTERED.append(executor)
    try:
        yield
    finally:
        _ENTERED.remove(executor)
        _EXECUTOR.reset(token)


def _executor() -> Callable | None:
    """The executor entered in this thread, else the one entered last in any (an autograd thread's recompute)."""
    executor = _EXECUTOR.get()
    return executor if executor is not None or not _ENTERED else _ENTERED[-1]


def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention's signature: the call described, run by the executor in force."""
    executor = _executor()
    pending = _PENDING.get()
    if pending is not None and pending[0] is query:
        _, site, call = pending
        _PENDING.set(None)
    else:
        heads, kv_heads = query.shape[-3], key.shape[-3]
        grouped = enable_gqa or kv_heads == 1  # one K/V head broadcasts: multi-query attention
        if executor is None or (kv_heads != heads and not (grouped and heads % kv_heads == 0)):
            return SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        call = SdpaCall(query, key, value, attn_mask, dropout_p, scale)
        site = site_of(call, is_causal)
    if executor is None:
        raise RuntimeError("an autoplan attention function ran outside autoplan's attention executor")
    return executor(site, call)


@dataclass
class KernelInputs:
    """What the chosen kernel is called with."""

    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None  # bool or additive
    is_causal: bool
    enable_gqa: bool


def kernel_inputs(kernel: AttentionKernel, device: str, site: AttentionSite, call: SdpaCall) -> KernelInputs:
    """K, V and the mask as `kernel` takes them on `device`: flash drops a causal mask on CUDA (causality and
    a window are its arguments) and keeps only a window's mask on the CPU; efficient takes K and V repeated to
    the query heads; a causal call without a mask says so with is_causal."""
    key, value, mask = call.key, call.value, call.attn_mask
    structural = mask_tag(mask) is not None
    grouped = site.kv_heads != site.heads
    if structural and (site.window is None or (kernel is AttentionKernel.FLASH and device == "cuda")):
        mask = None
    if kernel is AttentionKernel.EFFICIENT and grouped:
        repeats = site.heads // site.kv_heads
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
        grouped = False
    return KernelInputs(key, value, mask, site.causal and mask is None, grouped)


_BACKENDS = {AttentionKernel.FLASH: "FLASH_ATTENTION", AttentionKernel.EFFICIENT: "EFFICIENT_ATTENTION",
             AttentionKernel.MATH: "MATH"}


class RuntimeAttention:
    """Runs each attention call with the kernel the plan priced: `request` (None: torch's pick) chosen as on
    `planned_device`, the device of the plan's profile. On the CPU, a CUDA kernel runs as torch's CPU flash
    kernel given that kernel's inputs (efficient: K and V repeated, the bias), which keeps what it keeps; a
    call that cannot run so here raises UsageError."""

    def __init__(self, request: str | None, planned_device: str, device: str):
        self.request, self.planned_device, self.device = request, planned_device, device
        self.kernels: dict[AttentionSite, AttentionKernel] = {}

    def kernel(self, site: AttentionSite) -> AttentionKernel:
        if site not in self.kernels:
            try:
                kernel = choose_kernel(self.request, self.planned_device, site)
            except AttentionRefused as exc:
                raise UsageError(f"the plan's attention: {exc}") from None
            why = cpu_refusal(kernel, site) if self.device != "cuda" else None
            if why is not None:
                raise UsageError(why)
            if needs_flash_attn(kernel, self.device, site) and not _flash_attn_available():
                raise UsageError(f"the plan prices flash attention with {site.describe()}, which runs in flash-attn's "
                                 "kernel (torch's flash kernel has no window or soft-capping); install flash-attn, or "
                                 "plan with `--attention efficient`")
            self.kernels[site] = kernel
        return self.kernels[site]

    def __call__(self, site: AttentionSite, call: SdpaCall) -> torch.Tensor:
        kernel = self.kernel(site)
        if kernel is AttentionKernel.MATH and call.eager is not None:
            return call.eager()
        if needs_flash_attn(kernel, self.device, site):
            return _flash_attn(site, call)
        inputs = kernel_inputs(kernel, self.device, site, call)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = kernel if self.device == "cuda" or kernel is AttentionKernel.MATH else AttentionKernel.FLASH
        with sdpa_kernel(getattr(SDPBackend, _BACKENDS[backend])):
            return SDPA(call.query, inputs.key, inputs.value, attn_mask=inputs.mask, dropout_p=call.dropout_p,
                        is_causal=inputs.is_causal, scale=call.scale, enable_gqa=inputs.enable_gqa)


def cpu_refusal(kernel: AttentionKernel | str, site: AttentionSite) -> str | None:
    """Why a call priced as `kernel` (for CUDA) cannot run as it on the CPU, whose flash kernel stands in for
    CUDA's fused ones; None when it can."""
    if AttentionKernel(kernel) is AttentionKernel.MATH:
        return None
    why = unsupported(AttentionKernel.FLASH, "cpu", site)
    return None if why is None else (f"the plan prices {site.describe()} attention as the {kernel} kernel, which on "
                                     f"the CPU would run in torch's flash kernel, and {why}: plan with a profile of "
                                     "this device or `--attention math`")


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_attn(site: AttentionSite, call: SdpaCall) -> torch.Tensor:
    """flash-attn's kernel for a window or soft-capping ([B, S, H, D] in and out)."""
    from flash_attn import flash_attn_func

    window = (site.window - 1, 0) if site.window is not None else (-1, -1)
    out = flash_attn_func(call.query.transpose(1, 2), call.key.transpose(1, 2), call.value.transpose(1, 2),
                          dropout_p=call.dropout_p, softmax_scale=call.scale, causal=site.causal, window_size=window,
                          softcap=call.softcap or 0.0)
    return out.transpose(1, 2)


@contextlib.contextmanager
def patched_sdpa():
    """F.scaled_dot_product_attention is `dispatch` while this is entered (apply's ranks)."""
    F.scaled_dot_product_attention = dispatch
    try:
        yield
    finally:
        F.scaled_dot_product_attention = SDPA
