"""Pieces the zoo's model families share: weight initialisation, attention head reshapes, and building on the
meta device without initialising."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["buffers_to_meta", "init_parameters", "meta_init", "split_heads", "merge_heads"]

# Initialisers a module's constructor runs in place (nn.Embedding's normal_, trunc_normal_'s erfinv_ and clamp_)
# whose meta kernels are Python references that import torch's compiler stack (torch._dynamo: 2.3 s here, more
# than tracing gpt2-1.5b) the first time they run. On a meta tensor they change nothing: there are no values.
_VALUELESS_ON_META = {
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.erfinv_, torch.Tensor.clamp_, torch.Tensor.exponential_,
    torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.geometric_, torch.Tensor.random_,
    torch.Tensor.bernoulli_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
    nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.orthogonal_,
}


class meta_init(TorchFunctionMode):  # noqa: N801 - used as a context, like torch.device("meta")
    """Inside `torch.device("meta")`: the random initialisers of meta tensors return the tensor as it is (see
    _VALUELESS_ON_META), and `torch.arange` is made on the CPU, so that what a constructor computes from it (a
    RoPE table's frequencies: arange, a division, a power, whose meta kernels are such references too) is
    computed there, a few numbers; `buffers_to_meta` moves such buffers to meta afterwards. A model takes its
    shapes without importing the compiler stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.arange and kwargs.get("device") in (None, "meta", torch.device("meta")):
            return func(*args, **{**kwargs, "device": "cpu"})
        if func in _VALUELESS_ON_META:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes `tensor=`
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def init_parameters(root: nn.Module, std: float) -> None:
    """Normal(0, std) for linear/embedding weights, ones/zeros for norms, zero biases."""
    for module in root.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def buffers_to_meta(model: nn.Module) -> None:
    """Every buffer a constructor made on the CPU under `meta_init`, moved to the meta device (persistence kept)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = buffer.to("meta")


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    # [B, S, n_heads * head_dim] -> [B, n_heads, S, head_dim]; unflatten needs no
    # batch/sequence sizes, which keeps fx tracing free of shape proxies.
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    # [B, n_heads, S, head_dim] -> [B, S, n_heads * head_dim]
    return x.transpose(1, 2).flatten(2)

