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

__all__ = ["AUTO_REPLAY_SHARE", "replay_floor_s", "replay_within"]

# `search --fit-allocator auto` replays a plan only within this share of the search's own time, so that the default
# search costs at most 1.3x a search fitted to live bytes (measured: benchmarks/allocator.py --search-time); a
# replay that needs longer is stopped and skipped, the plan staying fitted to the needed bound (which the replays
# of benchmarks/allocator.py check)
AUTO_REPLAY_SHARE = 0.15
# The least CPU a replay takes per unit and micro-batch step, seconds: it records rank 0's RECORDED_STEPS steps on
# fake tensors, measured on this project's 2-core machine at 73-135 ms per unit and step for a 5-unit Llama (its
# imports apart), 151 for gpt2-1.5b and 290 for the 405B-class Llama on 32 x 8 H100 (112 CPU-s in all). A replay
# whose cost at this floor, a quarter of the least measured, is over its CPU budget cannot finish and is not started:
# forking it and importing the run's machinery took about a CPU-second for the same outcome (no figures)
MIN_UNIT_STEP_CPU_S = 0.02
RECORDED_STEPS = 3  # autoplan.run.allocator_fit.record_step's steps


def replay_within(plan: Plan, budget_s: float, cpu_budget_s: float | None = None) -> AllocatorReplay | None:
    """`replay_plan` in a forked process given `budget_s` seconds of wall-clock time and, where given, `cpu_budget_s`
    of its own CPU time (RLIMIT_CPU: on a loaded machine the wall-clock budget stretches, and a replay that cannot
    finish, a 3000-layer stack's, took that much more CPU for nothing): None when it takes longer (the process is
    stopped), when its floor (`replay_floor_s`) is over the CPU budget (no process is started), or when the plan
    cannot be replayed (a 2-D mesh across nodes, a CPU profile). Linux only (fork with torch
    imported); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        check_replayable(plan)
    except UsageError:
        return None
    if cpu_budget_s is not None and replay_floor_s(plan) > _cpu_limit_s(cpu_budget_s):  # it would be stopped there
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


def replay_floor_s(plan: Plan) -> float:
    """The least CPU seconds `plan`'s replay can take (MIN_UNIT_STEP_CPU_S per unit and micro-batch step): rank 0's
    units each micro-batch of each recorded step (a pipelined plan is not replayed: replayable.check_fake_rank)."""
    return MIN_UNIT_STEP_CPU_S * len(plan.units) * plan.training.grad_accum_steps * RECORDED_STEPS


def _cpu_limit_s(cpu_budget_s: float) -> int:
    """RLIMIT_CPU's soft limit for a budget: whole seconds, at least one."""
    return max(1, math.ceil(cpu_budget_s))


def _replay_into(plan: Plan, send, cpu_budget_s: float | None = None) -> None:
    if cpu_budget_s is not None:  # SIGXCPU ends the process past it (a forked process's CPU time starts at 0)
        seconds = _cpu_limit_s(cpu_budget_s)
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    from autoplan.run.allocator_fit import replay_plan  # in the forked process: its imports count in its budget

    try:
        send.send(replay_plan(plan))
    finally:
        send.close()
