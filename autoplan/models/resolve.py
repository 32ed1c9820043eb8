"""From what the user named to a module on the meta device: a zoo name (with overrides), a Hugging Face
config, a factory the user named, or a module object; and from a plan file's model record to the model
it describes, without running any code the plan names.

Only a name the user gave directly reaches `load_factory`. A plan's model is rebuilt from the data in
it (`model_from_plan`): a zoo config, or a Hugging Face config.json found relative to the plan's folder;
a plan made from a factory needs the factory named again.

A model also says how long a sequence it can take (`max_positions`): the zoo models hold position
tables (GPT-2's and BERT's learned embeddings, llama's precomputed RoPE tables) of `max_seq_len` rows,
and Hugging Face models with a learned table take `max_position_embeddings`; `check_seq_len` refuses a
longer sequence before anything is traced.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from autoplan.errors import PlanFileError, UsageError
from autoplan.models.config import PRESETS, ROPE_FAMILIES, ModelConfig, UnknownModelError, get_config
from autoplan.models.factory import load_factory
from autoplan.models.hf import HF_PREFIX, build_hf_model, position_limit
from autoplan.models.inputs import ModelInputs, for_hf_model
from autoplan.models.zoo import build_model

__all__ = ["ResolvedModel", "check_seq_len", "model_from_plan", "parse_zoo_spec", "plan_hf_path", "resolve_model",
           "zoo_spec"]


@dataclass
class ResolvedModel:
    module: nn.Module  # on the meta device
    name: str
    config: dict | None
    max_seq_len: int | None = None  # the default sequence length, when the model says
    max_positions: int | None = None  # the longest sequence the model takes (its position table); None: not known
    positions_from: str = ""  # where max_positions comes from, for messages
    seq_len_note: str = ""  # why there is no default sequence length (a Hugging Face config without one)
    inputs: ModelInputs | None = None  # what its forward takes, when not token ids alone (Hugging Face models)


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


def zoo_spec(config: ModelConfig) -> str:
    """The shortest NAME[field=value,...] that gives `config`: the preset of its family it differs least from."""
    best = None
    for name, preset in PRESETS.items():
        if preset.family != config.family:
            continue
        diff = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if getattr(config, f.name) != getattr(preset, f.name)}
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    name, diff = best
    return name + (f"[{','.join(f'{k}={json.dumps(v)}' for k, v in diff.items())}]" if diff else "")


def _zoo(module: nn.Module, name: str, config: ModelConfig) -> ResolvedModel:
    what = "RoPE tables hold" if config.family in ROPE_FAMILIES else "position table holds"
    return ResolvedModel(module, name, config.to_dict(), config.max_seq_len, config.max_seq_len,
                         f"its max_seq_len: its {what} that many positions")


def _object(module: nn.Module, name: str) -> ResolvedModel:
    """A module object or a factory's: a zoo model says its positions by its config, a transformers model by its."""
    config = getattr(module, "config", None)
    if isinstance(config, ModelConfig):
        return dataclasses.replace(_zoo(module, name, config), config=None, max_seq_len=None)
    limit = position_limit(module) if config is not None else None
    return ResolvedModel(module, name, None, None, limit,
                         "its config's max_position_embeddings: its learned position table" if limit else "",
                         inputs=for_hf_model(module) if config is not None else None)


