"""Hugging Face transformers models from a local config.json, built on the meta device.

`--model hf:PATH` (or `autoplan.search("hf:PATH", ...)`), where PATH is a directory holding
config.json or the JSON file itself. Nothing is downloaded: the config is read from disk and the
model is built on meta, so no weights exist. The model class is the config's `architectures[0]`
when it names one, else the masked-LM head for model types that have one (BERT, RoBERTa), else the
causal-LM head. The model is built in training mode.

A config must give the model's sizes (layers, widths, heads, vocabulary, experts, image and patch
sizes): transformers would fill a missing one with its default for the family (32 layers for llama),
which plans some other model, so a missing size is refused by name. A model with a learned position
table (GPT-2, BERT, OPT) cannot take a sequence longer than `max_position_embeddings`, which its config
must give; a RoPE or ALiBi model (llama, Falcon) has no table, the field is only its default sequence
length, and a config without it (Falcon-7B's) needs the sequence length given.

Needs the optional extra: pip install 'autoplan[hf]'.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.fileio import loads_strict, read_input

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"
# fields that size the model; one a config class takes (with a default) must be in the file
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
               "ffn_dim", "d_ff", "d_kv", "head_dim", "moe_intermediate_size", "encoder_layers", "decoder_layers",
               "encoder_ffn_dim", "decoder_ffn_dim", "encoder_attention_heads", "decoder_attention_heads",
               "num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
               "shared_expert_intermediate_size", "kv_lora_rank", "image_size", "patch_size", "num_mel_bins")
POSITIONS_FIELD = "max_position_embeddings"  # needed where it sizes a learned table (_check_positions_given)


@dataclass
class HFModel:
    module: nn.Module  # on the meta device
    config_file: Path
    architecture: str  # the transformers class built
    max_seq_len: int | None  # max_position_embeddings, the default sequence length for planning (if the file has it)
    max_positions: int | None  # the longest sequence it takes: max_position_embeddings with a learned table
    positions_note: str = ""  # why there is no default sequence length, where there is none


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise UsageError("hf: models need the transformers package: pip install 'autoplan[hf]'") from exc
    return transformers


def config_file(path: str | Path) -> Path:
    """PATH itself when it is a file, else PATH/config.json."""
    path = Path(path).expanduser()
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"no Hugging Face config at {file}: give a directory holding {CONFIG_FILE} or the file itself")
    return file


def load_hf_config(path: str | Path):
    """The transformers config in a local config.json; errors name the file and the field."""
    config, data, file, missing = _load(path)
    _refuse_missing(missing, data, file)
    return config


def _load(path: str | Path):
    """(config, the file's fields, the file, the size fields it leaves to transformers' defaults)."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = config_file(path)
    try:
        data = loads_strict(read_input(file))
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{file} is not UTF-8 text ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"{file} is not valid JSON: {exc}") from exc
    except ValueError as exc:  # a key given twice, nesting too deep
        raise UsageError(f"{file} is not a config this reads: {exc}") from exc
    if not isinstance(data, dict):
        raise UsageError(f"{file} holds a JSON {type(data).__name__}, not an object of config fields")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"{file}: field 'model_type' is missing; it names the model family (e.g. \"llama\", \"gpt2\")")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"{file}: field 'model_type' is {model_type!r}, a model type transformers "
                         f"{transformers.__version__} does not know")
    _check_sizes_valid(CONFIG_MAPPING[model_type], data, file)
    missing = _sizes_missing(CONFIG_MAPPING[model_type], data)
    try:
        return CONFIG_MAPPING[model_type].from_dict(data), data, file, missing
    except Exception as exc:  # transformers raises several types for a bad field value
        _refuse_missing(missing, data, file)
        raise UsageError(f"{file}: transformers cannot build a {model_type!r} config from it: "
                         f"{type(exc).__name__}: {exc}") from exc


def _sizes_missing(config_class, data: dict) -> list[tuple[str, object]]:
    """(name, default) of each size field the config class takes that the file leaves to its default."""
    try:
        parameters = inspect.signature(config_class.__init__).parameters
    except (TypeError, ValueError):
        return []
    aliases = getattr(config_class, "attribute_map", None) or {}
    missing = []
    for field in SIZE_FIELDS:
        name = aliases.get(field, field)  # how the class spells it (gpt2: n_layer)
        parameter = parameters.get(name)
        if parameter is None or parameter.default in (None, inspect.Parameter.empty):
            continue  # not this family's, derived from others (gpt2's n_inner), or required anyway
        if name not in data and field not in data:
            missing.append((name, parameter.default))
    return missing


