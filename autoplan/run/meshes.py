"""The DeviceMeshes a plan runs on, from what a training script hands `apply`.

A team's script already has a mesh, often of more dimensions than the plan knows: a pipeline or
context-parallel dimension around the data-parallel ranks, or its own ("dp", "tp") mesh. `apply` takes:

- nothing: a 1-D mesh over the initialised process group's world, split as the plan's `Mesh` says
  (`Mesh.split`: a (world / tp) x tp mesh named ("dp", "tp") when the plan is tensor-parallel);
- a 1-D DeviceMesh over the ranks that run the plan, split the same way;
- a DeviceMesh of several named dimensions: the plan runs on its "dp" dimension and, for a
  tensor-parallel plan, its "tp" dimension, for a context-parallel one its "cp" dimension, for a pipelined
  plan its "pp" dimension (the names `Mesh.dims` gives); any other dimension ("pp" under a plan without a
  pipeline, ...) is the script's own, each of its coordinates running one copy of the plan;
- the `Mesh` record (`plan.cluster.mesh`, or one of the same degrees with another node layout): a world
  mesh built from it, its nodes deciding the hybrid sharding kind's groups.

The plan's world is pipeline degree x data-parallel ranks x context- x tensor-parallel degrees; fewer
data-parallel ranks is a dry run. FSDP shards over the data x context-parallel ranks (flattened to one
dimension, "dp_cp").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.errors import PlanFileError, UsageError
from autoplan.plan.schema import Plan
from cost_models.mesh import Mesh, MeshError

__all__ = ["PlanMeshes", "plan_meshes", "world_mesh"]


@dataclass(frozen=True)
class PlanMeshes:
    """Where a plan runs on this rank: its data-parallel mesh, its tensor-parallel mesh (None without tensor
    parallelism), the mesh record whose node layout the hybrid sharding kind follows, and the pipeline mesh
    (None without a pipeline: this rank's pipeline group, one rank per stage group)."""

    dp: DeviceMesh  # the ranks FSDP shards over: data x context parallel ("dp_cp", flattened) with a "cp" mesh
    tp: DeviceMesh | None
    record: Mesh
    cp: DeviceMesh | None = None  # the context-parallel mesh (autoplan.run.context)
    pp: DeviceMesh | None = None

    @property
    def ranks(self) -> int:
        """The ranks of one copy of the plan: pipeline degree x FSDP's ranks (data x context parallel) x
        tensor-parallel degree."""
        return self.dp.size() * (self.tp.size() if self.tp is not None else 1) * (self.pp.size() if self.pp else 1)


def world_mesh() -> DeviceMesh:
    """A 1-D mesh over the world of the initialised process group (CUDA under nccl, else the CPU)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "apply() needs torch.distributed initialised (run under torchrun and call "
            "init_process_group first), or a mesh"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def plan_meshes(plan: Plan, mesh: DeviceMesh | Mesh | None) -> PlanMeshes:
    """The meshes `plan` runs on, from what the caller gave (see the module docstring). PlanFileError where
    the mesh cannot run the plan's degrees, UsageError for a mesh that is not one."""
    planned = plan.cluster.mesh
    if isinstance(mesh, Mesh):
        return _of_record(planned, mesh)
    if mesh is None:
        mesh = world_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise UsageError(f"`mesh` takes a DeviceMesh or the plan's Mesh record (plan.cluster.mesh), not "
                         f"{type(mesh).__name__}")
    if mesh.ndim == 1:
        return _split(planned, mesh, planned)
    return _named(planned, mesh)


def _split(planned: Mesh, world: DeviceMesh, record: Mesh) -> PlanMeshes:
    try:
        pp_mesh, fsdp_mesh, cp_mesh, tp_mesh = planned.split_dims(world)
    except MeshError as exc:
        raise PlanFileError(str(exc)) from None
    return PlanMeshes(fsdp_mesh, tp_mesh, record, cp_mesh, pp_mesh)


def _of_record(planned: Mesh, record: Mesh) -> PlanMeshes:
    """The caller's record must have the plan's parallel degrees; its world is this process group's."""
    if record.cp != planned.cp:
        raise PlanFileError(f"the mesh record has context-parallel degree {record.cp}, the plan {planned.cp}; pass "
                            "plan.cluster.mesh, or make the plan for these degrees")
    if record.pp != planned.pp:
        raise PlanFileError(f"the mesh record has pipeline degree {record.pp}, the plan {planned.pp}; pass "
                            "plan.cluster.mesh, or make the plan for these degrees")
    if (record.tp, record.sequence_parallel) != (planned.tp, planned.sequence_parallel):
        raise PlanFileError(f"the mesh record has tensor-parallel degree {record.tp}"
                            f"{' with sequence parallelism' if record.sequence_parallel else ''}, the plan "
                            f"{planned.tp}{' with sequence parallelism' if planned.sequence_parallel else ''}; "
                            "pass plan.cluster.mesh, or make the plan for these degrees")
    world = world_mesh()
    if world.size() != record.world_size:
        raise UsageError(f"the mesh record is of {record.world_size} ranks ({record.nodes} node(s) x "
                         f"{record.gpus_per_node}), but the process group has {world.size()}")
    return _split(planned, world, record)


def _named(planned: Mesh, mesh: DeviceMesh) -> PlanMeshes:
    """A mesh of several dimensions: the plan's by their names, the others the caller's."""
    names = tuple(mesh.mesh_dim_names or ())
    wanted = [name for name, _ in planned.dims]
    shape = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) if names else "x".join(map(str, mesh.shape))
    if not names or "dp" not in names:
        raise UsageError(f"a {mesh.ndim}-D mesh ({shape}) must name its data-parallel dimension \"dp\" (and a "
                         "tensor-parallel plan's \"tp\"): init_device_mesh(..., mesh_dim_names=(..., \"dp\", \"tp\"))")
    tp_size = mesh.shape[names.index("tp")] if "tp" in names else 1
    if planned.tp > 1 and "tp" not in names:
        raise PlanFileError(f"the plan is tensor-parallel (degree {planned.tp}) and the mesh ({shape}) has no \"tp\" "
                            f"dimension; give a mesh with dimensions {tuple(wanted)}")
    if tp_size != planned.tp:
        raise PlanFileError(f"the mesh's \"tp\" dimension has {tp_size} ranks, the plan's tensor-parallel degree is "
                            f"{planned.tp}; make the plan for this mesh (`autoplan search --tp {tp_size}`)")
    cp_size = mesh.shape[names.index("cp")] if "cp" in names else 1
    if cp_size != planned.cp:
        raise PlanFileError(f"the mesh's \"cp\" dimension has {cp_size} ranks, the plan's context-parallel degree is "
                            f"{planned.cp}; make the plan for this mesh (`autoplan search --cp {cp_size}`)")
    pp_size = mesh.shape[names.index("pp")] if "pp" in names else 1
    if planned.pp > 1 and pp_size != planned.pp:
        found = f'a "pp" dimension of {pp_size}' if "pp" in names else 'no "pp" dimension'
        raise PlanFileError(f"the plan is pipelined over {planned.pp} ranks and the mesh ({shape}) has {found}; "
                            f"give a mesh with dimensions {tuple(wanted)}")
    tp = mesh["tp"] if planned.tp > 1 else None
    pp = mesh["pp"] if planned.pp > 1 else None
    if planned.cp == 1:
        return PlanMeshes(mesh["dp"], tp, planned, None, pp)
    return PlanMeshes(mesh["dp", "cp"]._flatten("dp_cp"), tp, planned, mesh["cp"], pp)
