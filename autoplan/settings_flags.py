"""How a settings field appears on the command line, where its name or type alone does not say: the metadata
`autoplan.settings` annotates its fields with, read by `autoplan.cli.flags` to build each command's flags."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

__all__ = ["Flag", "field_flag", "flag_name"]


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line, where its name or type alone does not say."""

    name: str | None = None  # the flag, when not `--` + the field name with dashes
    kind: str | None = None  # "mem" (a size such as 8GB), "choice" (from the registry, see _choices)
    api_only: bool = False  # a Python object (a module, example inputs): no flag
    bare: str | None = None  # a "choice" flag given without a value means this one (`--checkpoint`: full)


def field_flag(cls: type[BaseModel], name: str) -> Flag:
    """The Flag metadata of a field (an empty one where the annotation has none)."""
    return next((m for m in cls.model_fields[name].metadata if isinstance(m, Flag)), Flag())


def flag_name(cls: type[BaseModel], name: str) -> str:
    return field_flag(cls, name).name or "--" + name.replace("_", "-")
