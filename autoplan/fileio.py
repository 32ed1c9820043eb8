"""Atomic file writes: a crash or an error never leaves a half-written plan or profile behind.

The file is written under a temporary name beside the target and renamed over it. It gets the mode a
plain `open(path, "w")` would give (0666 less the user's umask), not the 0600 of a temporary file, so
a plan or report shared in a team folder is readable by the team. `check_writable` lets a command
refuse an output path it could not write before doing the work that produces the file.
"""

import json
import os
import tempfile
from pathlib import Path

from autoplan.errors import AutoplanError, UsageError

__all__ = ["check_writable", "read_versioned_json", "write_text_atomic"]


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike, what: str = "output file", param: str | None = None,
                   example: str = "out.json") -> None:
    """UsageError unless `path` can be written as a file: not a directory, and its nearest existing folder
    (the folders below it are created) a directory that takes a new file. Tried with a temporary file,
    removed at once: permission bits alone do not tell (root ignores them; a read-only mount does not).
    `param` names the API parameter (the CLI shows its flag) that gave the path; `example` is a file name
    to suggest when the path is a directory."""
    target = Path(path).expanduser()
    name = f"`{param}` {path}" if param else f"the {what} {path}"
    if target.is_dir():
        raise UsageError(f"{name} is a directory; give a file name, e.g. {target / example}")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"cannot write {name}: {folder} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {name}: the directory {folder} takes no new file ({exc.strerror or exc}); "
                         "give a path in a directory you can write to") from None


def read_versioned_json(path: str | os.PathLike, kind: str, newest_version: int, error: type[AutoplanError],
                        remake: str) -> dict:
    """The JSON object in a record file (a plan, a run report) with a `schema_version` this autoplan reads.
    Every failure is an `error` naming the file and what is wrong; `remake` says what would help with a
    corrupt or newer file (e.g. "make the plan again"). Validating the fields is the caller's."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {kind} {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{kind} {path} is not valid JSON ({exc}); {remake}") from exc
    if not isinstance(data, dict) or "schema_version" not in data:
        raise error(f"{path} is not an autoplan {kind} (no schema_version)")
    version = data["schema_version"]
    if not isinstance(version, int) or version > newest_version:
        raise error(f"{kind} {path} has schema_version {version!r}, newer than this autoplan reads "
                    f"({newest_version}); upgrade autoplan, or {remake} with this one")
    return data
