"""The mesh a plan runs on: its parallel degrees and the hardware they are laid on, in one record.

Every view of the cluster that the cost models, the search and `apply` need derives from `Mesh`: the
world size, the data-parallel ranks left once tensor parallelism has taken its groups, how many ranks a
sharding kind splits a parameter over, which collectives cross nodes, the rank whose rows a rank trains
on, and, at run time, the DeviceMeshes FSDP2 and DTensor get. Before it, seven records each held part
of this (a cluster shape, a data-parallel view, the run's meshes, ...), and every new dimension added one
more. Like torchtitan's `ParallelDims`: one frozen object, validated once.

The degrees, outermost first: pipeline (`pp`, contiguous groups of ranks, one per stage: whole nodes,
or parts of a node when there are more stages than nodes), data parallel (what is left: `dp`), tensor
parallel (`tp`, groups of neighbouring ranks inside a node), with context parallel between the last two
(`cp`: each sequence split over cp ranks, ring attention between them). FSDP shards parameters over dp x cp
(`fsdp_ranks`: the ranks of a context-parallel group hold the same parameters, so they join the sharding
group, as torchtitan's "dp_shard_cp"); a batch's rows divide over dp alone. Expert parallelism (`ep`) borrows
from the data-parallel ranks, as torchtitan's does: it splits them into (dp / ep, ep) for the experts alone. A
new dimension (pipeline, context, expert) is a field here, with its place in `dims`, its share of the world in
`dp`, its checks in `__post_init__` and its sub-mesh in `split`; the cost models and the search read the
derived views, not the fields.

The per-unit sharding kinds (cost_models.options) choose how FSDP2 lays a unit over the data-parallel
ranks: over all of them (a 1-D mesh), replicated (dp, 1), or sharded within a node and replicated across
nodes (nodes, dp per node): `fsdp_shape`.

This module imports nothing from autoplan; torch only inside the methods that build DeviceMeshes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cost_models.options import MeshShape, ShardGroup

__all__ = ["DEFAULT_GPUS_PER_NODE", "FSDP_DIM_NAMES", "MAX_TP_DEGREE", "Mesh", "MeshError"]

DEFAULT_GPUS_PER_NODE = 8
MAX_TP_DEGREE = 8  # NVLink domains of today's nodes
FSDP_DIM_NAMES = ("replicate", "shard")  # a 2-D FSDP mesh's dimensions (FSDP2's HSDP convention)
INTER_NODE, INTRA_NODE = "inter_node", "intra_node"


class MeshError(ValueError):
    """Degrees that do not make a mesh; the message names the parameters (`gpus`, `tp`, ...) as the API does."""


@dataclass(frozen=True)
class Mesh:
    """The devices a plan runs on (`nodes` x `gpus_per_node`) and how its parallel dimensions divide them."""

    nodes: int = 1
    """nodes in the cluster"""

    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    """devices per node"""

    tp: int = 1
    """tensor-parallel degree: groups of `tp` neighbouring ranks of a node split each block's matmuls"""

    pp: int = 1
    """pipeline degree: the world in `pp` contiguous groups of ranks, each running one stage's units (or, for a
    looped schedule, several stages'); whole nodes per stage, or equal parts of every node"""

    sequence_parallel: bool = False
    """with `tp` above 1: the norms and the residual stream are split along the sequence too"""

    ep: int = 1
    """expert-parallel degree: borrowed from the data-parallel ranks (as torchtitan's), groups of `ep`
    neighbouring data-parallel ranks split each mixture-of-experts layer's experts; the experts' FSDP then
    shards over the dp / ep ranks left (`expert_shard`), every other weight over all of dp as before"""

    cp: int = 1
    """context-parallel degree: each sequence split over `cp` ranks (ring attention), between dp and tp"""

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node", "tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"`{name}` must be at least 1, got {value}")
        if self.gpus_per_node % self.tp:
            raise MeshError(f"`tp` {self.tp} does not divide `gpus_per_node` {self.gpus_per_node}: tensor parallelism "
                            f"runs inside a node; choose one of {', '.join(map(str, self.tensor_degrees()))}")
        self._check_pipeline()
        if self.sequence_parallel and self.tp == 1:
            raise MeshError("sequence parallelism needs a tensor-parallel degree above 1")
        if (self.world_size // (self.tp * self.pp)) % self.cp:
            raise MeshError(f"`cp` {self.cp} does not divide the {self.world_size // (self.tp * self.pp)} ranks left "
                            f"beside `tp` {self.tp}; choose one of {', '.join(map(str, self.context_degrees()))}")
        if self.cp > 1 and self.ep > 1:
            raise MeshError("expert and context parallelism together are not built: give `ep` 1 or `cp` 1")
        if self.dp % self.ep:
            raise MeshError(f"`ep` {self.ep} does not divide the {self.dp} data-parallel ranks: expert parallelism "
                            "borrows its groups from them")

    def _check_pipeline(self) -> None:
        stage = self.world_size // self.pp if self.world_size % self.pp == 0 else 0
        whole_nodes = stage >= self.gpus_per_node and stage % self.gpus_per_node == 0
        part_of_node = 0 < stage < self.gpus_per_node and self.gpus_per_node % stage == 0 and stage % self.tp == 0
        if not (whole_nodes or part_of_node):
            raise MeshError(f"`pp` {self.pp} does not cut {self.nodes} node(s) of {self.gpus_per_node} GPUs into "
                            f"equal stages of whole nodes or equal parts of a node (each a multiple of `tp` "
                            f"{self.tp}); choose one of {', '.join(map(str, self.pipeline_degrees()))}")

    def pipeline_degrees(self) -> list[int]:
        """Pipeline degrees this cluster takes at its tensor degree: divisors of the node count, then node count x
        divisors of a node's data-parallel ranks (1, 2, 4, 8 on 8 nodes; up to 8 x 8 with tp 1)."""
        per_node = self.gpus_per_node // self.tp
        return sorted({d for d in range(1, self.nodes + 1) if self.nodes % d == 0}
                      | {self.nodes * k for k in range(2, per_node + 1) if per_node % k == 0})

    @classmethod
    def of(cls, gpus: int | None = None, nodes: int | None = None, gpus_per_node: int | None = None) -> Mesh:
        """The data-parallel mesh of `gpus` GPUs on `nodes` nodes of `gpus_per_node` each, any of them left out:
        one node by default; per node, gpus / nodes or DEFAULT_GPUS_PER_NODE. MeshError where they disagree."""
        for name, value in (("gpus", gpus), ("nodes", nodes), ("gpus_per_node", gpus_per_node)):
            if value is not None and value < 1:
                raise MeshError(f"`{name}` must be at least 1, got {value}")
        nodes_or_one = nodes or 1
        if gpus_per_node is None:
            if gpus is not None and gpus % nodes_or_one:
                raise MeshError(f"`gpus` {gpus} is not a multiple of `nodes` {nodes}")
            gpus_per_node = gpus // nodes_or_one if gpus is not None else DEFAULT_GPUS_PER_NODE
        if gpus is not None and gpus != nodes_or_one * gpus_per_node:
            raise MeshError(f"`gpus` {gpus} does not equal `nodes` {nodes_or_one} x `gpus_per_node` {gpus_per_node}")
        return cls(nodes=nodes_or_one, gpus_per_node=gpus_per_node)

    # ----------------------------------------------------------------------------------------------- #
    # Degrees and derived views
    # ----------------------------------------------------------------------------------------------- #

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the world over the other degrees (the replicas a batch's rows divide over)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP shards a parameter over: data x context parallel (dp alone without context parallelism)."""
        return self.dp * self.cp

    @property
    def dp_per_node(self) -> int:
        """Ranks of the FSDP dimension (data x context parallel) in one node (of one pipeline stage, where stages
        split a node)."""
        return min(self.world_size // self.pp, self.gpus_per_node) // self.tp

    @property
    def cp_scope(self) -> str:
        """Where a context-parallel group's ring runs: inside a node while cp x tp ranks fit one."""
        return INTER_NODE if self.nodes > 1 and self.cp * self.tp > self.gpus_per_node else INTRA_NODE

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of each dimension above 1, outermost first ("dp" always): the run's DeviceMesh. The
        expert-parallel degree is no dimension of the world: it unflattens "dp" (`expert_dims`)."""
        return ((("pp", self.pp),) if self.pp > 1 else ()) + (("dp", self.dp),) + \
            ((("cp", self.cp),) if self.cp > 1 else ()) + ((("tp", self.tp),) if self.tp > 1 else ())

    @property
    def expert_dims(self) -> tuple[tuple[str, int], ...]:
        """With `ep` above 1: the data-parallel dimension unflattened into (dp / ep, ep), named as torchtitan's
        ("dp_mod_ep", "ep"), the expert-parallel groups innermost (neighbouring ranks); () without."""
        return (("dp_mod_ep", self.dp // self.ep), ("ep", self.ep)) if self.ep > 1 else ()

    @property
    def expert_shard(self) -> int:
        """Ranks the experts' FSDP shards over: the data-parallel ranks that hold the same experts."""
        return self.dp // self.ep

    @property
    def expert_scope(self) -> str:
        """Where an expert-parallel group's all-to-all runs: inside a node when its `ep` neighbouring
        data-parallel ranks are."""
        return self.scope(self.ep)

    def experts_view(self) -> Mesh:
        """The mesh as the experts' FSDP sees it: dp / ep ranks, ep x tp groups side by side in a node (a mesh
        of tensor degree ep x tp); where an expert group spans nodes, its members one per node."""
        if self.ep == 1:
            return self
        degree = self.ep * self.tp
        if self.gpus_per_node % degree == 0:
            try:
                return replace(self, tp=degree, ep=1, sequence_parallel=False)
            except MeshError:  # pipeline stages that do not split into groups of ep x tp: one rank per node
                return Mesh(self.expert_shard, 1)
        if degree % self.gpus_per_node == 0 and self.nodes % (degree // self.gpus_per_node) == 0:
            return Mesh(self.nodes // (degree // self.gpus_per_node), self.gpus_per_node, tp=self.gpus_per_node)
        return Mesh(self.expert_shard, 1)

    def with_experts(self, ep: int) -> Mesh:
        """This mesh with expert-parallel degree `ep` (MeshError where it does not divide dp)."""
        return replace(self, ep=ep)

    def expert_degrees(self, n_experts: int) -> list[int]:
        """Expert-parallel degrees for a model of `n_experts` experts: the divisors of the expert count that
        divide the data-parallel ranks (1 first; [1] for a model without experts)."""
        return [e for e in range(1, n_experts + 1) if n_experts % e == 0 and self.dp % e == 0] or [1]

    def with_tensor(self, tp: int, sequence_parallel: bool = False) -> Mesh:
        """This cluster with tensor-parallel degree `tp` (MeshError where it does not divide a node)."""
        return replace(self, tp=tp, sequence_parallel=sequence_parallel and tp > 1)

    def with_context(self, cp: int) -> Mesh:
        """This mesh with context-parallel degree `cp` (MeshError where it does not divide the ranks beside tp)."""
        return replace(self, cp=cp)

    def with_pipeline(self, pp: int) -> Mesh:
        """This mesh with pipeline degree `pp` (MeshError where its stages would not be whole nodes or equal parts
        of a node's ranks beside tp: `pipeline_degrees`)."""
        return replace(self, pp=pp)

    def context_degrees(self) -> list[int]:
        """Context-parallel degrees the ranks beside `tp` take: their divisors that are powers of two (the
        load-balanced causal sharding cuts a sequence into 2 x cp chunks)."""
        ranks = self.world_size // (self.tp * self.pp)
        return [2 ** k for k in range(ranks.bit_length()) if ranks % 2 ** k == 0]

    def tensor_degrees(self) -> list[int]:
        """Tensor-parallel degrees a node takes: its divisors up to MAX_TP_DEGREE (1, 2, 4, 8 on 8-GPU nodes)."""
        return [t for t in range(1, min(self.gpus_per_node, MAX_TP_DEGREE) + 1) if self.gpus_per_node % t == 0]

    def shard_size(self, group: ShardGroup) -> int:
        """Ranks one parameter is split over under a sharding kind's group (of the data-parallel ranks)."""
        return {ShardGroup.WORLD: self.fsdp_ranks, ShardGroup.NODE: self.dp_per_node, ShardGroup.ONE: 1}[group]

    def scope(self, group_size: int, spans_nodes: bool = False) -> str:
        """Where a collective over `group_size` data-parallel ranks runs: "inter_node" when the cluster has
        several nodes and the group spans them (`spans_nodes`: one rank per node, or larger than a node)."""
        crosses = self.nodes > 1 and (spans_nodes or group_size > self.dp_per_node)
        return INTER_NODE if crosses else INTRA_NODE

    def fsdp_shape(self, kind_mesh: MeshShape, dp_ranks: int | None = None) -> tuple[int, ...]:
        """The FSDP2 mesh of a sharding kind over `dp_ranks` data-parallel ranks (default: all of them): WORLD
        1-D, REPLICATE (dp, 1), HYBRID (nodes, dp per node). With fewer ranks than planned (a dry run), HYBRID
        keeps as much of a node as divides them."""
        ranks = self.fsdp_ranks if dp_ranks is None else dp_ranks
        if kind_mesh == MeshShape.WORLD:
            return (ranks,)
        if kind_mesh == MeshShape.REPLICATE:
            return (ranks, 1)
        if kind_mesh == MeshShape.HYBRID:
            per_node = math.gcd(self.dp_per_node, ranks)
            return (ranks // per_node, per_node)
        raise ValueError(f"no FSDP mesh for {kind_mesh!r}")

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank `rank`: the ranks of one tensor-parallel group share their rows, and
        so do the pipeline's stages (rank r of every stage trains on the same rows)."""
        return rank % (self.world_size // self.pp) // (self.tp * self.cp)

    def pipeline_rank(self, rank: int) -> int:
        """The pipeline rank (the stage group) of global rank `rank`."""
        return rank // (self.world_size // self.pp)

    # ----------------------------------------------------------------------------------------------- #
    # At run time: the DeviceMeshes (torch imported here only)
    # ----------------------------------------------------------------------------------------------- #

    def split(self, world):
        """`world` (a 1-D DeviceMesh over the ranks running the plan) as (FSDP mesh, tensor-parallel mesh or
        None): see `split_dims`, whose pipeline and context-parallel meshes it leaves out."""
        _, fsdp, _, tp = self.split_dims(world)
        return fsdp, tp

    def split_context(self, world):
        """`world` as (FSDP mesh, context-parallel mesh or None, tensor-parallel mesh or None): `split_dims`."""
        _, fsdp, cp, tp = self.split_dims(world)
        return fsdp, cp, tp

    def split_pipeline(self, world):
        """`world` as (pipeline mesh or None, FSDP mesh, tensor-parallel mesh or None): `split_dims`."""
        pp, fsdp, _, tp = self.split_dims(world)
        return pp, fsdp, tp

    def split_dims(self, world):
        """`world` as (pipeline mesh or None, FSDP mesh, context-parallel mesh or None, tensor-parallel mesh or
        None): a pp x dp x cp x tp mesh named as `dims` (the degrees above 1), as torchtitan's ParallelDims lays
        it out: rank r on pipeline rank r // (world / pp), so that a stage's ranks are one contiguous block of the
        world; a tensor-parallel group is `tp` neighbouring ranks of a node and a context-parallel group the
        nearest ranks beyond it. FSDP shards over dp x cp (flattened to one dimension "dp_cp")."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh

        if self.tp == 1 and self.cp == 1 and self.pp == 1:
            return None, world, None, None
        size, inner = world.size(), self.tp * self.cp * self.pp
        if size % inner:
            raise MeshError(f"the plan's pipeline x context x tensor-parallel degrees {self.pp} x {self.cp} x "
                            f"{self.tp} do not divide the {size} ranks running it")
        names = tuple(name for name, _ in self.dims)
        shape = tuple(size // inner if name == "dp" else degree for name, degree in self.dims)
        with unset_fake_temporarily():  # real rank numbers, also under a FakeTensorMode (see fsdp_mesh)
            mesh = DeviceMesh(world.device_type, world.mesh.view(*shape), mesh_dim_names=names)
            pp = mesh["pp"] if self.pp > 1 else None
            tp = mesh["tp"] if self.tp > 1 else None
            if self.cp == 1:
                return pp, mesh["dp"], None, tp
            return pp, mesh["dp", "cp"]._flatten("dp_cp"), mesh["cp"], tp

    def expert_meshes(self, dp_mesh):
        """The data-parallel mesh unflattened as `expert_dims` says: (the experts' FSDP mesh over dp / ep, the
        expert-parallel mesh over ep); (dp_mesh, None) without expert parallelism."""
        if self.ep == 1:
            return dp_mesh, None
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if dp_mesh.size() % self.ep:
            raise MeshError(f"the plan's expert-parallel degree {self.ep} does not divide the {dp_mesh.size()} "
                            "data-parallel ranks running it")
        from torch.distributed import get_world_size
        from torch.distributed.device_mesh import DeviceMesh

        names = tuple(name for name, _ in self.expert_dims)
        shape = (dp_mesh.size() // self.ep, self.ep)
        with unset_fake_temporarily():  # as fsdp_mesh: a slice of a larger mesh unflattens on every rank together
            mesh = (dp_mesh._unflatten(0, shape, names) if dp_mesh.size() < get_world_size()
                    else DeviceMesh(dp_mesh.device_type, dp_mesh.mesh.view(*shape), mesh_dim_names=names))
            return mesh[names[0]], mesh[names[1]]

    def fsdp_mesh(self, dp_mesh, kind_mesh: MeshShape):
        """The DeviceMesh `fully_shard` gets for a sharding kind over `dp_mesh` (the data-parallel ranks)."""
        if kind_mesh == MeshShape.WORLD:
            return dp_mesh
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed import get_world_size
        from torch.distributed.device_mesh import DeviceMesh

        shape = self.fsdp_shape(kind_mesh, dp_mesh.size())
        if dp_mesh.size() < get_world_size():
            # the data-parallel ranks are one slice of a larger mesh (a training script's pipeline or context
            # dimension around them): DeviceMesh's own unflatten makes every slice's groups, on every rank
            # together, where a DeviceMesh of this slice's ranks alone would leave the other ranks' groups unmade
            return dp_mesh._unflatten(0, shape, FSDP_DIM_NAMES)
        # a mesh's ranks are real integers, also when the model is applied under a FakeTensorMode (a rank
        # of a big world on fake tensors: autoplan.run.allocator_fit); torch would make them fake there
        with unset_fake_temporarily():
            return DeviceMesh(dp_mesh.device_type, dp_mesh.mesh.view(*shape), mesh_dim_names=FSDP_DIM_NAMES)
