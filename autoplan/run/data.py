"""Training batches for `autoplan apply`: synthetic tokens, or a local Alpaca-format JSON file.

Every rank builds the same global batch for a step and takes its own rows, so a run on N ranks sees
exactly the tokens a single process would see for the same global batch. Nothing is downloaded:
Alpaca text is tokenised as UTF-8 bytes (ids 0-255, folded into the vocabulary when it is smaller).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.fileio import loads_strict, read_input

ALPACA_FIELDS = ("instruction", "input", "output")
MAX_DATA_BYTES = 4 * 2**30  # read into memory whole; Alpaca itself is 22 MB
_SEPARATOR = 0  # token between records


@dataclass(frozen=True)
class BatchShape:
    micro_batch_size: int  # per rank
    grad_accum_steps: int
    world_size: int
    seq_len: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size


class SyntheticTokens:
    """Uniform random token ids, a fixed function of (seed, step)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.seed = seed

    def global_batch(self, step: int, shape: BatchShape) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab_size, (shape.global_batch_size, shape.seq_len + 1), generator=generator)


class AlpacaTokens:
    """Records of an Alpaca JSON file as one byte-token stream, read in consecutive windows."""

    def __init__(self, path: str | os.PathLike, vocab_size: int):
        self.path = Path(path)
        self.first_row = 0  # the row step 0 starts at (a resumed run's position: autoplan.run.resume)
        self.stream = torch.tensor(_alpaca_token_ids(self.path), dtype=torch.long) % vocab_size

    def global_batch(self, step: int, shape: BatchShape) -> torch.Tensor:
        window = shape.seq_len + 1
        if len(self.stream) < window:
            raise UsageError(
                f"{self.path} holds {len(self.stream)} tokens, fewer than one sequence of {window}; "
                "use a larger file or a shorter sequence length"
            )
        rows = shape.global_batch_size
        # Windows follow each other through the stream and wrap around at its end.
        starts = (torch.arange(rows) + step * rows + self.first_row) * window % (len(self.stream) - window + 1)
        return torch.stack([self.stream[start:start + window] for start in starts.tolist()])


def rank_micro_batches(global_tokens: torch.Tensor, rank: int, shape: BatchShape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) for each micro-batch of `rank`: rows [(m * world + rank) * mb, ...+ mb). Named inputs
    (autoplan.run.named_inputs, whose global batch is (source, step)) are made for the rank alone."""
    if isinstance(global_tokens, tuple):
        source, step = global_tokens
        return source.rank_micro_batches(step, rank, shape)
    batches = []
    for micro in range(shape.grad_accum_steps):
        start = (micro * shape.world_size + rank) * shape.micro_batch_size
        rows = global_tokens[start:start + shape.micro_batch_size]
        batches.append((rows[:, :-1], rows[:, 1:]))
    return batches


def _alpaca_token_ids(path: Path) -> list[int]:
    try:
        records = loads_strict(read_input(path, max_bytes=MAX_DATA_BYTES))
    except OSError as exc:
        raise UsageError(f"cannot read data file {path}: {exc.strerror or exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # bad JSON, a key twice, nested too deeply, not UTF-8
        raise UsageError(f"data file {path} is not UTF-8 JSON ({exc})") from exc
    if not isinstance(records, list) or not records:
        raise UsageError(f"data file {path} is not an Alpaca file: expected a non-empty JSON list of records")
    ids: list[int] = []
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not any(isinstance(record.get(f), str) for f in ALPACA_FIELDS):
            raise UsageError(
                f"data file {path}: record {index} is not an Alpaca record "
                f"(an object with string fields {', '.join(ALPACA_FIELDS)})"
            )
        text = "\n".join(record[f] for f in ALPACA_FIELDS if isinstance(record.get(f), str) and record[f])
        ids.extend(text.encode("utf-8"))
        ids.append(_SEPARATOR)
    return ids


def vocab_size_of(model: nn.Module) -> int:
    """The token vocabulary: a zoo model's config, else the largest embedding table."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    sizes = [module.num_embeddings for module in model.modules() if isinstance(module, nn.Embedding)]
    if not sizes:
        raise UsageError(
            f"cannot tell the vocabulary size of {type(model).__name__}: it has no nn.Embedding "
            "and no config.vocab_size; autoplan apply trains token-id language models"
        )
    return max(sizes)
