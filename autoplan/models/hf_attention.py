"""Hugging Face attention through autoplan's attention path (autoplan.models.attention).

transformers picks an attention function and a mask function by the config's `_attn_implementation`.
`hf_attention_hooks` registers both under the name "autoplan" and points every model that dispatches
through transformers' AttentionInterface at them, for as long as it is entered (tracing, and `apply`'s
ranks):
- the mask function builds no mask where attention is plain causal or bidirectional without padding
  (as transformers' own SDPA path does), including a sliding window at least as long as the keys
  (equal to causal attention, which transformers still builds a mask for); a causal sliding-window mask
  it must build is tagged (autoplan.models.attention.tag_mask), so that the kernel knows its window;
- `hf_attention` receives what transformers passes (causality, `sliding_window`, `softcap`, a T5-style
  `position_bias`) and makes one F.scaled_dot_product_attention call of it, grouped K and V unrepeated,
  that the executor in force runs (soft-capped math as the model's own eager attention).
Models that call F.scaled_dot_product_attention themselves under "sdpa" (Falcon) keep it; their masks
come from the same mask function (installed under "sdpa" too while entered), so theirs are tagged too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoplan.models.attention import MaskTag, SdpaCall, mask_tag, pending_site, site_of, tag_mask

__all__ = ["HF_IMPLEMENTATION", "hf_attention", "hf_attention_hooks", "uses_attention_interface"]

HF_IMPLEMENTATION = "autoplan"


def _mask_structure(mask_function: Callable, local_size: int | None) -> MaskTag | None:
    """What a transformers mask function builds, when it is causal, sliding-window causal or bidirectional."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function is causal_mask_function:
        return MaskTag(causal=True)
    if mask_function is bidirectional_mask_function:
        return MaskTag(causal=False)
    cells = [c.cell_contents for c in (getattr(mask_function, "__closure__", None) or ())]
    parts = cells[0] if len(cells) == 1 and isinstance(cells[0], tuple) else ()
    names = {getattr(part, "__qualname__", "") for part in parts}
    if (len(parts) == 2 and causal_mask_function in parts and "sliding_window_overlay.<locals>.inner_mask" in names
            and isinstance(local_size, int)):
        return MaskTag(causal=True, window=local_size)
    return None


@dataclass(frozen=True)
class _MaskRequest:
    """What a mask interface is asked that decides whether a mask is needed: the query and key lengths and
    offsets, the mask function, a padding mask, the window (`local_size`) and whether vmap builds it."""

    q_length: int
    kv_length: int
    q_offset: int = 0
    kv_offset: int = 0
    mask_function: Callable | None = None
    attention_mask: torch.Tensor | None = None
    local_size: int | None = None
    use_vmap: bool = False

    @classmethod
    def of(cls, arguments: dict) -> _MaskRequest:
        return cls(**{name: arguments[name] for name in _MASK_REQUEST_FIELDS if name in arguments})

    def structure(self) -> MaskTag | None:
        """The mask's structure where it is plain (causal, sliding-window causal, bidirectional) over as many
        keys as queries without padding; None where transformers' own mask is needed."""
        if self.use_vmap or self.attention_mask is not None or self.q_offset or self.kv_offset or (
                self.q_length != self.kv_length):
            return None
        tag = _mask_structure(self.mask_function, self.local_size)
        if tag is not None and tag.window is not None and tag.window >= self.kv_length:
            return MaskTag(causal=True)  # the window covers every key: plain causal attention
        return tag


_MASK_REQUEST_FIELDS = tuple(field.name for field in dataclasses.fields(_MaskRequest))


def _structural_mask(**arguments):
    """transformers' sdpa_mask, without a mask where none is needed and with the causal ones tagged.
    transformers calls a mask interface with sdpa_mask's arguments by keyword; they are forwarded as given."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    arguments["mask_function"] = arguments.get("mask_function") or causal_mask_function
    tag = _MaskRequest.of(arguments).structure()
    if tag is None:
        return sdpa_mask(**arguments)
    skip = (arguments.get("allow_is_causal_skip", True) if tag.causal
            else arguments.get("allow_is_bidirectional_skip", False))
    if tag.window is None and skip:
        return None
    mask = sdpa_mask(**{**arguments, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
    return tag_mask(mask, tag) if mask is not None else None


def _eager(module: nn.Module) -> Callable | None:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


# signature: transformers' AttentionInterface (transformers calls it with these parameters)
def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 position_bias: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' AttentionInterface ([B, H, S, D] in, [B, S, H, D] out)."""
    q_length = query.shape[2]
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_length > 1
    bias = ""
    if position_bias is not None:  # as transformers' SDPA path: causality folded into the bias
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, causal and attention_mask is None,
                                                   query, key)
        causal, bias = False, "position bias"
    elif attention_mask is not None and mask_tag(attention_mask) is None:
        causal, bias = False, "mask"  # a mask autoplan did not build says all itself
    # a window comes from the mask (transformers' SDPA path ignores `sliding_window`); one at least as long as
    # the keys built none
    call = SdpaCall(query, key, value, attention_mask, dropout, scaling, softcap)
    site = site_of(call, causal, bias)
    eager = _eager(module)
    if softcap is not None and eager is not None:
        call.eager = lambda: eager(module, query, key, value, _additive(attention_mask, site, query, key), dropout,
                                   scaling=scaling, softcap=softcap, **kwargs)[0].transpose(1, 2)
    with pending_site(site, call):  # torch's name: a tracer or apply's ranks make it autoplan's dispatch
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _additive(mask: torch.Tensor | None, site, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The float mask an eager attention adds to its scores (transformers' eager masks are additive)."""
    if mask is None and site.causal:
        q, k = torch.arange(query.shape[2], device=query.device), torch.arange(key.shape[2], device=query.device)
        mask = (q[:, None] >= k[None, :])[None, None]
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device), torch.finfo(query.dtype).min)


def uses_attention_interface(model: nn.Module) -> bool:
    """Whether a transformers model picks its attention function by name (AttentionInterface). Asked of the
    model's own class: FSDP2's fully_shard swaps it for a subclass made in torch (FSDPFalconForCausalLM), and
    transformers answers by reading the source of the class's module, which would be torch's; Falcon, which
    calls SDPA itself and adds its mask in its eager branch, then ran that branch with a boolean mask."""
    own = next((cls for cls in type(model).__mro__ if not cls.__module__.startswith("torch.")), type(model))
    check = getattr(own, "_can_set_attn_implementation", None)
    return bool(check is not None and check())


def _configs(model: nn.Module) -> list:
    """The model's config and its modules' own (T5's stacks hold copies of it)."""
    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found.setdefault(id(config), config)
    return list(found.values())


@contextlib.contextmanager
def hf_attention_hooks(model: nn.Module):
    """`model` (a transformers model; anything else is left alone) runs its attention and builds its masks
    through autoplan while this is entered; its implementation is restored after."""
    if not _configs(model):
        yield
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(HF_IMPLEMENTATION, hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_IMPLEMENTATION, _structural_mask)
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    sdpa_mask_function = masks.get("sdpa")
    switched = [(config, config._attn_implementation) for config in _configs(model)
                if uses_attention_interface(model) and config._attn_implementation in ("sdpa", "eager", None)]
    masks["sdpa"] = _structural_mask
    for config, _ in switched:
        config._attn_implementation_internal = HF_IMPLEMENTATION  # this config only: its sub-configs are listed too
    try:
        yield
    finally:
        masks["sdpa"] = sdpa_mask_function
        for config, implementation in switched:
            config._attn_implementation_internal = implementation