def resolve_model(model: str | nn.Module | ResolvedModel) -> ResolvedModel:
    """A zoo name, "hf:path/to/config.json" (or its directory), a "package.module:factory" spec, or a
    module object (or a model resolved already)."""
    if isinstance(model, ResolvedModel):
        return model
    if isinstance(model, nn.Module):
        return _object(model, type(model).__name__)
    if model.startswith(HF_PREFIX):
        built = build_hf_model(model[len(HF_PREFIX):])
        return ResolvedModel(built.module, model, None, built.max_seq_len, built.max_positions,
                             "its config's max_position_embeddings: its learned position table", built.positions_note,
                             for_hf_model(built.module))
    if ":" in model and "[" not in model:
        try:
            module = load_factory(model, device="meta")
        except (ValueError, ImportError) as exc:  # each says "model factory '...': what went wrong"
            raise UsageError(str(exc)) from exc
        return _object(module, model)
    name, overrides = parse_zoo_spec(model)
    try:
        config = get_config(name, **overrides)
    except UnknownModelError as exc:
        raise UsageError(str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise UsageError(f"cannot build {model!r}: {exc}") from exc
    return _zoo(build_model(config, device="meta"), model, config)


def check_seq_len(model: ResolvedModel, seq_len: int) -> None:
    """UsageError when `seq_len` is longer than the model's positions, naming both numbers."""
    if model.max_positions is None or seq_len <= model.max_positions:
        return
    longer = ""
    if model.config is not None:
        config = dataclasses.replace(ModelConfig.from_dict(model.config), max_seq_len=seq_len)
        longer = f", or plan a longer model: {zoo_spec(config)}"
    elif model.name.startswith(HF_PREFIX):
        longer = ", or raise max_position_embeddings in its config"
    raise UsageError(f"`seq_len` {seq_len} is longer than the {model.max_positions} positions {model.name} takes "
                     f"({model.positions_from}); give `seq_len` at most {model.max_positions}{longer}")


def _plan_source(plan_file: Path | None) -> str:
    return f"the plan file {plan_file}" if plan_file is not None else "the plan"


def plan_hf_path(name: str, plan_file: Path | None = None) -> Path:
    """Where a plan's "hf:PATH" points: PATH relative to the plan file's folder (to the current directory for a
    plan not read from a file), and inside it. An absolute PATH, and one that leads out of the folder (`..`,
    or a symlink to elsewhere), are refused before anything is opened: a plan may come from another machine,
    and what it names outside its own folder is not the user's to read here unless they name it (`model`
    hf:PATH)."""
    path = name[len(HF_PREFIX):]
    if Path(path).is_absolute() or path.startswith("~"):
        raise UsageError(f"{_plan_source(plan_file)} names its Hugging Face config by the absolute path {path!r}; a "
                         "config named in a plan is read only relative to the plan's folder. Give the model: "
                         "`model` hf:PATH")
    folder = plan_file.parent if plan_file is not None else Path.cwd()
    try:
        inside = (folder / path).resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        inside = False
    if not inside:
        raise UsageError(f"{_plan_source(plan_file)} names its Hugging Face config {path!r}, which leads out of the "
                         f"plan's folder ({folder}); a config named in a plan is read only inside the plan's folder. "
                         "Keep the config beside the plan, or give the model: `model` hf:PATH")
    return folder / path


def _hf_from_plan(name: str, plan_file: Path | None) -> ResolvedModel:
    path = plan_hf_path(name, plan_file)
    folder = plan_file.parent if plan_file is not None else Path.cwd()
    try:
        built = build_hf_model(path)
    except UsageError as exc:
        raise UsageError(f"the Hugging Face config {name[len(HF_PREFIX):]!r} came from {_plan_source(plan_file)} "
                         f"(read relative to {'its folder' if plan_file is not None else 'the current directory'}, "
                         f"{folder}): {exc}; give the model to use another: `model` hf:PATH") from exc
    return ResolvedModel(built.module, name, None, built.max_seq_len, built.max_positions,
                         "its config's max_position_embeddings: its learned position table", built.positions_note,
                         for_hf_model(built.module))


def model_from_plan(name: str, config: dict | None, plan_file: Path | None = None) -> ResolvedModel:
    """The model a plan's model record describes, built from the plan's data only: its zoo config, or its
    Hugging Face config (`plan_file`'s folder holds the relative path). A plan made from a factory or a
    module object is refused: autoplan never imports code named only in a plan."""
    if config is not None:
        try:
            zoo_config = ModelConfig.from_dict(config)
        except (TypeError, ValueError) as exc:
            raise PlanFileError(f"the plan's model config for {name!r} is invalid: {exc}") from exc
        label = name
        try:  # the label says what is built: the plan's name only where it gives the same config
            base, overrides = parse_zoo_spec(name)
            if get_config(base, **overrides) != zoo_config:
                label = zoo_spec(zoo_config)
        except (UsageError, TypeError, ValueError):
            label = zoo_spec(zoo_config)
        return _zoo(build_model(zoo_config, device="meta"), label, zoo_config)
    if name.startswith(HF_PREFIX):
        return _hf_from_plan(name, plan_file)
    if ":" in name:
        raise UsageError(f"the plan was made for the model factory {name!r}; autoplan does not import code named "
                         f"only in a plan file, so name the factory again: `model` {name}")
    raise UsageError(f"the plan was made for a model object ({name}); pass that model too (`model`)")
