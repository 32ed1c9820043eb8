"""A plan's attention kernels in `apply`: each attention call runs the kernel the plan priced.

The plan records the kernel asked for (`model.attention_request`; none: torch's pick) and, through its
profile, the device the choice was made for. While `planned_attention` is entered,
F.scaled_dot_product_attention is autoplan's dispatch (autoplan.models.attention) and a Hugging Face
model's attention and masks go through autoplan's functions (autoplan.models.hf_attention), so every
call is made with that kernel (torch's SDPA backend, flash-attn's kernel for a window or soft-capping on
CUDA, the model's eager attention for soft-capped math; on the CPU, torch's flash kernel with a CUDA
kernel's inputs), or refused with UsageError before it runs.
`check_attention` asks that of the plan's recorded calls before any rank starts.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from autoplan.errors import AutoplanError, UsageError
from autoplan.models.attention import RuntimeAttention, attention_executor, patched_sdpa
from autoplan.models.hf_attention import hf_attention_hooks
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile

__all__ = ["check_attention", "planned_attention", "planned_device"]


def planned_device(plan: Plan) -> str:
    """The device type of the plan's profile: the one its attention kernels were chosen for."""
    try:
        return load_profile(plan.cluster.profile).device_type
    except AutoplanError:
        return "cpu" if plan.cluster.profile.startswith("cpu") else "cuda"


def check_attention(plan: Plan, device: str) -> None:
    """UsageError when a kernel the plan records cannot run on `device` ("cuda" or "cpu"). On the CPU torch's
    flash kernel runs a CUDA fused kernel's calls with that kernel's inputs, except a learned bias, dropout and
    soft-capping (autoplan.models.attention.cpu_refusal)."""
    if device == "cuda":
        return
    for row in plan.model.attention:
        blocked = [what for token, what in (("learned", "bias that needs a gradient"), ("dropout", "dropout"),
                                            ("soft-capped", "soft-capping")) if token in row.detail]
        if row.kernel != "math" and blocked:
            raise UsageError(f"the plan prices {row.modules}'s attention ({row.detail}) as the {row.kernel} kernel; on "
                             f"the {device} torch's flash kernel would stand in for it, and it takes no "
                             f"{' or '.join(blocked)}: plan with a profile of this device or `--attention math`")


@contextlib.contextmanager
def planned_attention(plan: Plan, model: nn.Module, device: str):
    """`model`'s attention runs the plan's kernels on `device` while this is entered."""
    executor = RuntimeAttention(plan.model.attention_request, planned_device(plan), device)
    with patched_sdpa(), attention_executor(executor), hf_attention_hooks(model):
        yield
