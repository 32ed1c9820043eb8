"""The cluster a plan is made for: world size, nodes x GPUs per node, and the device profile."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.errors import UsageError
from autoplan.profile_store import load_profile
from cost_models.profile import DeviceProfile
from cost_models.table import ClusterShape

__all__ = ["Cluster", "resolve_cluster"]

from autoplan.settings import DEFAULT_GPUS_PER_NODE, DEFAULT_PROFILE


@dataclass(frozen=True)
class Cluster:
    shape: ClusterShape
    profile: DeviceProfile
    profile_name: str
    is_default: bool


def resolve_cluster(gpus: int | None, nodes: int | None, gpus_per_node: int | None, profile: str | None) -> Cluster:
    for label, value in (("gpus", gpus), ("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if value is not None and value < 1:
            raise UsageError(f"`{label}` must be at least 1, got {value}")
    is_default = gpus is None and nodes is None and gpus_per_node is None and profile is None
    nodes = nodes or 1
    if gpus_per_node is None:
        if gpus is not None and gpus % nodes:
            raise UsageError(f"`gpus` {gpus} is not a multiple of `nodes` {nodes}")
        gpus_per_node = gpus // nodes if gpus is not None else DEFAULT_GPUS_PER_NODE
    if gpus is not None and gpus != nodes * gpus_per_node:
        raise UsageError(f"`gpus` {gpus} does not equal `nodes` {nodes} x `gpus_per_node` {gpus_per_node}")
    profile_name = profile or DEFAULT_PROFILE
    return Cluster(ClusterShape(nodes * gpus_per_node, nodes, gpus_per_node), load_profile(profile_name),
                   profile_name, is_default)
