"""The training loss autoplan plans (and profiles) a model with, from whatever its forward returns.

- Logits [batch, seq, vocab] (a tensor, the first element of a tuple, or a Hugging Face output's
  `logits`): next-token cross-entropy in fp32, as `apply` trains.
- A Hugging Face classification output's logits [batch, classes]: cross-entropy over the classes.
- Anything else (hidden states: a Hugging Face base model's `last_hidden_state`, a tensor of another
  shape): the mean of the output in fp32. Its backward sends a gradient into every element, as a real
  loss on the output would; what the loss itself costs is small either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["logits_of", "loss_kind", "training_loss"]


def logits_of(output) -> torch.Tensor:
    """The tensor the loss reads: `logits` where the output has them, else the output itself, its first
    element (a tuple) or its first value (a Hugging Face output without logits: the hidden states)."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    to_tuple = getattr(output, "to_tuple", None)
    if to_tuple is not None:
        return to_tuple()[0]
    raise TypeError(f"the model returned a {type(output).__name__}; autoplan's loss needs a tensor, a tuple whose "
                    "first element is one, or a Hugging Face output")


def loss_kind(output) -> str:
    """"next-token", "classes" or "mean" (see the module docstring)."""
    logits, named = logits_of(output), isinstance(getattr(output, "logits", None), torch.Tensor)
    if not named and not isinstance(output, (torch.Tensor, tuple, list)):
        return "mean"  # a Hugging Face output without logits: hidden states
    if logits.dim() == 3:
        return "next-token"
    return "classes" if logits.dim() == 2 and named else "mean"


def training_loss(output) -> torch.Tensor:
    logits, kind = logits_of(output), loss_kind(output)
    if kind == "next-token":
        labels = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    if kind == "classes":
        return F.cross_entropy(logits.float(), torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
    return logits.float().mean()
