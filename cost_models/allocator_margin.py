"""What torch's CUDA caching allocator needs beyond a plan's live bytes, by allocator configuration: the bound
a search plans to, and the figures a report prints.

Why: a CUDA run fails when the caching allocator cannot find or make a block, not when live tensors reach the
limit; how much more it needs depends on its configuration (`PYTORCH_CUDA_ALLOC_CONF`). With expandable
segments (torchtitan's default, and what `autoplan apply` runs CUDA ranks with unless told otherwise) each
stream's memory is one growing segment mapped in 2 MiB / 20 MiB pages, so a step needs its live bytes, a few
partly used pages per stream and kernel workspaces; natively each request of 10 MiB or more gets a segment of its
own and blocks of one size interleave with another's, so the need is 1-19% above the live bytes depending on
the plan. Both are measured by replaying real plans' allocation sequences through the allocator's models
(cost_models.allocator, cost_models.expandable_segments; benchmarks/allocator.py, benchmarks/RESULTS.md
section 11), and bounded here as `needed <= allocated x (1 + factor) + slack`, which keeps the search linear:
the solver plans the live bytes to `allocated_within(limit)`.

Three figures per plan: allocated (live bytes, the memory timeline's peak), needed (the smallest limit the step
runs in; what a plan is fitted to by default) and reserved (what torch.cuda.max_memory_reserved shows with
memory to spare: the allocator keeps freed segments cached until it runs short).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.allocator import FRAGMENTATION, SEGMENT_SLACK

__all__ = ["ALLOC_CONF_ENV", "DEFAULT_ALLOC_CONF", "Margin", "allocated_within", "is_expandable", "margin_of",
           "needed_bytes", "reserved_bytes"]

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class Margin:
    """needed <= allocated x (1 + factor) + slack; reserved (with memory to spare) <= allocated x reserved."""

    factor: float
    slack: int  # bytes: partly used pages and segments, and the kernel workspaces a replay cannot see
    reserved: float


# Expandable segments: replays of rank 0's step (benchmarks/allocator.py: uniform llama2-7b and llama3-8b plans at
# 4096-8192 tokens, 15-43 GiB, 4-layer 4 GiB models, and the plans the default search makes for gpt2-1.5b,
# llama2-7b and llama3-8b at three limits each) need 0.02-0.79 GiB above the live peak (1.001-1.030x; plans mixing
# selective checkpointing with none the most: llama2-7b at 26.64 GiB needs 27.43 with the workspaces); factor and
# slack are the smallest pair that covers every replay, with the kernel workspaces (SEGMENT_SLACK) on top.
# Reserved with memory to spare: at most 1.41x. Native: the worst replay's 1.185x (cost_models.allocator.
# FRAGMENTATION), reserved at most 1.57x.
_MARGINS = {
    True: Margin(factor=0.025, slack=(144 << 20) + SEGMENT_SLACK, reserved=1.45),
    False: Margin(factor=FRAGMENTATION, slack=SEGMENT_SLACK, reserved=1.6),
}


def is_expandable(conf: str) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value turns expandable segments on (torch's default: off). ValueError
    for a value torch would refuse."""
    expandable = False
    for option in filter(None, (part.strip() for part in conf.split(","))):
        key, _, value = option.partition(":")
        if not value:
            raise ValueError(f"{ALLOC_CONF_ENV} option {option!r} has no value (KEY:VALUE, comma-separated)")
        if key.strip() == "expandable_segments":
            if value.strip() not in ("True", "False"):
                raise ValueError(f"expandable_segments takes True or False, got {value.strip()!r}")
            expandable = value.strip() == "True"
    return expandable


def margin_of(conf: str) -> Margin:
    return _MARGINS[is_expandable(conf)]


def needed_bytes(allocated_bytes: int, conf: str) -> int:
    """The smallest limit a step with this allocated peak runs in under the configuration (an upper bound)."""
    margin = margin_of(conf)
    return math.ceil(allocated_bytes * (1 + margin.factor)) + margin.slack


def allocated_within(limit_bytes: int, conf: str) -> int:
    """The largest allocated peak whose needed bytes fit `limit_bytes` (0 where the margin alone passes it)."""
    margin = margin_of(conf)
    return max(0, math.floor((limit_bytes - margin.slack) / (1 + margin.factor)))


def reserved_bytes(allocated_bytes: int, conf: str) -> int:
    """At most what torch.cuda.max_memory_reserved shows for this allocated peak with memory to spare (never below
    what the step needs: with room, the allocator keeps what it took)."""
    return max(needed_bytes(allocated_bytes, conf), math.ceil(allocated_bytes * margin_of(conf).reserved))
