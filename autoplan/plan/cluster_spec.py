"""The plan file's record of the cluster a plan runs on: the world and its nodes, the device profile and the
memory limit it was planned to, and the mesh's degrees (its serialised form: `ClusterSpec.of` writes it from a
Cluster, `ClusterSpec.mesh` reads the Mesh back)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from autoplan.errors import PlanFileError
from autoplan.solve.cluster import Cluster
from autoplan.solve.request import Limits
from cost_models.allocator_conf import modelled_options
from cost_models.mesh import Mesh, MeshError

__all__ = ["ClusterSpec"]


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    world_size: int = Field(ge=1)
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    profile: str
    device_mem_bytes: int = Field(ge=0)
    mem_limit_bytes: int = Field(ge=0)
    mem_headroom: float = Field(default=0.0, ge=0, lt=1)  # the plan fits mem_limit_bytes * (1 - mem_headroom)
    host_mem_bytes: int | None = Field(default=None, ge=0)  # per node, for offloaded state (None: offload was not offered)
    # a (world / tp_degree) x tp_degree mesh: tensor parallelism inside each group of tp_degree GPUs of a node,
    # FSDP over the data-parallel dimension (autoplan.run.tp); written only above 1, so older plans load
    tp_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)
    sequence_parallel: bool = Field(default=False, exclude_if=lambda value: not value)  # norms split along the sequence
    # pipeline stages: the outermost dimension, pp_degree groups of world / pp_degree ranks (Plan.pipeline holds
    # the stages); written only above 1
    pp_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)
    # groups of ep_degree data-parallel ranks split the experts (cost_models.mesh.Mesh.ep); written only above 1
    ep_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)
    # context parallelism: each sequence split over cp_degree ranks (ring attention), the mesh
    # (world / (cp tp)) x cp_degree x tp_degree, FSDP over data x context parallel; written only above 1
    cp_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)
    # CUDA profiles: the PYTORCH_CUDA_ALLOC_CONF the plan was made for (`autoplan apply` runs its ranks with it,
    # and warns when a run's differs); None for other devices and in older plans
    allocator_conf: str | None = Field(default=None, exclude_if=lambda value: value is None)
    # what fits mem_limit_bytes (less the headroom): "needed", what torch's caching allocator needs to run the
    # step under allocator_conf (cost_models.allocator_margin), or "allocated", the live bytes alone (older plans)
    mem_fitted_to: Literal["allocated", "needed"] = Field(default="allocated",
                                                          exclude_if=lambda value: value == "allocated")

    @classmethod
    def of(cls, cluster: Cluster, limits: Limits) -> ClusterSpec:
        """The plan file's record of a cluster running its mesh (`cluster.mesh`), planned to `limits`."""
        mesh = cluster.mesh
        return cls(world_size=mesh.world_size, nodes=mesh.nodes, gpus_per_node=mesh.gpus_per_node,
                   profile=cluster.profile_name, device_mem_bytes=cluster.profile.mem_bytes,
                   mem_limit_bytes=limits.mem_limit_bytes, mem_headroom=limits.headroom,
                   host_mem_bytes=cluster.host_mem_bytes if cluster.offload_allowed else None,
                   tp_degree=mesh.tp, sequence_parallel=mesh.sequence_parallel, pp_degree=mesh.pp, ep_degree=mesh.ep,
                   cp_degree=mesh.cp,
                   allocator_conf=limits.allocator_conf,
                   mem_fitted_to="needed" if limits.fits_needed else "allocated")

    @property
    def planned_bytes(self) -> int:
        """What the plan's live peak was made to fit: the limit less the headroom, less the caching allocator's
        margin where the plan is fitted to what it needs."""
        return self.limits.planned_bytes

    def planned_for(self, table) -> int:
        """What `table`'s solver rows (the live bytes, or with the native allocator's margin per time point what
        that allocator needs) were made to fit."""
        return self.limits.planned_for(table)

    @property
    def expandable_segments(self) -> bool:
        """Whether the configuration the plan was made for turns expandable segments on (None, an older plan or
        another device: torch's default, off; one torch would refuse: off, as `autoplan apply` then says)."""
        return self._modelled[0]

    @property
    def max_split_size(self) -> int | None:
        """The configuration's `max_split_size_mb` in bytes, natively (None: unset, or a configuration torch would
        refuse)."""
        return self._modelled[1]

    @property
    def _modelled(self) -> tuple[bool, int | None]:
        try:
            return modelled_options(self.allocator_conf or "")
        except ValueError:
            return False, None

    @property
    def limits(self) -> Limits:
        return Limits(self.mem_limit_bytes, self.mem_headroom, allocator_conf=self.allocator_conf,
                      fit_to=self.mem_fitted_to)

    @property
    def mesh(self) -> Mesh:
        """The mesh the plan runs on; PlanFileError where the file's counts do not make one."""
        try:
            mesh = Mesh(nodes=self.nodes, gpus_per_node=self.gpus_per_node, tp=self.tp_degree,
                        sequence_parallel=self.sequence_parallel, pp=self.pp_degree, ep=self.ep_degree,
                        cp=self.cp_degree)
        except MeshError as exc:
            raise PlanFileError(f"the plan's cluster is not a mesh: {exc}") from None
        if mesh.world_size != self.world_size:
            raise PlanFileError(f"the plan's cluster has world_size {self.world_size}, but {self.nodes} node(s) x "
                                f"{self.gpus_per_node} GPU(s) make {mesh.world_size}; make the plan again")
        return mesh
