"""What keeps a plan's rank 0 from running on fake tensors and torch's fake process group yet, read from the plan
alone.

Why: the replay of a step's allocations (autoplan.run.allocator_fit) and the FSDPMemTracker comparison
(autoplan.run.torch_tracker) run rank 0 that way. The run refuses such a plan with the reason
(autoplan.run.replayable), and the plan's report (autoplan.plan.report) must not offer `--fit-allocator` for it:
one reading of the plan serves both, so they cannot disagree. Like the report, it reads plans by their fields and
never imports the schema (which imports the report).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from cost_models.options import SHARDING_KINDS, ShardGroup

__all__ = ["ReplayObstacle", "node_sharded_units", "replay_obstacle"]

Plan = Any  # autoplan.plan.schema.Plan, read by its fields


class ReplayObstacle(str, Enum):
    """Why rank 0 of a plan cannot run on fake tensors yet."""

    NODE_MESH = "node_mesh"  # units sharded within a node and replicated across nodes run on a 2-D mesh
    PIPELINE = "pipeline"  # torch.distributed.pipelining's schedule makes real tensors inside the fake mode
    EXPERTS = "experts"  # split experts get their tokens by the router's choices on real data (a data-dependent size)


def node_sharded_units(plan: Plan) -> list[str]:
    """The units sharded within a node (and so, on several nodes, replicated across them)."""
    return [u.module or "<root>" for u in plan.units if SHARDING_KINDS[u.sharding].shard_group == ShardGroup.NODE]


def replay_obstacle(plan: Plan) -> ReplayObstacle | None:
    """The first thing that keeps `plan`'s rank 0 off fake tensors (None: nothing does)."""
    if plan.cluster.nodes > 1 and node_sharded_units(plan):
        return ReplayObstacle.NODE_MESH
    if plan.pipeline is not None:
        return ReplayObstacle.PIPELINE
    if plan.cluster.mesh.ep > 1:
        return ReplayObstacle.EXPERTS
    return None
