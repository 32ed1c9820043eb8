"""Finding and reading device profiles: the shipped ones (the project's `profiles/` folder, installed
as package data) and the user's own (`~/.autoplan/profiles`, or $AUTOPLAN_PROFILE_DIR).

A profile's name means the same profile on every machine with this autoplan: a shipped name always
picks the shipped file, so a plan's `cluster.profile` loads to what the plan was costed with, and a
local file (a rough `--quick` measurement, say) can never change what a shipped name means. A local
profile whose name a shipped one already has is still listed and still loads, as `local:NAME` or by
its path; other local profiles load by their bare name.

A profile file is data: reading one validates it against `cost_models.profile.DeviceProfile` and
never imports or runs anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from autoplan.errors import UsageError
from autoplan.fileio import loads_strict, read_input, write_text_atomic
from cost_models.profile import PROFILE_SCHEMA_VERSION, DeviceProfile

__all__ = [
    "LOCAL_PREFIX", "PRECEDENCE_RULE", "ProfileEntry", "load_profile", "save_profile", "available_profiles",
    "profile_entries", "shipped_profile_dir", "local_profile_dir", "is_shipped_name", "figure_value", "sourced_figures",
]

LOCAL_PROFILE_DIR_ENV = "AUTOPLAN_PROFILE_DIR"
# the project's profiles/ folder, as autoplan's package data (autoplan/shipped_profiles links to it)
SHIPPED_PROFILES = "shipped_profiles"
LOCAL_PREFIX = "local:"  # `local:NAME` picks the local profile NAME even where a shipped one has that name
PRECEDENCE_RULE = ("a shipped profile's name always picks the shipped profile; a local profile of the same name "
                   f"is given as {LOCAL_PREFIX}NAME or by its path")


@dataclass(frozen=True)
class ProfileEntry:
    """One profile file: its name, where it lives, and the string `load_profile` picks it by."""

    name: str
    location: str  # "shipped" or "local"
    path: Path
    pick: str  # what to give `--profile` (`profile=`) for this file: NAME, or local:NAME where a shipped one has NAME
    shadowed: bool = False  # a local profile whose bare name picks the shipped one instead


def save_profile(profile: DeviceProfile, path: str | os.PathLike) -> None:
    """Write `profile` as JSON, atomically (no half-written file on error)."""
    write_text_atomic(path, profile.model_dump_json(indent=2) + "\n")


def shipped_profile_dir() -> Path:
    return Path(str(resources.files("autoplan") / SHIPPED_PROFILES))


def local_profile_dir() -> Path:
    """The folder of local profiles: $AUTOPLAN_PROFILE_DIR (unset or empty: ~/.autoplan/profiles). UsageError
    when what it names exists and is not a folder: profiles would be neither found nor written there."""
    given = os.environ.get(LOCAL_PROFILE_DIR_ENV)
    if not given:
        return Path.home() / ".autoplan" / "profiles"
    folder = Path(given).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"${LOCAL_PROFILE_DIR_ENV} is {given}, which is a file, not a folder; it names the folder "
                         "local profiles are read from and written to: point it at a folder (it is created when "
                         "a profile is written), or unset it for ~/.autoplan/profiles")
    return folder


def _files(folder: Path) -> dict[str, Path]:
    return {path.stem: path for path in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def is_shipped_name(name: str) -> bool:
    """Whether a shipped profile has this name (so a bare `--profile NAME` picks that one)."""
    return name.lower() in _files(shipped_profile_dir())


def profile_entries() -> list[ProfileEntry]:
    """Every profile file, shipped ones first, then local ones, each with the string that picks it."""
    shipped = _files(shipped_profile_dir())
    entries = [ProfileEntry(name, "shipped", path, name) for name, path in shipped.items()]
    for name, path in _files(local_profile_dir()).items():
        if name in shipped:
            entries.append(ProfileEntry(name, "local", path, LOCAL_PREFIX + name, shadowed=True))
        else:
            entries.append(ProfileEntry(name, "local", path, name))
    return entries


def available_profiles() -> dict[str, Path]:
    """What each profile name picks -> its file: shipped names pick the shipped file; a local profile
    whose name a shipped one has appears as `local:NAME`, other local profiles by their name."""
    return {entry.pick: entry.path for entry in profile_entries()}


def figure_value(profile: DeviceProfile, path: str):
    """The value a dotted figure path of `provenance.sources` names ("matmul_efficiency",
    "links.inter_node.bus_bandwidth_bytes_s", "host_link.h2d_bytes_s", "collectives"); None where the
    profile has no such figure."""
    node = profile.model_dump()
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def sourced_figures(profile: DeviceProfile) -> list[tuple[str, object, str]]:
    """(figure path, its value, its source) for every figure `provenance.sources` names, in its order."""
    return [(path, figure_value(profile, path), source) for path, source in profile.provenance.sources.items()]


def _read_profile(path: Path) -> DeviceProfile:
    try:
        data = loads_strict(read_input(path))
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: bad JSON, a key twice, too deep
        raise UsageError(f"cannot read profile {path}: {exc}") from exc
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != PROFILE_SCHEMA_VERSION:
        raise UsageError(
            f"profile {path} has schema_version {version!r}; this autoplan reads version "
            f"{PROFILE_SCHEMA_VERSION} (measure the device again with this autoplan, or upgrade autoplan)"
        )
    try:
        return DeviceProfile.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"profile {path} is not a valid device profile:\n{exc}") from exc


def load_profile(name_or_path: str) -> DeviceProfile:
    """A profile by name (e.g. 'a100-sxm4-80gb': a shipped name picks the shipped profile, else a local
    one of that name), `local:NAME` (the local one even where a shipped one has the name), or a path to a
    profile JSON."""
    profiles = available_profiles()
    key = name_or_path.lower()
    if key in profiles:
        return _read_profile(profiles[key])
    if key.startswith(LOCAL_PREFIX):
        local = local_profile_dir() / f"{name_or_path[len(LOCAL_PREFIX):]}.json"
        if local.is_file():
            return _read_profile(local)
        raise UsageError(f"no local profile {name_or_path[len(LOCAL_PREFIX):]!r} in {local_profile_dir()} "
                         f"(`autoplan profiles` lists them; set ${LOCAL_PROFILE_DIR_ENV} for another folder)")
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise UsageError(f"profile file {path} does not exist")
        return _read_profile(path)
    raise UsageError(
        f"unknown profile {name_or_path!r}; available: {', '.join(profiles)} "
        f"(or give a path to a profile .json; `autoplan profile` measures this machine)"
    )
