"""Pin sets: read from a pins file (YAML or JSON, duplicate patterns refused) or a mapping, written back,
and made from a plan's decisions with units that agree grouped under range patterns."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from autoplan.errors import InfeasibleError, UsageError
from autoplan.fileio import read_input
from autoplan.pins.syntax import ROOT, Decision, Pattern, Pin, parse_decision
from autoplan.pins.wrap import WrapPolicy

__all__ = ["PinSet", "PinsInfeasibleError", "load_pins", "path_groups", "pins_of_plan", "pins_of_units", "range_text"]


class PinSet:
    """Pins in the order given (a file's first, then `pin`'s), and a pins file's FSDP wrap policy (`wrap:`,
    autoplan.pins.wrap), which says what the units are."""

    def __init__(self, pins: Iterable[Pin] = (), wrap: WrapPolicy | None = None):
        self.pins: list[Pin] = list(pins)
        self.wrap = wrap

    def __len__(self) -> int:
        return len(self.pins)

    def __iter__(self):
        return iter(self.pins)

    def __add__(self, other: PinSet) -> PinSet:
        return PinSet(self.pins + other.pins, self.wrap or other.wrap)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PinSet) and self.pins == other.pins and self.wrap == other.wrap

    def __repr__(self) -> str:
        return f"PinSet({', '.join(str(p) for p in self.pins)})"

    @classmethod
    def of(cls, value: Any, source: str = "`pins`") -> PinSet:
        """From a PinSet, a pins file's path, or a mapping {pattern: decision} (or {"pins": {...}})."""
        if isinstance(value, PinSet):
            return value
        if isinstance(value, (str, os.PathLike)):
            return load_pins(value)
        if isinstance(value, Mapping):
            return cls._of_data(value, source)
        raise UsageError(f"`pins` takes a pins file (YAML or JSON) or a mapping of patterns to decisions, "
                         f"not {type(value).__name__}")

    @classmethod
    def _of_data(cls, data: Mapping, source: str) -> PinSet:
        from_file = source != "`pins`"
        if not data and from_file:
            return cls()
        top = {"pins", "wrap"}
        wrap = WrapPolicy.of(data["wrap"], f"{source}: wrap") if "wrap" in data and set(data) <= top else None
        entries = data.get("pins") if set(data) <= top and data.keys() & top else data
        if from_file and not set(data) <= top:
            unknown = sorted(set(data) - top)
            raise UsageError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))} at the top; a pins file "
                             "holds `pins:`, mapping module-path patterns to decisions, and may hold `wrap:`, an FSDP "
                             "auto-wrap policy ({min_num_params: N} or {transformer_layer_cls: [NAME]})")
        if entries is None:
            entries = {}
        if not isinstance(entries, Mapping):
            raise UsageError(f"{source}: `pins` must map module-path patterns to decisions, e.g. "
                             "{\"transformer.h.*\": \"shard+ckpt\"}")
        pins = []
        for pattern, decision in entries.items():
            try:
                pins.append(Pin(Pattern(str(pattern)), parse_decision(decision), source))
            except UsageError as exc:
                raise UsageError(f"{source}: pin {pattern!r}: {exc}") from None
        return cls(pins, wrap)

    def to_data(self) -> dict[str, Any]:
        wrap = {}
        if self.wrap is not None:
            wrap = {"wrap": {"min_num_params": self.wrap.min_num_params} if self.wrap.min_num_params is not None
                    else {"transformer_layer_cls": list(self.wrap.layer_classes)}}
        return {**wrap, "pins": {pin.pattern.text: pin.decision.text() for pin in self.pins}}

    def dump(self, json_format: bool = False, header: str = "") -> str:
        """A pins file's text (YAML, or JSON), with `header` as YAML comment lines."""
        if json_format:
            return json.dumps(self.to_data(), indent=2) + "\n"
        import yaml

        comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
        return comments + yaml.safe_dump(self.to_data(), sort_keys=False, default_flow_style=False, width=1000)


def _refuse_duplicates(pairs: list[tuple[str, Any]], where: str) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise UsageError(f"{where}: pattern {key!r} appears twice; give each pattern once")
        seen[key] = value
    return seen


