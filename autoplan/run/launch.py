"""Launch the ranks of a run with torch.distributed's own launcher and collect their results.

The launcher runs in a child process, `python -m autoplan.run.launch RUN_DIR <torchrun arguments>`:
that is torchrun's own `torch.distributed.run.run`, with one addition: when ranks fail, which ranks
and with what exit status or signal is written to RUN_DIR/launcher_failures.json, so the report can
say which rank died rather than only that the launcher failed. `--standalone` picks a free
rendezvous port; `--max-restarts=0` makes the launcher stop every rank as soon as one fails, so no
rank is left waiting in a collective for a peer that is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from autoplan.fileio import write_text_atomic
from autoplan.run.worker import RankResult, RunSpec

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # so ranks import this autoplan, installed or not
FAILURES_FILE = "launcher_failures.json"


@dataclass
class RankFailure:
    exitcode: int
    signal: str | None  # e.g. "SIGKILL" when the rank was killed by a signal


@dataclass
class LaunchResult:
    returncode: int  # the launcher's exit status
    ranks: dict[int, RankResult | None]  # what each rank wrote; None: nothing (died while starting)
    failures: dict[int, RankFailure]  # ranks the launcher reports failed, those it stopped included
    first_failed_rank: int | None = None  # the launcher's root cause: the first rank seen to fail


def torchrun_args(spec_path: Path, nproc: int) -> list[str]:
    return [
        "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
        "-m", "autoplan.run.worker", str(spec_path),
    ]


def _worker_env(device: str, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    if device == "cpu" and "OMP_NUM_THREADS" not in env:
        # Share the cores between the ranks (torchrun would otherwise set 1 and print a warning).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return env


def launch(spec: RunSpec, nproc: int) -> LaunchResult:
    """Run `spec` on `nproc` local ranks; returns when every rank has finished or been stopped.

    Each launch gets a fresh temporary run directory (spec.run_dir is set here).
    """
    with tempfile.TemporaryDirectory(prefix="autoplan-apply-") as run_dir:
        spec.run_dir = run_dir
        spec_path = Path(run_dir) / "run_spec.json"
        spec.save(spec_path)
        command = [sys.executable, "-m", "autoplan.run.launch", run_dir, *torchrun_args(spec_path, nproc)]
        completed = subprocess.run(command, env=_worker_env(spec.device, nproc))
        ranks = {rank: RankResult.load(run_dir, rank) for rank in range(nproc)}
        failures, first_failed_rank = _read_failures(Path(run_dir) / FAILURES_FILE)
    return LaunchResult(completed.returncode, ranks, failures, first_failed_rank)


def _read_failures(path: Path) -> tuple[dict[int, RankFailure], int | None]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, None
    return {int(rank): RankFailure(**failure) for rank, failure in data["ranks"].items()}, data["first_failed_rank"]


def _run_launcher(run_dir: str, torchrun_argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv))
    except ChildFailedError as exc:
        failures = {
            str(rank): {"exitcode": failure.exitcode, "signal": failure.signal_name() if failure.exitcode < 0 else None}
            for rank, failure in exc.failures.items()
        }
        first_failed_rank, _ = exc.get_first_failure()
        write_text_atomic(Path(run_dir) / FAILURES_FILE,
                          json.dumps({"first_failed_rank": first_failed_rank, "ranks": failures}))
        print(exc, file=sys.stderr)  # the launcher's own summary of the failure
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_run_launcher(sys.argv[1], sys.argv[2:]))
