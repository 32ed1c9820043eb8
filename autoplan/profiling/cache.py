"""Measurement cache: one JSON file per (device, torch version, threads), entries by measurement key
(an op key, a collective and size, ...). Written after every new entry, atomically, so an interrupted
run resumes where it stopped and a repeated run re-measures nothing."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from autoplan.fileio import write_text_atomic

CACHE_DIR_ENV = "AUTOPLAN_CACHE_DIR"
CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV, Path.home() / ".cache" / "autoplan"))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


class MeasurementCache:
    """Dict-like store of JSON values; `directory=None` keeps nothing (a run that must re-measure)."""

    def __init__(self, directory: Path | None, device_name: str, torch_version: str, threads: int | None):
        self.scope = {"format": CACHE_FORMAT, "device": device_name, "torch": torch_version, "threads": threads}
        self.path = None
        if directory is not None:
            self.path = Path(directory) / f"profile-{_slug(device_name)}-torch{_slug(torch_version)}-t{threads or 0}.json"
        self.entries: dict[str, object] = self._read()

    def _read(self) -> dict[str, object]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}  # a damaged cache only costs a re-measurement
        if not isinstance(data, dict) or data.get("scope") != self.scope:
            return {}
        return dict(data.get("entries", {}))

    def get(self, key: str):
        return self.entries.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def put(self, key: str, value) -> None:
        self.entries[key] = value
        if self.path is not None:
            write_text_atomic(self.path, json.dumps({"scope": self.scope, "entries": self.entries}, indent=0) + "\n")
