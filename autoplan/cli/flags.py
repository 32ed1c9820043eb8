"""Command-line flags generated from a settings record, and errors told in flags.

Each field of `autoplan.settings.SearchSettings` / `EstimateSettings` is one flag: its name with
dashes (or the `Flag` in its annotation), its type, its registry choices and, as help, the
docstring under the field. A flag not given is left out, so the record's own default applies and
the API and the CLI cannot disagree. The library names parameters in backticks (`seq_len`);
`to_flags` shows a subcommand's flag there instead (`--seq-len`).
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from typing import Any

from pydantic import BaseModel

from autoplan.cli.args import mem_arg, positive_float, positive_int
from autoplan.settings import choices_of
from autoplan.settings_flags import field_flag, flag_name
from cost_models.options import SHARDING_KINDS

__all__ = ["add_settings_flags", "settings_fields", "to_flags"]

# argparse takes "-1" and "-.5" as values but "-1GB" as an unknown flag ("expected one argument"); a parser
# with a size flag reads anything shaped like a signed size as a value, so `--mem -1GB` gets the size's own
# message ("must be positive"). No flag of ours looks like that.
_NEGATIVE_SIZE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*[a-zA-Z]*$")


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Annotated[str | None, ...]` -> str (pydantic strips Annotated already)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else Any
    return annotation


def _help(text: str | None) -> str:
    return " ".join((text or "").split()).replace("%", "%%")


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseModel], skip: tuple[str, ...] = (),
                       group: argparse._ActionsContainer | None = None) -> None:
    """One flag per field of `cls` (but `skip` and API-only fields); `group` takes the flags if given."""
    target = group or parser
    for name, info in cls.model_fields.items():
        meta = field_flag(cls, name)
        if name in skip or meta.api_only:
            continue
        kind = _base_type(info.annotation)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": _help(info.description)}
        if kind is bool:
            kwargs["action"] = "store_true"
        elif meta.kind == "mem":
            kwargs.update(type=mem_arg, metavar="SIZE")
            parser._negative_number_matcher = _NEGATIVE_SIZE
        elif meta.kind == "choice":
            kwargs["choices"] = choices_of(name)
            if meta.bare is not None:
                kwargs.update(nargs="?", const=meta.bare)
            if name == "strategy":
                kwargs["help"] += ": " + "; ".join(f"{kind.name}: {kind.description}" for kind in SHARDING_KINDS.values())
        elif kind is int:
            kwargs["type"] = positive_int
        elif kind is float:
            kwargs["type"] = positive_float if name != "headroom" else float
        if kind is not bool and info.default is not None and "default" not in kwargs["help"]:
            kwargs["help"] += f" (default {info.default:g})" if isinstance(info.default, float) else \
                f" (default {info.default})"
        flag = flag_name(cls, name)
        if kind is not bool and "metavar" not in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        target.add_argument(flag, **kwargs)
    for action in parser._actions:  # help that names another parameter names its flag
        if action.help:
            action.help = to_flags(action.help, parser)


def settings_fields(cls: type[BaseModel], args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` given on the command line."""
    return {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}


_PARAM = re.compile(r"`([a-z_][a-z0-9_]*)`")


def to_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """`message` with each backticked parameter that is one of `parser`'s flags shown as that flag."""
    flags = {action.dest: action.option_strings[-1] for action in parser._actions if action.option_strings}
    return _PARAM.sub(lambda m: flags.get(m.group(1), m.group(0)), message)
