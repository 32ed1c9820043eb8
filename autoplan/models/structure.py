"""Where a model's repeated blocks are: the one question about a model's structure that the tracer (units,
block reuse) and the tensor-parallel layout (autoplan.models.tp_layout) both ask."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["largest_module_list", "params_of"]


def params_of(module: nn.Module) -> int:
    """Parameters under `module` (each shared parameter once)."""
    return sum(p.numel() for p in module.parameters())


def largest_module_list(model: nn.Module) -> str | None:
    """The path of the ModuleList (of two or more modules) holding the most parameters: the blocks."""
    best, best_params = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            count = params_of(module)
            if count > best_params:
                best, best_params = name, count
    return best
