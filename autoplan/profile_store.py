"""Finding and reading device profiles: the shipped ones (the project's `profiles/` folder, installed
as package data) and the user's own (`~/.autoplan/profiles`, or $AUTOPLAN_PROFILE_DIR).

A profile file is data: reading one validates it against `cost_models.profile.DeviceProfile` and
never imports or runs anything.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from autoplan.errors import UsageError
from autoplan.fileio import write_text_atomic
from cost_models.profile import PROFILE_SCHEMA_VERSION, DeviceProfile

__all__ = ["load_profile", "save_profile", "available_profiles", "shipped_profile_dir", "local_profile_dir"]

LOCAL_PROFILE_DIR_ENV = "AUTOPLAN_PROFILE_DIR"
# the project's profiles/ folder, as autoplan's package data (autoplan/shipped_profiles links to it)
SHIPPED_PROFILES = "shipped_profiles"


def save_profile(profile: DeviceProfile, path: str | os.PathLike) -> None:
    """Write `profile` as JSON, atomically (no half-written file on error)."""
    write_text_atomic(path, profile.model_dump_json(indent=2) + "\n")


def shipped_profile_dir() -> Path:
    return Path(str(resources.files("autoplan") / SHIPPED_PROFILES))


def local_profile_dir() -> Path:
    return Path(os.environ.get(LOCAL_PROFILE_DIR_ENV, Path.home() / ".autoplan" / "profiles"))


def available_profiles() -> dict[str, Path]:
    """Profile name -> file, shipped ones first; a local profile of the same name overrides."""
    found: dict[str, Path] = {}
    for folder in (shipped_profile_dir(), local_profile_dir()):
        if folder.is_dir():
            for path in sorted(folder.glob("*.json")):
                found[path.stem] = path
    return found


def _read_profile(path: Path) -> DeviceProfile:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
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
    """A shipped or local profile by name (e.g. 'a100-sxm4-80gb'), or a path to a profile JSON."""
    profiles = available_profiles()
    key = name_or_path.lower()
    if key in profiles:
        return _read_profile(profiles[key])
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise UsageError(f"profile file {path} does not exist")
        return _read_profile(path)
    raise UsageError(
        f"unknown profile {name_or_path!r}; available: {', '.join(profiles)} "
        f"(or give a path to a profile .json; `autoplan profile` measures this machine)"
    )