def load_pins(path: str | os.PathLike) -> PinSet:
    """Read a pins file: JSON if it parses as JSON (or is named *.json), else YAML."""
    file = Path(path).expanduser()
    name = str(path)
    try:
        text = read_input(file)
    except FileNotFoundError:
        raise UsageError(f"`pins` file {name} does not exist; write one (see `autoplan search --emit-pins`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"`pins` file {name} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if file.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: _refuse_duplicates(pairs, name))
        except json.JSONDecodeError as exc:
            raise UsageError(f"`pins` file {name} is not valid JSON: {exc}") from None
        except RecursionError:
            raise UsageError(f"`pins` file {name} nests too deeply to read; a pins file is one mapping, `pins:`, "
                             "of pattern: decision") from None
    else:
        data = _load_yaml(text, name)
    if data is None:
        data = {"pins": {}}
    if not isinstance(data, Mapping):
        raise UsageError(f"`pins` file {name}: expected a mapping with one key, `pins:`; got {type(data).__name__}")
    return PinSet._of_data(data, name)


def _load_yaml(text: str, name: str) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep)) for k, v in node.value]
        return _refuse_duplicates(pairs, name)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader with one constructor replaced
    except yaml.YAMLError as exc:
        raise UsageError(f"`pins` file {name} is not valid YAML: {exc}") from None
    except RecursionError:
        raise UsageError(f"`pins` file {name} nests too deeply to read; a pins file is one mapping, `pins:`, "
                         "of pattern: decision") from None


def range_text(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"; [0, 2, 4, ..., 94] -> "0-94/2" (every 2nd: alternating units)."""
    values = sorted(set(indices))
    parts, start = [], 0
    while start < len(values):
        end = start
        if start + 1 < len(values):
            step = values[start + 1] - values[start]
            while end + 1 < len(values) and values[end + 1] - values[end] == step:
                end += 1
            if step > 1 and end - start < 2:  # two indices apart are not yet a stride
                end = start
        low, high = values[start], values[end]
        parts.append(str(low) if end == start else f"{low}-{high}" if values[start + 1] - low == 1
                     else f"{low}-{high}/{values[start + 1] - low}")
        start = end + 1
    return ",".join(parts)


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def path_groups(paths_and_keys: Iterable[tuple[str, Any]]) -> list[tuple[str, list[str], Any]]:
    """(pattern, paths, key) for paths that differ only in their first integer component and share a key,
    in the order of each group's first path; the pattern names those indices as ranges (`h.0-3,8`)."""
    groups: dict[tuple[str, Any], list[tuple[str, int | None]]] = {}
    for path, key in paths_and_keys:
        found = _INDEX.search(path)
        template = path[:found.start()] + "#" + path[found.end():] if found else path
        groups.setdefault((template, key), []).append((path, int(found.group()) if found else None))
    out = []
    for (template, key), members in groups.items():
        if len(members) == 1 or members[0][1] is None:
            for path, _ in members:
                out.append((path or ROOT, [path], key))
        else:
            out.append((template.replace("#", range_text([i for _, i in members]), 1), [p for p, _ in members], key))
    return out


def pins_of_units(units: Iterable[tuple[str, str, str, bool]]) -> PinSet:
    """The pins that fix every unit to its decision ((path, sharding, checkpoint, offload) each), with
    units that differ only in a block index and agree grouped under one range pattern."""
    decided = [(path, Decision(sharding=s, checkpoint=c, offload=o)) for path, s, c, o in units]
    return PinSet(Pin(Pattern(pattern), decision, "the plan") for pattern, _, decision in path_groups(decided))


def pins_of_plan(plan) -> PinSet:
    """The pins that reproduce a plan's decisions (an autoplan Plan, or anything with its `units`)."""
    return pins_of_units((u.module, u.sharding, u.checkpoint, u.offload) for u in plan.units)


class PinsInfeasibleError(InfeasibleError):
    """No plan fits with the pins, while one does without them: `pins` are those to loosen."""

    def __init__(self, message: str, pins: list[Pin], peak_with: int | None, peak_without: int | None,
                 min_mem_bytes: int | None = None):
        super().__init__(message, min_mem_bytes)
        self.pins, self.peak_with, self.peak_without = pins, peak_with, peak_without
