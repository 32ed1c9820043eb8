"""From what the user named to a module on the meta device: a zoo name (with overrides), a Hugging
Face config, a factory the user named, or a module object.

Only a name the user gave directly reaches `load_factory`; plans rebuild their model from the stored
config instead (`autoplan.run.apply.model_for_plan`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.models.config import UnknownModelError, get_config
from autoplan.models.factory import load_factory
from autoplan.models.hf import HF_PREFIX, build_hf_model
from autoplan.models.zoo import build_model

__all__ = ["ResolvedModel", "parse_zoo_spec", "resolve_model"]


@dataclass
class ResolvedModel:
    module: nn.Module  # on the meta device
    name: str
    config: dict | None
    max_seq_len: int | None = None  # the default sequence length, when the model says


def parse_zoo_spec(spec: str) -> tuple[str, dict[str, int | float | bool]]:
    """'gpt2-tiny[n_layers=4,d_model=128]' -> ('gpt2-tiny', {'n_layers': 4, 'd_model': 128})."""
    match = re.fullmatch(r"\s*([^\[\]]+?)\s*(?:\[(.*)\])?\s*", spec)
    if match is None:
        raise UsageError(f"cannot read model {spec!r}: write NAME or NAME[field=value,...], e.g. gpt2-tiny[n_layers=4]")
    overrides: dict[str, int | float | bool] = {}
    for item in filter(None, (part.strip() for part in (match.group(2) or "").split(","))):
        field, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"model override {item!r} in {spec!r} is not field=value")
        try:
            value = json.loads(text.strip().lower())
        except json.JSONDecodeError:
            raise UsageError(f"model override {item!r} in {spec!r}: {text!r} is not a number or true/false") from None
        overrides[field.strip()] = value
    return match.group(1), overrides


def resolve_model(model: str | nn.Module) -> ResolvedModel:
    """A zoo name, "hf:path/to/config.json" (or its directory), a "package.module:factory" spec, or a
    module object."""
    if isinstance(model, nn.Module):
        return ResolvedModel(model, type(model).__name__, None)
    if model.startswith(HF_PREFIX):
        built = build_hf_model(model[len(HF_PREFIX):])
        return ResolvedModel(built.module, model, None, built.max_seq_len)
    if ":" in model and "[" not in model:
        try:
            module = load_factory(model, device="meta")
        except (ValueError, ImportError) as exc:
            raise UsageError(f"cannot build model {model!r}: {exc}") from exc
        return ResolvedModel(module, model, None)
    name, overrides = parse_zoo_spec(model)
    try:
        config = get_config(name, **overrides)
    except UnknownModelError as exc:
        raise UsageError(str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise UsageError(f"cannot build {model!r}: {exc}") from exc
    return ResolvedModel(build_model(config, device="meta"), model, config.to_dict(), config.max_seq_len)
