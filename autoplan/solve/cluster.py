"""The cluster a plan is made for: its mesh (nodes x GPUs per node, and the parallel degrees laid on them),
the device profile, and the host memory offloaded state may use."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from autoplan.profile_store import load_profile
from autoplan.settings import DEFAULT_PROFILE, mesh_of
from cost_models.mesh import Mesh
from cost_models.profile import DeviceProfile
from cost_models.tp_time import tp_profile

__all__ = ["Cluster", "resolve_cluster"]

# Host memory per node assumed for a GPU profile that states none, when `host_mem` is not given: a
# conservative figure for an 8-GPU training node (DGX A100 ships 1 TB, DGX H100 2 TB).
DEFAULT_GPU_HOST_MEM_BYTES = 1_000_000_000_000


@dataclass(frozen=True)
class Cluster:
    mesh: Mesh
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

    def with_mesh(self, mesh: Mesh) -> Cluster:
        """This cluster running `mesh` (other degrees on its nodes). Under tensor parallelism the data-parallel
        groups of a node share its network links (cost_models.tp_time.tp_profile), and offload is not
        offered beside DTensor's parameters."""
        if mesh.tp == 1:
            return replace(self, mesh=mesh)
        return replace(self, mesh=mesh, profile=tp_profile(self.profile, mesh.tp), host_mem_bytes=None,
                       host_mem_source="not offered with tensor parallelism")


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
    """The cluster of `gpus` on `nodes` x `gpus_per_node` (see Mesh.of for the defaults) with device `profile`
    (default DEFAULT_PROFILE); UsageError where the counts disagree or the profile cannot be loaded."""
    mesh = mesh_of(gpus, nodes, gpus_per_node)
    is_default = gpus is None and nodes is None and gpus_per_node is None and profile is None
    profile_name = profile or DEFAULT_PROFILE
    loaded = load_profile(profile_name)
    host_bytes, host_source = host_memory(loaded, host_mem)
    return Cluster(mesh, loaded, profile_name, is_default, host_bytes, host_source)
