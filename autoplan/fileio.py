"""Atomic file writes: a crash or an error never leaves a half-written plan or profile behind.

The file is written under a temporary name beside the target and renamed over it. A new file gets the
mode a plain `open(path, "w")` would give (0666 less the user's umask), not the 0600 of a temporary
file, so a plan or report shared in a team folder is readable by the team; a file written again keeps
its mode. `check_writable` lets a command refuse an output path it could not write before doing the
work that produces the file.

Only regular files are written (`output_target`), because a rename replaces whatever has the name:
- a path that exists and is not a regular file (a FIFO, a device node such as /dev/null, a socket) is
  refused; renaming over it would turn /dev/null into a plain file for everyone;
- a symlink is written through, as `open(path, "w")` and the shell's `>` do: the file it points to
  gets the new text (atomically, beside that file) and the link stays a link. A link to something
  that is not a regular file is refused as that thing would be;
- a read-only file (no write permission bit, or one this user may not write) is refused rather than
  replaced: root may rename over a 0444 file, but its mode says it is not to be changed.
Each refusal is a UsageError (exit 2) naming the path and what would help.
"""

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from autoplan.errors import AutoplanError, UsageError

__all__ = ["MAX_RECORD_BYTES", "check_writable", "loads_strict", "output_target", "read_input", "read_versioned_json",
           "same_file", "write_text_atomic"]

# the most a record file (a plan, a profile, a pins file, a model config) is read of: a plan of thousands of
# units is a few MB; a larger file is not one (and /dev/zero would be read until memory ran out)
MAX_RECORD_BYTES = 256 * 2**20

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


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


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def output_target(path: str | os.PathLike, name: str | None = None) -> Path:
    """The file that writing `path` writes: `path` itself, or the file a symlink at `path` points to (links
    followed to the end). UsageError when that exists and is not a regular file, or is read-only. `name` is
    how messages call the path (default: the path)."""
    given = Path(path).expanduser()
    name = name or str(path)
    if str(path).endswith(("/", os.sep)):  # Path() drops it, and would write a file named as the folder
        raise UsageError(f"cannot write {name}: it ends in {os.sep}, so it names a directory; give a file name, e.g. "
                         f"{Path(path) / 'out.json'}")
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    via = f" (a symlink to {target})" if target != given else ""
    try:
        info = target.stat()
    except (FileNotFoundError, NotADirectoryError):  # a new file (check_writable judges its folder)
        return target
    except OSError as exc:
        raise UsageError(f"cannot write {name}{via}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        if stat.S_ISDIR(info.st_mode):
            return target  # check_writable says what to give instead; a rename onto it fails
        raise UsageError(f"cannot write {name}{via}: it is {_kind(info.st_mode)}, and autoplan writes only regular "
                         "files (it would be replaced by one); give the path of a file")
    if not info.st_mode & 0o222 or not os.access(target, os.W_OK):
        raise UsageError(f"cannot write {name}{via}: the file is read-only (mode {stat.filemode(info.st_mode)}); "
                         "make it writable (chmod u+w) or give another path")
    return target


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` (through a symlink to its file) under a temporary name, renamed over it: the
    file holds the old text or the new, never part of it. UsageError for what `output_target` refuses."""
    target = output_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        output_target(target)  # still a regular file (or none): it may have changed while writing
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file (through symlinks and hard links; for paths not there yet, by name)."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def read_input(path: str | os.PathLike, max_bytes: int = MAX_RECORD_BYTES) -> str:
    """The text of an input file (a regular file, or a pipe such as `<(...)`), UTF-8. An OSError whose strerror
    says why for a directory, a device (/dev/zero would never end), a socket, or more than `max_bytes`; a
    UnicodeDecodeError for text that is not UTF-8."""
    info = os.stat(Path(path).expanduser())
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "it is a directory, not a file")
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode)):
        raise OSError(errno.EINVAL, f"it is {_kind(info.st_mode)}, not a file")
    with open(Path(path).expanduser(), "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"it is larger than {max_bytes // 2**20} MiB, more than such a file ever holds")
    return data.decode("utf-8")


def check_writable(path: str | os.PathLike, what: str = "output file", param: str | None = None,
                   example: str = "out.json", inputs: tuple[tuple[str, str | os.PathLike | None], ...] = ()) -> None:
    """UsageError unless `path` can be written as a file: not a directory, not what `output_target` refuses
    (a FIFO, a device, a read-only file), and its nearest existing folder
    (the folders below it are created) a directory that takes a new file. Tried with a temporary file,
    removed at once: permission bits alone do not tell (root ignores them; a read-only mount does not).
    `param` names the API parameter (the CLI shows its flag) that gave the path; `example` is a file name
    to suggest when the path is a directory. `inputs`: (how to call it, path) of files the command reads or
    writes besides, which the path must not be (a report written over its plan)."""
    name = f"`{param}` {path}" if param else f"the {what} {path}"
    for other_name, other in inputs:
        if other is not None and same_file(path, other):
            raise UsageError(f"{name} is {other_name} ({other}), which this command reads or writes too; writing it "
                             "would replace that: give another path")
    target = output_target(path, name)
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


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {twice!r} appears twice in one object (JSON readers differ on which one counts)")
    return data


def loads_strict(text: str):
    """`json.loads`, but ValueError (a JSONDecodeError for bad syntax) for what a record file never holds and a
    reader would take silently or crash on: a key given twice in one object, and nesting deeper than
    Python's parser recurses (a RecursionError otherwise)."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except RecursionError:
        raise ValueError("it nests arrays or objects too deeply to read (a few levels is all a record needs)") from None


def read_versioned_json(path: str | os.PathLike, kind: str, newest_version: int, error: type[AutoplanError],
                        remake: str) -> dict:
    """The JSON object in a record file (a plan, a run report) with a `schema_version` this autoplan reads.
    Every failure is an `error` naming the file and what is wrong; `remake` says what would help with a
    corrupt or newer file (e.g. "make the plan again"). Validating the fields is the caller's."""
    path = Path(path)
    try:
        text = read_input(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {kind} {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        data = loads_strict(text)
    except json.JSONDecodeError as exc:
        raise error(f"{kind} {path} is not valid JSON ({exc}); {remake}") from exc
    except ValueError as exc:
        raise error(f"{kind} {path} is not a valid {kind}: {exc}; {remake}") from exc
    if not isinstance(data, dict) or "schema_version" not in data:
        raise error(f"{path} is not an autoplan {kind} (no schema_version)")
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise error(f"{kind} {path} has schema_version {json.dumps(version)}, not a version number: autoplan writes a "
                    f"whole number ({newest_version} for this one, unquoted); the file is corrupt or was edited, "
                    f"{remake}")
    if version < 1:
        raise error(f"{kind} {path} has schema_version {version}; versions start at 1: the file is corrupt or was "
                    f"edited, {remake}")
    if version > newest_version:
        raise error(f"{kind} {path} has schema_version {version}, newer than this autoplan reads "
                    f"({newest_version}); upgrade autoplan, or {remake} with this one")
    return data
