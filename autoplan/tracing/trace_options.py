"""How one trace counts, besides the model and its shape: one record shared by both tracers.

The fx tracer and the dispatch tracer each run a model once under a cost mode (counting.CostMode). Three
things set how that run is counted, and they travel together from the trace's caller (tracer.trace_pair)
to both tracers: who is told of each op as it runs, which kernel each attention call is priced as, and the
capacity factor that scales expert matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoplan.models.attention import attention_executor
from autoplan.tracing.attention import AttentionPolicy
from autoplan.tracing.counting import CostMode
from cost_models.records import OpRecord

__all__ = ["TraceOptions"]


@dataclass(frozen=True)
class TraceOptions:
    """`progress` is told of each op as it runs (see counting.CostMode); `attention` picks each attention call's
    kernel (None: torch's pick on CUDA); `capacity_factor` scales expert matmuls."""

    progress: Callable[[OpRecord, bool], None] | None = None
    attention: AttentionPolicy | None = None
    capacity_factor: float = 1.0

    def cost_mode(self, records: dict[str, OpRecord]) -> CostMode:
        """The cost mode that counts into `records`."""
        mode = CostMode(records, self.progress)
        mode.expert_flop_scale = self.capacity_factor
        return mode

    def attention_executor(self, mode: CostMode):
        """Entered while the model runs: every attention call priced as the policy's kernel, under `mode`."""
        return attention_executor((self.attention or AttentionPolicy()).executor(mode))
