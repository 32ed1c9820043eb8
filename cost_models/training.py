"""What one training step is asked to do: the sequence length, the precision and the optimizer, and the
micro-batch. The cost tables, the sweep and the plan read these together; as records they travel as one
argument instead of a parameter list repeated in every function on the way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cost_models.options import OPTIMIZERS, PRECISIONS, OptimizerKind, Precision

__all__ = ["MicroBatch", "Training"]


@dataclass(frozen=True)
class Training:
    """The step's settings that do not change while a search sweeps micro-batches and meshes."""

    seq_len: int
    """tokens per sample"""

    dtype: str
    """training precision: a row of cost_models.options.PRECISIONS ("bf16-mixed", ...)"""

    optimizer: str
    """a row of cost_models.options.OPTIMIZERS ("adamw", ...)"""

    @property
    def precision(self) -> Precision:
        return PRECISIONS[self.dtype]

    @property
    def optimizer_kind(self) -> OptimizerKind:
        return OPTIMIZERS[self.optimizer]

    @property
    def compute_dtype(self) -> str:
        """The dtype the model computes in ("bf16-mixed" computes in bf16): what the model is traced in."""
        return self.precision.compute_dtype.value


class MicroBatch(NamedTuple):
    """Samples per rank per forward, and forwards per optimizer step (gradient accumulation)."""

    size: int
    grad_accum_steps: int = 1
