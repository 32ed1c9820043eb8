"""Measurement cache: one JSON file per scope (device, torch version, threads, repeat settings),
entries by measurement key (an op key, a collective and size, ...). Written after every new entry,
atomically, so an interrupted run resumes where it stopped and a repeated run re-measures nothing."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from autoplan.fileio import write_text_atomic

CACHE_DIR_ENV = "AUTOPLAN_CACHE_DIR"
CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV, Path.home() / ".cache" / "autoplan"))


class MeasurementCache:
    """Dict-like store of JSON values for one scope; `directory=None` keeps nothing (re-measure all).

    scope: what the measurements depend on besides their key, e.g. {"device": "...", "torch": "2.13"}.
    It names the file (device slug + a hash of the scope), so runs in different scopes coexist."""

    def __init__(self, directory: Path | None, scope: dict):
        self.scope = {"format": CACHE_FORMAT, **scope}
        self.path = None
        if directory is not None:
            digest = hashlib.sha1(json.dumps(self.scope, sort_keys=True).encode()).hexdigest()[:12]
            device = re.sub(r"[^a-z0-9]+", "-", str(scope.get("device", "device")).lower()).strip("-")
            self.path = Path(directory) / f"profile-{device}-{digest}.json"
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
            text = json.dumps({"scope": self.scope, "entries": self.entries}, indent=0)
            write_text_atomic(self.path, text + "\n")
