"""What `autoplan apply` leaves behind, and a node waiting for others (issue 26, items 3 and 7).

A run keeps everything in its run directory (torchrun's log folder included), removed when it ends; a
directory left by an `apply` killed outright (SIGKILL) is removed by the next run. A node whose peers never
come says that it waits and gives up after --rdzv-timeout with one clear sentence. Each test gives the runs
a TMPDIR of its own, so what is left there is this test's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from planmaker import make_plan
from test_apply_signals import alive, descendants

from autoplan.run.launch import RDZV_NOTICE_S
from autoplan.run.procs import OWNER_FILE, RUN_DIR_PREFIX, UNMARKED_STALE_S, mark_run_dir, remove_stale_run_dirs

REPO = Path(__file__).resolve().parents[1]


def env_with_tmpdir(tmpdir: Path) -> dict[str, str]:
    tmpdir.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmpdir),
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def left_in(tmpdir: Path) -> list[str]:
    """What runs left in `tmpdir`, less torch's compile cache (torchinductor_USER: one folder, kept and reused by
    every torch process of the user, not a run's)."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_stale_run_directories_are_those_whose_apply_is_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{RUN_DIR_PREFIX}dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "start": "0"}))
    (dead / "torchelastic").mkdir()
    mine = tmp_path / f"{RUN_DIR_PREFIX}mine"
    mine.mkdir()
    mark_run_dir(mine)  # this process is alive
    reused = tmp_path / f"{RUN_DIR_PREFIX}reused"
    reused.mkdir()
    (reused / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": "-1"}))  # the pid, another process
    named = tmp_path / f"{RUN_DIR_PREFIX}named"
    named.mkdir()
    (named / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "start": "0"}))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)", str(named)])
    old, new = tmp_path / f"{RUN_DIR_PREFIX}old-unmarked", tmp_path / f"{RUN_DIR_PREFIX}new-unmarked"
    old.mkdir()
    new.mkdir()
    os.utime(old, (time.time() - UNMARKED_STALE_S - 60,) * 2)
    (tmp_path / "not-a-run").mkdir()
    try:
        removed = remove_stale_run_dirs(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in removed) == sorted([dead.name, reused.name, old.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, named.name, new.name, "not-a-run"])


@pytest.mark.slow
@pytest.mark.distributed
def test_the_run_directory_of_a_killed_apply_is_removed_by_the_next_run(tmp_path):
    tmpdir = tmp_path / "tmpdir"
    env = env_with_tmpdir(tmpdir)
    plan_path = tmp_path / "plan.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard", "transformer.h.1": "shard"}).save(plan_path)
    apply = subprocess.Popen([sys.executable, "-m", "autoplan", "apply", str(plan_path), "--nproc", "1", "--steps",
                              "100000"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    training, lines = threading.Event(), []

    def read():
        for line in apply.stdout:
            lines.append(line)
            if line.startswith("[autoplan apply] step 1/"):
                training.set()

    threading.Thread(target=read, daemon=True).start()
    run: dict[int, str] = {}
    try:
        assert training.wait(timeout=240), "".join(lines)
        run = descendants(apply.pid)
        apply.kill()  # SIGKILL: apply cannot clean up; the kernel's parent-death signal stops its launcher and ranks
        apply.wait()
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in run) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for pid in [pid for pid in run if alive(pid)]:
            os.kill(pid, signal.SIGKILL)
    assert not any(alive(pid) for pid in run), run
    left = left_in(tmpdir)
    assert len(left) == 1 and left[0].startswith(RUN_DIR_PREFIX), left  # the killed run's, torchrun's logs inside
    assert not any(p.name.startswith("torchelastic_") for p in tmpdir.iterdir())

    again = subprocess.run([sys.executable, "-m", "autoplan", "apply", str(plan_path), "--nproc", "1", "--steps", "1",
                            "--warmup", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                           check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert left_in(tmpdir) == []  # the stale directory went, and this run's own


@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_whose_peers_never_come_says_it_waits_and_gives_up_after_the_timeout(tmp_path):
    tmpdir = tmp_path / "tmpdir"
    plan_path = tmp_path / "plan.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard"}).save(plan_path)
    endpoint = f"127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-m", "autoplan", "apply", str(plan_path), "--nnodes", "2", "--node-rank",
                             "0", "--rdzv-endpoint", endpoint, "--rdzv-timeout", str(2 * RDZV_NOTICE_S + 2),
                             "--report", "r.json"],
                            cwd=tmp_path, env=env_with_tmpdir(tmpdir), capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    # said once no rank had started RDZV_NOTICE_S after the launch, well before it gives up
    assert f"waiting for the other nodes to join at {endpoint}" in result.stdout, result.stdout
    assert "giving up after 12 s (--rdzv-timeout)" in result.stdout
    assert (f"the 2 nodes did not all join the rendezvous at {endpoint} within 12 s (--rdzv-timeout), so nothing "
            "ran") in result.stderr
    assert "--node-rank" in result.stderr and "no report written to r.json" in result.stderr
    assert "Traceback" not in result.stderr and "peak memory per rank" not in result.stdout  # no table of nothing
    assert not (tmp_path / "r.json").exists() and left_in(tmpdir) == []
