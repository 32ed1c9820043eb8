"""Training batches for models whose forward takes named inputs (the plan's `--inputs` spec: T5's and BART's
input and decoder ids, ViT's pixel values, Whisper's features), and the loss they train with.

The spec the plan recorded (autoplan.models.inputs) gives each input's dtype and shape at the plan's
micro-batch and sequence length; `autoplan apply` makes them synthetic: integer inputs uniform in the model's
vocabulary (its largest embedding table; 0-1 for a boolean mask), floating inputs standard normal (in fp32:
FSDP2's mixed precision casts them as it casts token ids' embeddings). Each micro-batch is a fixed function of
(seed, step, data-parallel rank, micro-batch), so the ranks of a tensor-parallel group get the same inputs and
a resumed run the same batches. The loss is the one the planner traced (autoplan.models.loss): next-token
cross-entropy on logits [batch, seq, vocab] (against labels drawn with the inputs), cross-entropy over classes,
or the mean of hidden states.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.inputs import ModelInputs
from autoplan.models.loss import loss_kind, training_loss
from autoplan.run.tp import local_loss

__all__ = ["NamedInputs", "micro_batch_loss", "next_token_loss"]


def _vocab(model: nn.Module) -> int:
    """What an integer input indexes: the config's vocabulary, else the largest embedding table's rows."""
    config_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return config_vocab if isinstance(config_vocab, int) else max(tables, default=2)


def _generator(*numbers: int) -> torch.Generator:
    seed = 0
    for number in numbers:
        seed = (seed * 1_000_003 + number) % 2**62
    return torch.Generator().manual_seed(seed)


def next_token_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 over logits [B, S, V]: the loss the planner's tracer assumes."""
    logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    # vocabulary-parallel logits (a tensor-parallel plan) give a replicated DTensor: its local value
    return local_loss(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))


class NamedInputs:
    """Synthetic named inputs: `global_batch(step, shape)` names the step (nothing is made for other ranks),
    and `rank_micro_batches` makes a rank's micro-batches as ({name: tensor}, labels or None)."""

    def __init__(self, inputs: ModelInputs, model: nn.Module, seed: int = 0):
        self.inputs, self.seed = inputs, seed
        self.vocab_size = _vocab(model) if any(s.dtype.startswith("int") or s.dtype == "long"
                                               for s in inputs.specs) else 2

    def global_batch(self, step: int, shape) -> tuple[NamedInputs, int]:
        return self, step

    def micro_batch(self, step: int, rank: int, micro: int, shape) -> dict[str, torch.Tensor]:
        generator = _generator(self.seed, step, rank, micro, 0)
        made = {}
        for name, meta in self.inputs.at(shape.micro_batch_size, shape.seq_len, torch.float32).items():
            if meta.is_floating_point():
                made[name] = torch.randn(meta.shape, generator=generator)
            else:
                high = 2 if meta.dtype == torch.bool else self.vocab_size
                made[name] = torch.randint(0, high, meta.shape, generator=generator).to(meta.dtype)
        return made

    def labels_for(self, made: dict[str, torch.Tensor], step: int, rank: int, micro: int) -> torch.Tensor:
        """Next-token labels for logits over the sequence of the decoder's ids (else of the first input)."""
        ids = made.get("decoder_input_ids", next(iter(made.values())))
        generator = _generator(self.seed, step, rank, micro, 1)
        return torch.randint(0, self.vocab_size, ids.shape[:2], generator=generator)

    def rank_micro_batches(self, step: int, rank: int, shape) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        batches = []
        for micro in range(shape.grad_accum_steps):
            made = self.micro_batch(step, rank, micro, shape)
            batches.append((made, self.labels_for(made, step, rank, micro)))
        return batches


def micro_batch_loss(model: nn.Module, inputs, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The loss of one micro-batch: token ids and their next-token labels, or named inputs (keyword arguments)
    with the planner's loss for what the model returns (next-token cross-entropy against `labels` where it
    returns logits over a sequence)."""
    if not isinstance(inputs, dict):
        return next_token_loss(model(inputs.to(device)), labels.to(device))
    output = model(**{name: value.to(device) for name, value in inputs.items()})
    if loss_kind(output) == "next-token":
        return next_token_loss(output, labels.to(device))
    return local_loss(training_loss(output))
