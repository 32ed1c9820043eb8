"""Launch the ranks of a run with torch.distributed's own launcher and collect their results.

The launcher runs in a child process, `python -m autoplan.run.launch RUN_DIR <torchrun arguments>`:
that is torchrun's own `torch.distributed.run.run`, with three additions: when ranks fail, which ranks
and with what exit status or signal is written to RUN_DIR/launcher_failures.json, so the report can
say which rank died rather than only that the launcher failed; a signal that stops it ends it with the
shell's status for that signal, without a traceback; and its own log is quiet (as with LOGLEVEL=CRITICAL,
unless LOGLEVEL is set), since the run report names every failure. `--max-restarts=0` makes the launcher stop
every rank as soon as one fails, so no rank is left waiting in a collective for a peer that is gone.

One node: `--standalone` picks a free rendezvous port. Several nodes (`Nodes`): every node runs one
launch with the same node count and rendezvous endpoint (HOST:PORT on node 0) and its own node rank,
the static rendezvous torchrun offers: node k holds ranks k*nproc .. (k+1)*nproc-1, so rank 0 and the
full report are on node 0 (the ranks of other nodes send their results there, see worker.py). A node
waits for the others at most `Nodes.rdzv_timeout_s`; while no rank has started after RDZV_NOTICE_S it
says that it is waiting (and again every RDZV_REMIND_S), and a rendezvous that fails (a node missing,
node 0 unreachable) is a `LaunchResult.rendezvous_error`, said in one sentence, not torchrun's traceback.

The launcher gets a process group of its own and the signals sent to this process are forwarded to it
(procs.py); when it has exited, whatever of the run still lives is killed and the run directory removed.
Everything the run writes is inside that directory, torchrun's own log folder included (`--log-dir`;
by default it leaves a torchelastic_* folder in TMPDIR per run), and a directory left by a run whose
`autoplan apply` was killed outright (SIGKILL) is removed by the next launch (procs.remove_stale_run_dirs).
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the line that makes SIGINT end the launcher while it imports torch
import signal

if __name__ == "__main__":  # the launcher: stopped before torchrun takes over its signals, it ends at once
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a KeyboardInterrupt can be swallowed while torch imports)

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from autoplan.fileio import write_text_atomic
from autoplan.run.procs import (
    RUN_DIR_PREFIX,
    ForwardSignals,
    die_with_parent,
    mark_run_dir,
    remove_stale_run_dirs,
    run_processes,
    stop_run_processes,
)
from autoplan.run.worker import RankResult, RunSpec
from cost_models.allocator_conf import ALLOC_CONF_ENV, environment_conf, modelled_options

__all__ = ["FAILURES_FILE", "LaunchResult", "Nodes", "RankFailure", "launch", "run_allocator_conf", "torchrun_args"]

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # so ranks import this autoplan, installed or not
FAILURES_FILE = "launcher_failures.json"
RENDEZVOUS_FILE = "rendezvous_failure.json"
STOP_GRACE_S = 20.0  # after a forwarded signal, how long the launcher has to stop its ranks before it is killed
DEFAULT_RDZV_TIMEOUT_S = 300.0  # how long a node waits for the others by default (nodes of a job start apart)
RDZV_NOTICE_S = 5.0  # no rank started this long after the launch: say that the nodes are being waited for
RDZV_REMIND_S = 60.0


@dataclass(frozen=True)
class Nodes:
    """Where this launch sits among the run's nodes: torchrun's --nnodes, --node-rank, --rdzv-endpoint."""

    count: int = 1
    rank: int = 0  # this node's; node 0 holds rank 0, hosts the rendezvous and writes the report
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0, the same on every node; needed for count > 1
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S  # how long this node waits for the others to join


@dataclass
class RankFailure:
    exitcode: int
    signal: str | None  # e.g. "SIGKILL" when the rank was killed by a signal


@dataclass
class LaunchResult:
    returncode: int  # the launcher's exit status
    ranks: dict[int, RankResult | None]  # what each rank wrote; None: nothing (died while starting, or remote)
    failures: dict[int, RankFailure]  # ranks the launcher reports failed, those it stopped included
    first_failed_rank: int | None = None  # the launcher's root cause: the first rank seen to fail
    local_ranks: list[int] | None = None  # ranks this node ran; None: all of them
    interrupted: str | None = None  # the signal that stopped the run ("SIGINT"), None if none did
    launcher_summary: str | None = None  # torchrun's own account of a failure
    rendezvous_error: str | None = None  # the nodes did not all meet (no rank ran): torch's words

    def is_local(self, rank: int) -> bool:
        return self.local_ranks is None or rank in self.local_ranks


def torchrun_args(spec_path: Path, nproc: int, nodes: Nodes | None = None) -> list[str]:
    nodes = nodes or Nodes()
    if nodes.count == 1:
        where = ["--standalone"]
    else:  # how long a node waits for the others to join: the static rendezvous's `timeout`
        where = [f"--nnodes={nodes.count}", f"--node-rank={nodes.rank}", "--rdzv-backend=static",
                 f"--rdzv-endpoint={nodes.rdzv_endpoint}", f"--rdzv-conf=timeout={max(1, round(nodes.rdzv_timeout_s))}"]
    return [*where, f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", "autoplan.run.worker", str(spec_path)]


def run_allocator_conf(planned: str | None, device: str, environ=os.environ) -> tuple[str | None, str | None]:
    """The PYTORCH_CUDA_ALLOC_CONF a run's ranks use, and a warning when it is not the one the plan was fitted
    to: the environment's where it sets one (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF), else the plan's (None:
    torch's default; a CPU run has none)."""
    if device != "cuda":
        return None, None
    try:
        found = environment_conf(environ)
    except ValueError as exc:  # both variables, differing: the first is the one recorded
        return environ[ALLOC_CONF_ENV], f"{exc}; the run may not use the configuration the plan was fitted to"
    if found is None or planned is None:
        return (planned if found is None else found[1]), None
    name, given = found
    try:
        same = modelled_options(given) == modelled_options(planned)
    except ValueError as exc:
        return given, f"{name}={given!r} in this environment: {exc}; torch may refuse it"
    if same:
        return given, None
    return given, (f"{name}={given!r} in this environment, while the plan was fitted to what the caching "
                   f"allocator needs under {planned!r}: the run may need more memory than planned. Unset it, or "
                   f"search again with --allocator-conf {given!r}")


def _launcher_env(device: str, nproc: int, allocator_conf: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if allocator_conf is not None:  # the plan's, where the environment has none (run_allocator_conf)
        env[ALLOC_CONF_ENV] = allocator_conf
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    if device == "cpu" and "OMP_NUM_THREADS" not in env:
        # Share the cores between the ranks (torchrun would otherwise set 1 and print a warning).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    env.setdefault("LOGLEVEL", "CRITICAL")  # the level of torchrun's own loggers (see _run_launcher)
    return env


def launch(spec: RunSpec, nproc: int, nodes: Nodes | None = None, say=None) -> LaunchResult:
    """Run `spec` on `nproc` ranks of this node; returns when every rank has finished or been stopped.

    Each launch gets a fresh temporary run directory (spec.run_dir is set here), removed on return once no
    process of the run is left (and those of earlier runs killed outright, see the module docstring). A
    SIGINT, SIGTERM or SIGHUP to this process stops the run (the launcher and its ranks) and is named in the
    result's `interrupted`. `say(line)` is told, on several nodes, that the others are being waited for.
    """
    nodes = nodes or Nodes()
    world = nproc * nodes.count
    local_ranks = list(range(nodes.rank * nproc, (nodes.rank + 1) * nproc))
    remove_stale_run_dirs()
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as run_dir:
        mark_run_dir(run_dir)
        spec.run_dir = run_dir
        spec_path = Path(run_dir) / "run_spec.json"
        spec.save(spec_path)
        command = [sys.executable, "-m", "autoplan.run.launch", run_dir, f"--log-dir={Path(run_dir) / 'torchelastic'}",
                   *torchrun_args(spec_path, nproc, nodes)]
        launcher = subprocess.Popen(command, env=_launcher_env(spec.device, nproc, spec.allocator_conf), start_new_session=True)
        waiting = _RendezvousNotice(nodes, launcher.pid, str(spec_path), say) if nodes.count > 1 and say else None
        with ForwardSignals(launcher.pid) as signals:
            try:
                returncode = _wait(launcher, signals, waiting)
            finally:  # also when this process is failing: the launcher and what it left go first
                _stop(launcher, run_dir)
            ranks = {rank: RankResult.load(run_dir, rank) for rank in range(world)}
            failures, first_failed_rank, summary = _read_failures(Path(run_dir) / FAILURES_FILE)
            rendezvous = _read_rendezvous_failure(Path(run_dir) / RENDEZVOUS_FILE)
    return LaunchResult(returncode, ranks, failures, first_failed_rank, None if nodes.count == 1 else local_ranks,
                        signals.received, summary, rendezvous)


class _RendezvousNotice:
    """Says, while no rank of this node has started, that the other nodes are being waited for."""

    def __init__(self, nodes: Nodes, launcher_pid: int, spec_path: str, say):
        self.nodes, self.launcher_pid, self.spec_path, self.say = nodes, launcher_pid, spec_path, say
        self.start, self.next_at, self.ranks_started = time.monotonic(), RDZV_NOTICE_S, False

    def __call__(self) -> None:
        waited = time.monotonic() - self.start
        if self.ranks_started or waited < self.next_at:
            return
        # the ranks' command lines name the run's spec, as the launcher's does
        if any(pid != self.launcher_pid for pid in run_processes(self.spec_path)):
            self.ranks_started = True
            return
        where = "for the other nodes to join" if self.nodes.rank == 0 else "to join node 0"
        self.say(f"waiting {where} at {self.nodes.rdzv_endpoint} ({waited:.0f} s so far; {self.nodes.count} nodes, "
                 f"each running this command with its own --node-rank); giving up after "
                 f"{self.nodes.rdzv_timeout_s:.0f} s (--rdzv-timeout)")
        self.next_at = waited + RDZV_REMIND_S


def _wait(launcher: subprocess.Popen, signals: ForwardSignals, waiting=None) -> int:
    """The launcher's exit status. Once a signal was forwarded it has STOP_GRACE_S to stop its ranks and exit
    (it needs well under a second: ranks die on the signal); then its process group is killed."""
    while True:
        try:
            return launcher.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if signals.received_at is not None and time.monotonic() - signals.received_at > STOP_GRACE_S:
                signals.kill()
            elif waiting is not None:
                waiting()


def _stop(launcher: subprocess.Popen, run_dir: str) -> None:
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        launcher.wait()
    stop_run_processes(run_dir)  # a rank the launcher could not stop (or that outlived a killed launcher)


def _read_failures(path: Path) -> tuple[dict[int, RankFailure], int | None, str | None]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, None, None
    failures = {int(rank): RankFailure(**failure) for rank, failure in data["ranks"].items()}
    return failures, data["first_failed_rank"], data.get("summary")


def _read_rendezvous_failure(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["error"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run_launcher(run_dir: str, torchrun_argv: list[str]) -> int:
    # Stopped before torchrun takes over its signals: no rank exists yet, so end at once, quietly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent(signal.SIGTERM)  # the `autoplan apply` process died: stop the ranks as for a SIGTERM
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    # torchrun's own log ("Sending process ... closing signal"): the report says what failed
    try:
        logging.getLogger("torch.distributed.elastic").setLevel(os.environ.get("LOGLEVEL", "CRITICAL").upper())
    except ValueError:  # not a level's name
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(torchrun_argv))
    except ChildFailedError as exc:
        failures = {
            str(rank): {"exitcode": failure.exitcode, "signal": failure.signal_name() if failure.exitcode < 0 else None}
            for rank, failure in exc.failures.items()
        }
        first_failed_rank, _ = exc.get_first_failure()
        write_text_atomic(Path(run_dir) / FAILURES_FILE, json.dumps(
            {"first_failed_rank": first_failed_rank, "ranks": failures, "summary": str(exc)}))
        return 1
    except SignalException as exc:  # torchrun stopped its ranks on this signal
        return 128 + int(exc.sigval)
    except (DistError, RendezvousError) as exc:  # the nodes did not meet (a store that timed out, node 0 not there)
        write_text_atomic(Path(run_dir) / RENDEZVOUS_FILE, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    except Exception as exc:  # noqa: BLE001 - e.g. a rendezvous that timed out: one line, not torchrun's traceback
        print(f"autoplan apply: torch.distributed.run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_run_launcher(sys.argv[1], sys.argv[2:]))
