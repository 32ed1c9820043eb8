"""Bytes per element of each tensor class under a training dtype setting."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    compute_dtype: str  # activations and gathered parameters ("bf16", "fp32")
    master_bytes: int  # sharded parameters and reduced gradients
    compute_bytes: int
    reduce_bytes: int  # gradient reduction dtype (FSDP2 MixedPrecisionPolicy.reduce_dtype)
    state_bytes: int  # each optimizer state element


PRECISIONS = {
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); fp32 master weights and AdamW states
    "bf16-mixed": Precision("bf16", master_bytes=4, compute_bytes=2, reduce_bytes=4, state_bytes=4),
    "bf16": Precision("bf16", master_bytes=2, compute_bytes=2, reduce_bytes=2, state_bytes=2),
    "fp32": Precision("fp32", master_bytes=4, compute_bytes=4, reduce_bytes=4, state_bytes=4),
}

# Optimizer states per parameter element, and the bytes of (param, grad, states) one step touches
# per element in units of master_bytes: AdamW reads p, g, m, v and writes p, m, v.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
OPTIMIZER_TOUCHES = {"adamw": 7, "adam": 7, "sgd": 3}
