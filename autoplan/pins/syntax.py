"""Pins' syntax: decisions (an option's label, fields, a mapping), module-path patterns, one pin.

See autoplan.pins for the forms; this module turns text into Decision, Pattern and Pin, and says what
is accepted when it cannot.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from autoplan.errors import UsageError
from cost_models.options import CHECKPOINT_MODES, SHARDING_KINDS

__all__ = ["Decision", "FIELDS", "Pattern", "Pin", "ROOT", "parse_decision", "parse_pin"]

ROOT = "<root>"
FIELDS = ("sharding", "checkpoint", "offload")
_RANGE = re.compile(r"^\d+(-\d+(/\d+)?)?(,\d+(-\d+(/\d+)?)?)*$")  # 0-11, 0-3,8, 0-94/2 (every 2nd)
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _mode_of(word: str) -> str | None:
    """A checkpoint mode's name from its name or its label without the '+' ("ckpt", "sel")."""
    if word in CHECKPOINT_MODES:
        return word
    return next((m.name for m in CHECKPOINT_MODES.values() if m.label and m.label.lstrip("+") == word), None)


def _vocabulary() -> str:
    kinds = ", ".join(SHARDING_KINDS)
    modes = ", ".join(m.label.lstrip("+") for m in CHECKPOINT_MODES.values() if m.label)
    return (f"write an option's label (a sharding kind: {kinds}; then +{' or +'.join(modes.split(', '))}, then "
            "+offload), or fields: checkpoint=full, sharding=shard,offload=false, or a mapping "
            "{sharding: shard, checkpoint: full, offload: true}")


class Decision(BaseModel):
    """The fields a pin fixes (None: left to the solver)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sharding: str | None = None
    checkpoint: str | None = None
    offload: bool | None = None

    @field_validator("sharding")
    @classmethod
    def _known_sharding(cls, value):
        if value is not None and value not in SHARDING_KINDS:
            raise ValueError(f"unknown sharding {value!r}; this autoplan knows: {', '.join(SHARDING_KINDS)}")
        return value

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _known_mode(cls, value):
        if isinstance(value, bool):
            return "full" if value else "none"
        if value is not None:
            mode = _mode_of(str(value))
            if mode is None:
                raise ValueError(f"unknown checkpoint mode {value!r}; this autoplan knows: {', '.join(CHECKPOINT_MODES)}")
            return mode
        return value

    @property
    def fixed(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}

    @property
    def is_complete(self) -> bool:
        return len(self.fixed) == len(FIELDS)

    def allows(self, option) -> bool:
        """True when `option` (cost_models.choices.Option) agrees with every fixed field."""
        return all(getattr(option, name) == value for name, value in self.fixed.items())

    def merged(self, other: Decision) -> Decision | None:
        """Both decisions' fields together; None when they fix one field differently."""
        mine, theirs = self.fixed, other.fixed
        if any(mine[name] != theirs[name] for name in mine.keys() & theirs.keys()):
            return None
        return Decision(**{**mine, **theirs})

    def text(self) -> str:
        """The decision as a pins file writes it: an option's label when complete, else its fields."""
        if self.is_complete:
            return self.sharding + CHECKPOINT_MODES[self.checkpoint].label + ("+offload" if self.offload else "")
        return ",".join(f"{name}={str(value).lower() if isinstance(value, bool) else value}"
                        for name, value in self.fixed.items()) or "(nothing)"


def parse_decision(value: Any) -> Decision:
    """A Decision from a label, a fields string or a mapping; UsageError saying what is accepted."""
    if isinstance(value, Decision):
        return value
    try:
        if isinstance(value, Mapping):
            decision = Decision(**value)
        elif isinstance(value, str):
            decision = _decision_of_text(value.strip())
        else:
            raise ValueError(f"a decision is a string or a mapping, not {type(value).__name__}")
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        what = f"unknown field {where!r} (fields: {', '.join(FIELDS)})" if error["type"] == "extra_forbidden" \
            else f"{where}: {error['msg'].removeprefix('Value error, ')}"
        raise UsageError(f"decision {value!r}: {what}") from None
    except ValueError as exc:
        raise UsageError(f"decision {value!r}: {exc}; {_vocabulary()}") from None
    if not decision.fixed:
        raise UsageError(f"decision {value!r} fixes nothing; {_vocabulary()}")
    return decision


