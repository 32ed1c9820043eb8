"""A model's identity for plan files: its module tree and parameter shapes, hashed.

Two models with the same fingerprint accept the same plan: same module paths and types, same
parameter names and shapes (values and dtypes do not matter: a plan is made on the meta device).
"""

from __future__ import annotations

import hashlib

import torch.nn as nn


def model_structure(model: nn.Module) -> list[str]:
    """One line per module and per parameter, in registration order."""
    lines = [f"module {name or '<root>'} {type(module).__name__}" for name, module in model.named_modules()]
    lines += [f"param {name} {list(param.shape)}" for name, param in model.named_parameters()]
    return lines


def model_fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256("\n".join(model_structure(model)).encode())
    return "sha256:" + digest.hexdigest()
