"""Which plans a replay of rank 0's step on fake tensors can run (autoplan.run.allocator_fit): shared by the fit
and by the search's quick check (autoplan.run.allocator_check)."""

from __future__ import annotations

from autoplan.errors import UsageError
from autoplan.plan.replay_obstacle import ReplayObstacle, node_sharded_units, replay_obstacle
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile

__all__ = ["check_fake_rank", "check_replayable"]


def check_replayable(plan: Plan) -> None:
    """UsageError saying why `plan` cannot be replayed on fake tensors yet (none where it can)."""
    if load_profile(plan.cluster.profile).device_type != "cuda":
        raise UsageError(f"the plan is costed with {plan.cluster.profile!r}, not a CUDA profile: only CUDA has the "
                         "caching allocator a replay models (pick a GPU profile with --profile, or leave out "
                         "--fit-allocator)")
    check_fake_rank(plan)


def check_fake_rank(plan: Plan) -> None:
    """UsageError saying why `plan`'s rank 0 cannot run on fake tensors and the fake process group yet
    (autoplan.run.torch_tracker.fake_rank: the replay's recording and the FSDPMemTracker comparison;
    autoplan.plan.replay_obstacle)."""
    obstacle = replay_obstacle(plan)
    if obstacle is ReplayObstacle.NODE_MESH:
        raise UsageError(f"units sharded within a node and replicated across nodes "
                         f"({', '.join(node_sharded_units(plan)[:3])}) run on a 2-D mesh, which does not run on fake "
                         "tensors yet: their allocations cannot be replayed")
    if obstacle is ReplayObstacle.PIPELINE:
        raise UsageError(f"the plan runs a pipeline of degree {plan.cluster.mesh.pp}: "
                         "torch.distributed.pipelining's schedule does not run on fake tensors yet (it makes real "
                         "tensors inside them); its allocations cannot be replayed (search with --fit-allocator off, "
                         "the bound that needs no replay, or with --pp 1)")
    if obstacle is ReplayObstacle.EXPERTS:
        raise UsageError(f"the plan splits its experts over {plan.cluster.mesh.ep} ranks: which tokens each rank's "
                         "experts get, and so what its all-to-all and expert matmuls allocate, follows the router's "
                         "choices on real data, which fake tensors cannot run; its allocations cannot be replayed "
                         "(search with --fit-allocator off, the bound that needs no replay, or with --ep 1)")
