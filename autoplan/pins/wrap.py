"""An FSDP auto-wrap policy a team already has, as the units it makes: the first step from FSDP1's
`auto_wrap_policy` to a plan.

A team running FSDP1 (or accelerate's FSDP plugin) describes its units with a policy, not a list:
- size-based: `size_based_auto_wrap_policy` with `min_num_params` N: walking the module tree leaves first,
  a module is wrapped when the parameters not already in a wrapped module below it number at least N
  (never a ModuleList or ModuleDict; nothing below an nn.MultiheadAttention);
- class-based: `transformer_auto_wrap_policy` / `ModuleWrapPolicy` with layer classes: every module of one
  of those classes (accelerate's `fsdp_transformer_layer_cls_to_wrap`).

Given as `wrap_policy` (`--wrap-policy size:100000000`, `--wrap-policy class:LlamaDecoderLayer,Embedding`,
or torch's own words `min_num_params=1e8`, `transformer_layer_cls=GPT2Block`) or as a pins file's `wrap:`
key (`wrap: {min_num_params: 100000000}` or `wrap: {transformer_layer_cls: [GPT2Block]}`), the policy's
modules and the root are the units, in place of the granularity's (autoplan.tracing.units.wrap_paths
walks the model as FSDP1 does). A module that shares a parameter with a module outside it (tied
embeddings) cannot be a unit of FSDP2 and is left to its parent, and said. Pins then fix what they name
among those units; the solver (or `strategy`) decides the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoplan.errors import UsageError

__all__ = ["WrapPolicy"]

_FORMS = ("size:N (size_based_auto_wrap_policy's min_num_params), class:NAME[,NAME] "
          "(transformer_auto_wrap_policy's layer classes), or min_num_params=N, transformer_layer_cls=NAME[,NAME]")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class WrapPolicy:
    """Which modules an FSDP1 auto-wrap policy wraps: by size (`min_num_params`) or by class (`layer_classes`)."""

    min_num_params: int | None = None
    layer_classes: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.min_num_params is None) == (not self.layer_classes):
            raise UsageError(f"a wrap policy is by size or by class, one of them: {_FORMS}")
        if self.min_num_params is not None and self.min_num_params < 1:
            raise UsageError(f"the wrap policy's min_num_params must be at least 1, got {self.min_num_params}")
        bad = [name for name in self.layer_classes if not _NAME.match(name)]
        if bad:
            raise UsageError(f"the wrap policy's layer class {bad[0]!r} is not a class name (e.g. LlamaDecoderLayer)")

    @classmethod
    def of(cls, value: Any, source: str = "`wrap_policy`") -> WrapPolicy:
        """From a WrapPolicy, its text (`size:N`, `class:A,B`, `min_num_params=N`, `transformer_layer_cls=A,B`) or a
        mapping ({min_num_params: N} or {transformer_layer_cls: [A, B]})."""
        if isinstance(value, WrapPolicy):
            return value
        if isinstance(value, Mapping):
            return cls._of_mapping(value, source)
        if not isinstance(value, str):
            raise UsageError(f"{source}: give {_FORMS}; not {type(value).__name__}")
        kind, sep, rest = value.strip().partition(":" if ":" in value else "=")
        if not sep or not rest.strip():
            raise UsageError(f"{source} {value!r}: give {_FORMS}")
        return cls._of_mapping({kind.strip(): rest.strip()}, source)

    @classmethod
    def _of_mapping(cls, data: Mapping, source: str) -> WrapPolicy:
        keys = {"size": "min_num_params", "min_num_params": "min_num_params", "class": "transformer_layer_cls",
                "transformer_layer_cls": "transformer_layer_cls"}
        unknown = [key for key in data if key not in keys]
        if unknown or len(data) != 1:
            raise UsageError(f"{source}: {', '.join(map(repr, unknown)) or 'one key'}: give {_FORMS}")
        [(key, value)] = data.items()
        if keys[key] == "min_num_params":
            try:
                count = float(value)
            except (TypeError, ValueError):
                raise UsageError(f"{source}: min_num_params {value!r} is not a number") from None
            if count != int(count):
                raise UsageError(f"{source}: min_num_params {value!r} is not a whole number")
            return cls(min_num_params=int(count))
        names = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) \
            else None
        if not names:
            raise UsageError(f"{source}: transformer_layer_cls takes class names, e.g. [LlamaDecoderLayer]")
        return cls(layer_classes=tuple(str(name).strip() for name in names))

    def text(self) -> str:
        """As the flag takes it: `size:100000000` or `class:A,B`."""
        return f"size:{self.min_num_params}" if self.min_num_params is not None else "class:" + ",".join(
            self.layer_classes)
