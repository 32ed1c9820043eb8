"""What a model's forward takes, when it is not token ids [batch, seq]: named inputs with named dimensions.

From the command line (`--inputs`) as a small spec or a JSON file, parsed as text (nothing is imported or
run):

    input_ids=int64[batch,seq] decoder_input_ids=int64[batch,128]
    pixel_values=float32[batch,3,224,224]
    {"input_features": {"dtype": "float32", "shape": ["batch", 128, 3000]},
     "decoder_input_ids": {"dtype": "int64", "shape": ["batch", "seq"]}}

Each input is a keyword argument of the forward. `batch` is the micro-batch (every input has it once),
`seq` the sequence length (`--seq-len`); other dimensions are sizes. Floating inputs are made in the
compute dtype, as FSDP2's mixed precision casts them. A model whose inputs have no `seq` dimension has
no sequence: its throughput is in samples/s only.

Hugging Face models whose forward does not take token ids alone get their inputs from their config
(`for_hf_model`): images [batch, channels, size, size] (ViT), log-mel features and decoder ids (Whisper),
encoder and decoder ids [batch, seq] (T5, BART).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from autoplan.errors import UsageError

__all__ = ["BATCH", "SEQ", "InputSpec", "ModelInputs", "for_hf_model"]

BATCH, SEQ = "batch", "seq"
_DTYPES = {"int64": torch.long, "long": torch.long, "int32": torch.int32, "int": torch.int32,
           "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bool": torch.bool}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ITEM = re.compile(r"\s*([^=\s;]+)\s*=\s*([A-Za-z0-9]+)\s*\[([^\]]*)\]\s*")


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str
    dims: tuple[int | str, ...]

    def text(self) -> str:
        return f"{self.name}={self.dtype}[{','.join(map(str, self.dims))}]"

    def tensor(self, batch: int, seq: int, float_dtype: torch.dtype) -> torch.Tensor:
        shape = [batch if d == BATCH else seq if d == SEQ else d for d in self.dims]
        dtype = _DTYPES[self.dtype]
        return torch.empty(shape, dtype=float_dtype if dtype.is_floating_point else dtype, device="meta")


def _spec(name: str, dtype: str, dims: list, where: str) -> InputSpec:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(f"{where}: input name {name!r} is not a keyword argument name")
    if dtype not in _DTYPES:
        raise UsageError(f"{where}: input {name}'s dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    parsed: list[int | str] = []
    for dim in dims:
        text = str(dim).strip()
        if text in (BATCH, SEQ):
            parsed.append(text)
        elif text.isdigit() and int(text) > 0 and not isinstance(dim, bool):
            parsed.append(int(text))
        else:
            raise UsageError(f"{where}: input {name}'s dimension {dim!r} is not `batch`, `seq` or a positive size")
    if parsed.count(BATCH) != 1:
        raise UsageError(f"{where}: input {name} needs the dimension `batch` once, e.g. {name}={dtype}[batch,...]")
    if parsed.count(SEQ) > 1:
        raise UsageError(f"{where}: input {name} names `seq` more than once")
    return InputSpec(name, dtype, tuple(parsed))


@dataclass(frozen=True)
class ModelInputs:
    specs: tuple[InputSpec, ...]

    @classmethod
    def parse(cls, text: str) -> ModelInputs:
        """A spec (`name=dtype[dims] ...`, separated by spaces or `;`) or the path of a JSON file of them."""
        text = str(text).strip()
        if not text:
            raise UsageError("`inputs` is empty: give name=dtype[batch,...] for each input, or a JSON file")
        if "=" not in text and "[" not in text:
            return cls._from_file(Path(text).expanduser())
        specs, rest = [], text
        while rest.strip(" ;"):
            match = _ITEM.match(rest.strip(" ;"))
            if match is None:
                raise UsageError(f"cannot read `inputs` at {rest.strip(' ;')!r}: write name=dtype[dims] per input, "
                                 "e.g. input_ids=int64[batch,seq] pixel_values=float32[batch,3,224,224]")
            specs.append(_spec(match.group(1), match.group(2), match.group(3).split(","), "`inputs`"))
            rest = rest.strip(" ;")[match.end():]
        return cls._checked(specs, "`inputs`")

    @classmethod
    def _from_file(cls, path: Path) -> ModelInputs:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise UsageError(f"`inputs` {str(path)!r} is neither an inputs spec (name=dtype[dims]) nor a readable "
                             f"file ({exc.strerror or exc}); example_inputs in Python may also be tensors (a tensor, "
                             "a tuple or a dict of them)") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"`inputs` file {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not data:
            raise UsageError(f"`inputs` file {path} must hold an object: input name -> "
                             '{"dtype": "int64", "shape": ["batch", "seq"]}')
        specs = []
        for name, entry in data.items():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or set(entry) - {"dtype", "shape"}:
                raise UsageError(f"`inputs` file {path}: input {name!r} must be "
                                 '{"dtype": "int64", "shape": ["batch", "seq"]} (dtype and shape only)')
            specs.append(_spec(name, str(entry.get("dtype", "int64")), entry["shape"], f"`inputs` file {path}"))
        return cls._checked(specs, f"`inputs` file {path}")

    @classmethod
    def _checked(cls, specs: list[InputSpec], where: str) -> ModelInputs:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise UsageError(f"{where} names an input twice: {', '.join(twice)}")
        return cls(tuple(specs))

    @property
    def has_sequence(self) -> bool:
        return any(SEQ in spec.dims for spec in self.specs)

    def text(self) -> str:
        return " ".join(spec.text() for spec in self.specs)

    def at(self, batch: int, seq: int, float_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Meta tensors of the inputs at this micro-batch and sequence length, keyword by name."""
        return {spec.name: spec.tensor(batch, seq, float_dtype) for spec in self.specs}


def _ids(name: str) -> InputSpec:
    return InputSpec(name, "int64", (BATCH, SEQ))


def for_hf_model(module: nn.Module) -> ModelInputs | None:
    """The inputs a transformers model takes beyond token ids alone, from its config; None: token ids."""
    config = getattr(module, "config", None)
    main = getattr(module, "main_input_name", "input_ids")
    if config is None:
        return None
    decoder = (_ids("decoder_input_ids"),) if getattr(config, "is_encoder_decoder", False) else ()
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3)
        return ModelInputs((InputSpec("pixel_values", "float32", (BATCH, channels, *size)),) + decoder)
    if main == "input_features":
        frames = 2 * getattr(config, "max_source_positions", 1500)  # Whisper's encoder takes exactly these
        mels = getattr(config, "num_mel_bins", 80)
        return ModelInputs((InputSpec("input_features", "float32", (BATCH, mels, frames)),) + decoder)
    if main == "input_ids" and decoder:
        return ModelInputs((_ids("input_ids"),) + decoder)
    return None
