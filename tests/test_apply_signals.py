"""Interrupting `autoplan apply` (issue 16, item 7): a signal to the apply process alone stops every rank.

`autoplan apply` is started as a user would (a subprocess), trains 2 gloo ranks for long enough, and gets
SIGINT or SIGTERM once rank 0 prints its first step; the signal goes to that one process, not its group.
Afterwards no process of the run (the launcher, both ranks) may be alive, the run directory must be gone,
the exit status must be the shell's for the signal (130, 143), and no traceback is printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from planmaker import make_plan

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid` (psutil where installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        found = {}
        for child in psutil.Process(pid).children(recursive=True):
            try:
                found[child.pid] = " ".join(child.cmdline())
            except psutil.Error:
                pass
        return found
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path("/proc", entry, "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child in [p for p, pp in parents.items() if pp == parent]:
            try:
                found[child] = Path("/proc", str(child), "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            frontier.append(child)
    return found


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie (dead, not yet reaped by its new parent) is not alive."""
    try:
        state = Path("/proc", str(pid), "stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_apply_stops_every_rank_and_removes_the_run_directory(tmp_path, sig, status):
    plan_path = tmp_path / "plan.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard", "transformer.h.1": "shard"}).save(plan_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    apply = subprocess.Popen([sys.executable, "-m", "autoplan", "apply", str(plan_path), "--steps", "100000"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Read both pipes on threads: a rank that outlives the apply process keeps them open.
    stdout: list[str] = []
    stderr: list[str] = []
    training = threading.Event()

    def read_stdout():
        for line in apply.stdout:
            stdout.append(line)
            if line.startswith("[autoplan apply] step 1/"):
                training.set()

    readers = [threading.Thread(target=target, daemon=True)
               for target in (read_stdout, lambda: stderr.extend(apply.stderr))]
    for reader in readers:
        reader.start()
    run: dict[int, str] = {}
    try:
        assert training.wait(timeout=240), "".join(stdout) + "".join(stderr)  # the ranks are training
        run = descendants(apply.pid)
        launcher = [cmd for cmd in run.values() if "autoplan.run.launch" in cmd]
        ranks = [pid for pid, cmd in run.items()
                 if "-m autoplan.run.worker" in cmd and "autoplan.run.launch" not in cmd]
        assert launcher and len(ranks) == 2, run
        run_dir = Path(launcher[0].split("autoplan.run.launch", 1)[1].split()[0])
        assert run_dir.is_dir()

        apply.send_signal(sig)  # to the apply process only, not to its group
        assert apply.wait(timeout=120) == status
    finally:
        if apply.poll() is None:
            apply.kill()
            apply.wait()
        survivors = [pid for pid in run if alive(pid)]
        for pid in survivors:  # a failing test leaves nothing running either
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not survivors, f"left running: {survivors} of {run}"
    assert not run_dir.exists()
    for reader in readers:  # the pipes close once no process of the run is left
        reader.join(timeout=30)
    err = "".join(stderr)
    assert f"interrupted by {sig.name}" in err and "every rank stopped" in err
    assert "Traceback" not in err
