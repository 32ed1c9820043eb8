"""The check `autoplan search --fit-allocator auto` makes after a search: the plan's step replayed through the
caching allocator model (autoplan.run.allocator_fit) in a forked process, within a share of the search's own time.

Why a module of its own: the replay imports FSDP2, DTensor and the run's machinery (about a second); the
searching process imports none of it, the forked one does, inside the budget it is given.
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import TYPE_CHECKING

from autoplan.errors import UsageError
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile
from cost_models.options import SHARDING_KINDS, ShardGroup

if TYPE_CHECKING:
    from autoplan.run.allocator_fit import AllocatorReplay

__all__ = ["AUTO_REPLAY_SHARE", "check_replayable", "replay_within"]

# `search --fit-allocator auto` replays a plan only within this share of the search's own time, so that the default
# search costs at most 1.3x a search fitted to live bytes (measured: benchmarks/allocator.py --search-time); a
# replay that needs longer is stopped and skipped, the plan staying fitted to the needed bound (which the replays
# of benchmarks/allocator.py check)
AUTO_REPLAY_SHARE = 0.15


def check_replayable(plan: Plan) -> None:
    """UsageError saying why `plan` cannot be replayed on fake tensors yet (none where it can)."""
    if load_profile(plan.cluster.profile).device_type != "cuda":
        raise UsageError(f"the plan is costed with {plan.cluster.profile!r}, not a CUDA profile: only CUDA has the "
                         "caching allocator a replay models (pick a GPU profile with --profile, or leave out "
                         "--fit-allocator)")
    if plan.cluster.tp_degree > 1:
        raise UsageError("a tensor-parallel plan does not run on fake tensors yet (FSDP2 joins the data- and "
                         "tensor-parallel meshes inside the fake tensor mode, which torch 2.13 refuses), so its "
                         "allocations cannot be replayed: search with --tp 1 to check a plan by replay")
    offloaded = [u.module or "<root>" for u in plan.units if u.offload]
    if offloaded:
        raise UsageError(f"units offloaded to the host ({', '.join(offloaded[:3])}{', ...' if len(offloaded) > 3 else ''}): "
                         "on fake tensors the host and the device are one memory, so a replay cannot tell their "
                         "allocations apart yet; search without --fit-allocator (the report gives the reserved bound), "
                         "or with more memory or GPUs so that nothing is offloaded")
    node_sharded = [u.module or "<root>" for u in plan.units
                    if SHARDING_KINDS[u.sharding].shard_group == ShardGroup.NODE]
    if node_sharded and plan.cluster.nodes > 1:
        raise UsageError(f"units sharded within a node and replicated across nodes ({', '.join(node_sharded[:3])}) "
                         "run on a 2-D mesh, which does not run on fake tensors yet: their allocations cannot be "
                         "replayed")


def replay_within(plan: Plan, budget_s: float) -> AllocatorReplay | None:
    """`replay_plan` in a forked process given `budget_s` seconds: None when it takes longer (the process is
    stopped) or the plan cannot be replayed (a tensor-parallel or offloading plan). Linux only (fork with torch
    imported); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        check_replayable(plan)
    except UsageError:
        return None
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_replay_into, args=(plan, send), daemon=True)
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


def _replay_into(plan: Plan, send) -> None:
    from autoplan.run.allocator_fit import replay_plan  # in the forked process: its imports count in its budget

    try:
        send.send(replay_plan(plan))
    finally:
        send.close()
