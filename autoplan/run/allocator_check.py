"""The check `autoplan search --fit-allocator auto` makes after a search: the plan's step replayed through the
caching allocator model (autoplan.run.allocator_fit) in a forked process, within a share of the search's own time.

Why a module of its own: the replay imports FSDP2, DTensor and the run's machinery (about a second); the
searching process imports none of it, the forked one does, inside the budget it is given.
"""

from __future__ import annotations

import math
import multiprocessing
import resource
import sys
from typing import TYPE_CHECKING

from autoplan.errors import UsageError
from autoplan.plan.schema import Plan
from autoplan.run.replayable import check_replayable

if TYPE_CHECKING:
    from autoplan.run.allocator_fit import AllocatorReplay

__all__ = ["AUTO_REPLAY_SHARE", "replay_within"]

# `search --fit-allocator auto` replays a plan only within this share of the search's own time, so that the default
# search costs at most 1.3x a search fitted to live bytes (measured: benchmarks/allocator.py --search-time); a
# replay that needs longer is stopped and skipped, the plan staying fitted to the needed bound (which the replays
# of benchmarks/allocator.py check)
AUTO_REPLAY_SHARE = 0.15


def replay_within(plan: Plan, budget_s: float, cpu_budget_s: float | None = None) -> AllocatorReplay | None:
    """`replay_plan` in a forked process given `budget_s` seconds of wall-clock time and, where given, `cpu_budget_s`
    of its own CPU time (RLIMIT_CPU: on a loaded machine the wall-clock budget stretches, and a replay that cannot
    finish, a 3000-layer stack's, took that much more CPU for nothing): None when it takes longer (the process is
    stopped) or the plan cannot be replayed (a 2-D mesh across nodes, a CPU profile). Linux only (fork with torch
    imported); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        check_replayable(plan)
    except UsageError:
        return None
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_replay_into, args=(plan, send, cpu_budget_s), daemon=True)
    worker.start()
    send.close()
    try:
        return receive.recv() if receive.poll(budget_s) else None
    except EOFError:  # the replay failed in the worker
        return None
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join()


def _replay_into(plan: Plan, send, cpu_budget_s: float | None = None) -> None:
    if cpu_budget_s is not None:  # SIGXCPU ends the process past it (a forked process's CPU time starts at 0)
        seconds = max(1, math.ceil(cpu_budget_s))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    from autoplan.run.allocator_fit import replay_plan  # in the forked process: its imports count in its budget

    try:
        send.send(replay_plan(plan))
    finally:
        send.close()
