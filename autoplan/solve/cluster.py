"""The cluster a plan is made for: world size, nodes x GPUs per node, and the device profile."""

from __future__ import annotations

import os
from dataclasses import dataclass

from autoplan.errors import UsageError
from autoplan.profile_store import load_profile
from cost_models.profile import DeviceProfile
from cost_models.table import ClusterShape

__all__ = ["Cluster", "resolve_cluster"]

from autoplan.settings import DEFAULT_GPUS_PER_NODE, DEFAULT_PROFILE

# Host memory per node assumed for a GPU profile that states none, when `host_mem` is not given: a
# conservative figure for an 8-GPU training node (DGX A100 ships 1 TB, DGX H100 2 TB).
DEFAULT_GPU_HOST_MEM_BYTES = 1_000_000_000_000


@dataclass(frozen=True)
class Cluster:
    shape: ClusterShape
    profile: DeviceProfile
    profile_name: str
    is_default: bool
    host_mem_bytes: int | None = None  # per node, for offloaded state (None: offload is not offered)
    host_mem_source: str = ""  # where host_mem_bytes comes from, for reports

    @property
    def offload_allowed(self) -> bool:
        """Offload is priced (and offered) only where the profile knows the host link."""
        return self.profile.host_link is not None and self.host_mem_bytes is not None

    @property
    def offload_searched(self) -> bool:
        """The search offers offload only where it frees device memory: not where the "device" is the host
        (a CPU profile), though a plan or strategy that asks for it there is still costed and run."""
        return self.offload_allowed and self.profile.device_type != "cpu"


def machine_mem_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_memory(profile: DeviceProfile, host_mem: int | None) -> tuple[int | None, str]:
    """Host memory per node for offloaded state, and where the figure comes from: `host_mem` if given,
    else the profile's, else this machine's for a CPU profile, else DEFAULT_GPU_HOST_MEM_BYTES."""
    if host_mem is not None:
        return host_mem, "`host_mem`"
    if profile.host_link is None:
        return None, "the profile has no host link"
    if profile.host_link.host_mem_bytes is not None:
        return profile.host_link.host_mem_bytes, "the profile"
    if profile.device_type == "cpu":
        return machine_mem_bytes(), "this machine"
    return DEFAULT_GPU_HOST_MEM_BYTES, "default for GPU nodes"


def resolve_cluster(gpus: int | None, nodes: int | None, gpus_per_node: int | None, profile: str | None,
                    host_mem: int | None = None) -> Cluster:
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
    loaded = load_profile(profile_name)
    host_bytes, host_source = host_memory(loaded, host_mem)
    return Cluster(ClusterShape(nodes * gpus_per_node, nodes, gpus_per_node), loaded, profile_name, is_default,
                   host_bytes, host_source)