def _decision_of_text(text: str) -> Decision:
    if "=" in text:
        fields: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, raw = (s.strip() for s in part.partition("="))
            if name not in FIELDS:
                raise ValueError(f"unknown field {name!r} (fields: {', '.join(FIELDS)})")
            if name in fields:
                raise ValueError(f"{name} is given twice")
            if name == "offload":
                if raw.lower() not in _TRUE + _FALSE:
                    raise ValueError(f"offload={raw!r}: give true or false")
                fields[name] = raw.lower() in _TRUE
            else:
                fields[name] = raw
        return Decision(**fields)
    words = [w.strip() for w in text.split("+")]
    sharding, mode, offload = None, None, None
    for position, word in enumerate(words):
        if word in SHARDING_KINDS and position == 0:
            sharding = word
        elif _mode_of(word) is not None and mode is None:
            mode = _mode_of(word)
        elif word == "offload" and offload is None:
            offload = True
        else:
            where = "first" if word in SHARDING_KINDS else None
            raise ValueError(f"{word!r} is not understood here" + (" (the sharding kind comes " + where + ")"
                                                                    if where else ""))
    if sharding is not None:  # an option's label: what it does not name, it does not have
        return Decision(sharding=sharding, checkpoint=mode or "none", offload=bool(offload))
    return Decision(checkpoint=mode, offload=offload)


@dataclass(frozen=True)
class Pattern:
    """A module-path pattern (see the module docstring)."""

    text: str
    parts: tuple[str, ...] = field(init=False, compare=False)

    def __post_init__(self):
        text = self.text.strip()
        if not text:
            raise UsageError(f"empty pattern; name a module path, e.g. transformer.h.*, or {ROOT} for the root")
        if text != ROOT:
            parts = tuple(text.split("."))
            for part in parts:
                if not part:
                    raise UsageError(f"pattern {self.text!r} has an empty path component")
                if "**" in part and part != "**":
                    raise UsageError(f"pattern {self.text!r}: `**` stands alone between dots (a.**.b)")
                if _RANGE.match(part):
                    for low, high, step in map(_range_item, part.split(",")):
                        if high < low:
                            raise UsageError(f"pattern {self.text!r}: range {low}-{high} runs backwards")
                        if step < 1:
                            raise UsageError(f"pattern {self.text!r}: range {low}-{high}/{step}: the step is at "
                                             "least 1")
        else:
            parts = ()
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "parts", parts)

    @property
    def is_root(self) -> bool:
        return self.text == ROOT

    def matches(self, path: str) -> bool:
        """True when the module at `path` ("" is the root) is named by this pattern."""
        if self.is_root or path == "":
            return self.is_root and path == ""
        return _match(self.parts, tuple(path.split(".")))


def _range_item(item: str) -> tuple[int, int, int]:
    """"3" -> (3, 3, 1); "0-11" -> (0, 11, 1); "0-94/2" -> (0, 94, 2): every 2nd index from 0 to 94."""
    low, _, rest = item.partition("-")
    high, _, step = rest.partition("/")
    return int(low), int(high or low), int(step or 1)


def _component(pattern: str, name: str) -> bool:
    if _RANGE.match(pattern):
        if not name.isdigit():
            return False
        index = int(name)
        return any(low <= index <= high and (index - low) % step == 0
                   for low, high, step in map(_range_item, pattern.split(",")))
    return fnmatch.fnmatchcase(name, pattern)


def _match(pattern: tuple[str, ...], path: tuple[str, ...]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_match(pattern[1:], path[skip:]) for skip in range(len(path) + 1))
    return bool(path) and _component(pattern[0], path[0]) and _match(pattern[1:], path[1:])


@dataclass(frozen=True)
class Pin:
    """One `pattern: decision`, with where it came from (a file, or `pin`)."""

    pattern: Pattern
    decision: Decision
    source: str = "`pin`"

    def __str__(self) -> str:
        return f"`{self.pattern.text}: {self.decision.text()}` (from {self.source})"


def parse_pin(text: str, source: str = "`pin`") -> Pin:
    """A Pin from `PATTERN=DECISION` (the command line's and the API's `pin` form)."""
    if not isinstance(text, str):
        raise UsageError(f"`pin` {text!r}: give PATTERN=DECISION strings, e.g. transformer.h.0-11=shard+ckpt")
    pattern, sep, decision = text.partition("=")
    if not sep or not pattern.strip() or not decision.strip():
        raise UsageError(f"`pin` {text!r}: give PATTERN=DECISION, e.g. transformer.h.0-11=shard+ckpt, "
                         "lm_head=replicate, 'model.layers.*=checkpoint=full'")
    try:
        return Pin(Pattern(pattern), parse_decision(decision), source)
    except UsageError as exc:
        raise UsageError(f"`pin` {text!r}: {exc}") from None
