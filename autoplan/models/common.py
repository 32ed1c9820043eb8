"""Pieces the zoo's model families share: weight initialisation and attention head reshapes."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["init_parameters", "split_heads", "merge_heads"]


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


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    # [B, S, n_heads * head_dim] -> [B, n_heads, S, head_dim]; unflatten needs no
    # batch/sequence sizes, which keeps fx tracing free of shape proxies.
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    # [B, n_heads, S, head_dim] -> [B, S, n_heads * head_dim]
    return x.transpose(1, 2).flatten(2)