def _refuse_missing(missing: list[tuple[str, object]], data: dict, file: Path) -> None:
    if missing:
        raise UsageError(f"{file}: the config does not give {', '.join(repr(n) for n, _ in missing)}; transformers "
                         f"would take its {data['model_type']!r} defaults ("
                         + ", ".join(f"{n}={d!r}" for n, d in missing) + "), the size of some other model. Add "
                         "them to the config")


def _positions_field(config) -> str:
    """The field that sizes a position table: max_position_embeddings, Whisper's max_target_positions."""
    return "max_target_positions" if isinstance(getattr(config, "max_target_positions", None), int) else POSITIONS_FIELD


def _check_sizes_valid(config_class, data: dict, file: Path) -> None:
    """UsageError naming a size field the file gives as something else than a whole number of at least 1
    (`num_hidden_layers: -3`), before transformers builds a model that fails somewhere less clear."""
    aliases = getattr(config_class, "attribute_map", None) or {}
    for field in (*SIZE_FIELDS, "num_key_value_heads"):
        for name in dict.fromkeys((field, aliases.get(field, field))):
            value = data.get(name)
            if value is None:
                continue  # not given (or null: the family's derived default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{file}: field {name!r} is {json.dumps(value)}; a model's sizes are whole numbers "
                                 "of at least 1")


def _position_table(module: nn.Module, config) -> int | None:
    """max_position_embeddings when the model holds a learned position-embedding table (GPT-2's wpe, BERT's
    position_embeddings, OPT's embed_positions), else None: RoPE and ALiBi models have no table to overrun."""
    limit = getattr(config, _positions_field(config), None)
    if not isinstance(limit, int):
        return None
    for name, sub in module.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(sub, nn.Embedding) and ("position" in leaf or leaf in ("wpe", "embed_positions")):
            return limit
    return None


def _model_class(config, file: Path):
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        name = architectures[0]
        model_class = getattr(transformers, name, None)
        if not isinstance(model_class, type) or not issubclass(model_class, nn.Module):
            raise UsageError(f"{file}: field 'architectures' names {name!r}, not a model class in transformers "
                             f"{transformers.__version__}")
        return model_class
    model_type = config.model_type
    name = MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise UsageError(f"{file}: model_type {model_type!r} has no causal- or masked-LM class; set field "
                         "'architectures' to the class to plan (e.g. [\"T5ForConditionalGeneration\"])")
    return getattr(transformers, name)


def build_hf_model(path: str | Path) -> HFModel:
    """The model a local config.json describes, on the meta device, in training mode."""
    config, data, file, missing = _load(path)
    # With the KV cache on, HF skips a packed-sequence check that reads tensor values (position ids),
    # which meta tensors do not have; training without padding takes the same (causal, fused) path.
    config.use_cache = True
    model_class = _model_class(config, file)
    try:
        with torch.device("meta"):
            module = model_class(config)
    except Exception as exc:  # e.g. hidden_size not a multiple of num_attention_heads
        raise UsageError(f"{file}: building {model_class.__name__} from it failed: {type(exc).__name__}: {exc}") from exc
    module.train()
    table = _position_table(module, config)
    given = _given(config, data, _positions_field(config))
    if table is not None and not given:  # it sizes a learned table; a RoPE or ALiBi model needs none
        missing.append((_spelled(config, _positions_field(config)), table))
    _refuse_missing(missing, data, file)
    max_seq_len = getattr(config, _positions_field(config), None) if given else None
    note = "" if given else (f"its config gives no {POSITIONS_FIELD} (a {config.model_type} model has no position "
                             "table to size: it takes any length)")
    return HFModel(module, file, model_class.__name__, max_seq_len if isinstance(max_seq_len, int) else None,
                   table, note)


def _spelled(config, field: str) -> str:
    """How the config's class spells a field (gpt2: n_positions)."""
    return (getattr(type(config), "attribute_map", None) or {}).get(field, field)


def _given(config, data: dict, field: str) -> bool:
    return field in data or _spelled(config, field) in data


def position_limit(module: nn.Module) -> int | None:
    """For a transformers model object: the longest sequence its learned position table takes (None: no table)."""
    config = getattr(module, "config", None)
    return _position_table(module, config) if config is not None else None


__all__ = ["HF_PREFIX", "HFModel", "build_hf_model", "load_hf_config", "position_limit"]
