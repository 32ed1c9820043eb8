"""How a settings field appears on the command line, where its name or type alone does not say: the metadata
`autoplan.settings` annotates its fields with, read by `autoplan.cli.flags` to build each command's flags, and
the values a choice field takes, read from the one registry (`cost_models.options`) when asked."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from autoplan.errors import UsageError
from cost_models.attention import KERNEL_ALIASES, AttentionKernel
from cost_models.options import CHECKPOINT_MODES, OPTIMIZERS, PRECISIONS, SHARDING_KINDS
from cost_models.schedules import SCHEDULES

__all__ = ["FIT_TO", "GRANULARITIES", "POSITIVE_SETTINGS", "Flag", "check_choice", "choices_of", "document_fields",
           "field_flag", "flag_name"]

# the settings that are counts or degrees: each at least 1 where given
POSITIVE_SETTINGS = ("gpus", "nodes", "gpus_per_node", "seq_len", "batch_size", "global_batch", "tp", "capacity_factor",
                     "ep", "cp", "pp")

GRANULARITIES = ("block", "fine", "leaf", "root")
FIT_TO = ("needed", "allocated")  # what a CUDA plan is fitted to: what the caching allocator needs, or live bytes


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line, where its name or type alone does not say."""

    name: str | None = None  # the flag, when not `--` + the field name with dashes
    kind: str | None = None  # "mem" (a size such as 8GB), "choice" (from the registry: choices_of)
    api_only: bool = False  # a Python object (a module, example inputs): no flag
    bare: str | None = None  # a "choice" flag given without a value means this one (`--checkpoint`: full)


def field_flag(cls: type[BaseModel], name: str) -> Flag:
    """The Flag metadata of a field (an empty one where the annotation has none)."""
    return next((m for m in cls.model_fields[name].metadata if isinstance(m, Flag)), Flag())


def flag_name(cls: type[BaseModel], name: str) -> str:
    return field_flag(cls, name).name or "--" + name.replace("_", "-")


def check_choice(param: str, value: str, choices) -> None:
    """UsageError naming the parameter, the bad value and the accepted ones."""
    if value not in choices:
        raise UsageError(f"unknown `{param}` {value!r}; choose one of {', '.join(choices)}")


def choices_of(field: str) -> tuple[str, ...] | None:
    """The values a field takes, read from the registry now (None: any value of its type)."""
    return {
        "dtype": lambda: tuple(PRECISIONS),
        "optimizer": lambda: tuple(OPTIMIZERS),
        "strategy": lambda: tuple(SHARDING_KINDS),
        "checkpoint": lambda: tuple(CHECKPOINT_MODES),
        "granularity": lambda: GRANULARITIES,
        "sequence_parallel": lambda: ("on", "off"),
        "fit_to": lambda: FIT_TO,
        "attention": lambda: tuple(AttentionKernel) + tuple(KERNEL_ALIASES),
        "schedule": lambda: tuple(SCHEDULES),
    }.get(field, lambda: None)()


def document_fields(cls: type[BaseModel]) -> None:
    """Each field's description (its flag's help) from the docstring under it, as pydantic's
    `use_attribute_docstrings` sets it: the docstring under the field in the nearest class of `cls`'s module that
    annotates it, or none. That option finds each class's source through inspect.getmodule, which walks every
    module imported (0.04 CPU-s once torch is); this parses the module once. Call it before the class's schema is
    built (`defer_build`): a description is part of it."""
    annotated = _annotated(sys.modules[cls.__module__].__file__)
    for name, info in cls.model_fields.items():
        owner = next((annotated[c.__name__] for c in cls.__mro__ if c.__module__ == cls.__module__
                      and name in annotated.get(c.__name__, {})), {})
        if info.description is None:
            info.description = owner.get(name)


@functools.cache
def _annotated(path: str) -> dict[str, dict[str, str | None]]:
    """Per class of the module at `path`: the fields it annotates and the docstring under each (None: none)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, TypeError):  # no source (pydantic then sets no descriptions either)
        return {}
    annotated: dict[str, dict[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields = annotated[node.name] = {}
            for statement, after in zip(node.body, [*node.body[1:], None]):
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                        else None
                    fields[statement.target.id] = inspect.cleandoc(doc) if isinstance(doc, str) else None
    return annotated
