"""The processes of one `autoplan apply` run, and how they are stopped: nothing outlives the command.

A run is three levels of processes: the `autoplan apply` process, the launcher it starts
(torch.distributed.run, in a process group of its own, see launch.py) and the ranks the launcher
starts (each in a session of its own, as torch.distributed.run starts them). A signal sent to the
`autoplan apply` process alone (`kill -INT PID`, `kill -TERM PID`, Ctrl-C in its terminal) reaches
neither of the others by itself, so:

- `ForwardSignals`: while the launcher runs, SIGINT, SIGTERM and SIGHUP are forwarded to the
  launcher's process group. The launcher stops its ranks with the same signal (a rank dies on it at
  once, see `rank_signals`) and exits. A second signal kills the launcher's group outright, and so
  does launch.py when the launcher has not exited some seconds after the first.
- `die_with_parent`: on Linux a rank asks the kernel to kill it when its launcher dies, and the
  launcher to be stopped when the `autoplan apply` process dies, so even a SIGKILL leaves no orphan.
- `stop_run_processes`: after the launcher exits, any process still running with the run directory
  in its command line (found in /proc) is killed before the directory is removed; a live rank would
  write into it again.
- `remove_stale_run_dirs`: a SIGKILL of `autoplan apply` leaves no process (die_with_parent), but its
  run directory stays in TMPDIR; each run directory names the process that made it (`mark_run_dir`), and
  a launch removes those whose maker is gone and that no live process names.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["FORWARDED_SIGNALS", "RUN_DIR_PREFIX", "ForwardSignals", "die_with_parent", "exit_status",
           "mark_run_dir", "rank_signals", "remove_stale_run_dirs", "run_processes", "stop_run_processes"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
RUN_DIR_PREFIX = "autoplan-apply-"  # run directories in TMPDIR
OWNER_FILE = "owner.json"  # in a run directory: the process that made it
UNMARKED_STALE_S = 3600.0  # a run directory without an owner file (an older autoplan's) is stale this old


def exit_status(signal_name: str) -> int:
    """The shell's status for a command stopped by a signal: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signal.Signals[signal_name])


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Linux: have the kernel send `sig` to this process when its parent exits (strictly: when the parent's
    thread that started it does); exit now if the parent is gone already (then this process was reparented
    before it could ask). Elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(128 + int(sig))


def rank_signals() -> None:
    """In a rank: SIGINT and SIGTERM end the process at once (no KeyboardInterrupt traceback, no step
    finished first): the launcher sends them to stop the run, and the results are on disk after every step."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class ForwardSignals:
    """Context manager: forward SIGINT/SIGTERM/SIGHUP to the process group `pgid` while it is active.

    `received` is the name of the first signal forwarded ("SIGINT"), None if none came. Outside the main
    thread signal handlers cannot be set, and nothing is forwarded.
    """

    def __init__(self, pgid: int):
        self.pgid = pgid
        self.received: str | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    def kill(self) -> None:
        """SIGKILL the process group (what a second signal does)."""
        self._send(signal.SIGKILL)

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, time.monotonic()
            # os.write, not print: a handler may run while the main thread is inside a print
            os.write(2, f"autoplan apply: {self.received} received: stopping the ranks "
                        "(send it again to kill them at once)\n".encode())
            self._send(signum)
        else:
            self._send(signal.SIGKILL)

    def _send(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the launcher has exited already

    def __enter__(self) -> "ForwardSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def run_processes(marker: str) -> list[int]:
    """Live processes (zombies excepted) other than this one whose command line contains `marker`
    (the run directory). Read from /proc; empty where there is none."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if marker in cmdline and not _is_gone(int(entry)):
                found.append(int(entry))
        except OSError:
            continue  # it exited meanwhile
    return found


def _is_gone(pid: int) -> bool:
    try:
        stat = Path("/proc", str(pid), "stat").read_text()
    except OSError:
        return True  # gone
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def stop_run_processes(marker: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every live process whose command line contains `marker` and wait (up to `timeout_s`) until
    they are gone; returns the pids that were found."""
    pids = run_processes(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(not _is_gone(pid) for pid in pids):
        time.sleep(0.05)
    return pids


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22): with the pid, it names one
    process even after the pid is reused. None: no such process (or no /proc)."""
    try:
        return Path("/proc", str(pid), "stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def mark_run_dir(run_dir: str | os.PathLike) -> None:
    """Record in `run_dir` the process that made it (this one), for remove_stale_run_dirs."""
    Path(run_dir, OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())}))


def _is_stale(run_dir: Path) -> bool:
    try:
        owner = json.loads((run_dir / OWNER_FILE).read_text())
        alive = _start_time(int(owner["pid"])) is not None and _start_time(int(owner["pid"])) == owner["start"]
    except FileNotFoundError:  # not marked (yet, or by an older autoplan): stale once old
        try:
            alive = time.time() - run_dir.stat().st_mtime < UNMARKED_STALE_S
        except OSError:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not ours to judge
    return not alive and not run_processes(str(run_dir))


def remove_stale_run_dirs(folder: str | os.PathLike | None = None) -> list[Path]:
    """Remove the run directories in `folder` (default TMPDIR) of runs whose `autoplan apply` is gone (killed
    outright, so it could not remove its own) and that no live process names; returns them. Directories
    that are not this user's are left alone."""
    removed = []
    for run_dir in Path(folder or tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            if not run_dir.is_dir() or run_dir.is_symlink() or run_dir.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _is_stale(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(run_dir)
    return removed
