"""Where a model's repeated blocks are: the one question about a model's structure that the tracer (units,
block reuse) and the tensor-parallel layout (autoplan.models.tp_layout) both ask; and where a block keeps
its mixture-of-experts weights (stacked [experts, ...] in one module: the zoo's and transformers' experts)."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["expert_stacks", "largest_module_list", "params_of"]


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


def expert_stacks(block: nn.Module) -> list[str]:
    """Paths (relative to `block`) of the modules whose own parameters are experts' weights stacked along a
    first dimension of the experts (two or more tensors of 3 or more dimensions, sharing it)."""
    found = []
    for name, module in block.named_modules():
        stacked = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
        if name and len(stacked) >= 2 and len({p.shape[0] for p in stacked}) == 1 and stacked[0].shape[0] > 1:
            found.append(name)
    return found
