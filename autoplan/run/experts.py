"""Expert parallelism at run time: each mixture-of-experts layer's experts split by expert over the plan's
expert-parallel groups, tokens sent to their experts' ranks and back with all-to-alls (as torchtitan's
`ExpertParallel` does), FSDP2 sharding the experts over the data-parallel ranks left.

The plan's data-parallel mesh is unflattened into (dp / ep, ep) (`Mesh.expert_meshes`, torchtitan's
"dp_mod_ep" and "ep"). Each expert stack's weights become DTensors sharded on the expert dimension over the
"ep" mesh (a rank holds E / ep experts); `fully_shard` then shards them over "dp_mod_ep" (on their second
dimension where a rank holds fewer experts than that mesh has ranks: on the first, each rank would pad to a
whole expert); their gradients are averaged over all of dp, as the other units' are (a rank's experts
receive the gradients of every rank's tokens routed to them: `_ScaleGrad`).

The model's code stays free of parallelism: the stack's module is swapped at apply time for
`ExpertParallelExperts`, whose forward routes as the zoo's `Experts.forward` does (pairs sorted by expert,
gathered, grouped matmuls, weighted and added back per token) with the exchange around the matmuls:
1. dispatch: the per-expert pair counts go to every rank of the group (all_to_all_single), then the pairs
   themselves, each to the rank holding its expert (all_to_all_single_autograd: its backward sends the
   gradients back);
2. the received pairs, laid out by source rank then local expert, are reordered by local expert for the
   grouped matmuls over the rank's own experts;
3. combine: the outputs, put back in source order, return to the ranks their tokens came from.
Module paths and parameter names stay the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autoplan.errors import PlanFileError, UsageError
from autoplan.models.experts import check_expert_degree, experts_of
from autoplan.models.moe import Experts
from cost_models.mesh import Mesh
from cost_models.options import MeshShape, ShardingKind

__all__ = ["ExpertMeshes", "ExpertParallelExperts", "apply_ep", "check_experts", "expert_placement",
           "expert_stacks_of", "fully_shard_experts"]


@dataclass(frozen=True)
class ExpertMeshes:
    """Where the experts run: the stacks' module paths, their FSDP mesh (dp / ep) and the expert-parallel
    mesh."""

    stacks: frozenset[str]
    fsdp: DeviceMesh
    ep: DeviceMesh


class ExpertParallelExperts(Experts):
    """The zoo's experts with this rank's E / ep of them (DTensor weights on the "ep" mesh) and the all-to-all
    exchange of routed tokens (see the module docstring)."""

    ep_mesh: DeviceMesh

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        top_k, ep = experts.shape[-1], self.ep_mesh.size()
        group = self.ep_mesh.get_group()
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, expert) pairs by expert
        tokens = order // top_k
        routed = x[tokens]
        counts = torch.bincount(flat, minlength=self.n_experts)
        local_experts = self.n_experts // ep
        received_counts = _received_counts(counts, group, ep, local_experts)  # [source rank, local expert]
        send = counts.view(ep, -1).sum(1).tolist()
        receive = received_counts.view(ep, -1).sum(1).tolist()
        received = all_to_all_single_autograd(routed, receive, send, group)
        # source-major blocks to expert-major: each row's (source, local expert) block, sorted by expert first
        blocks = torch.repeat_interleave(torch.arange(ep * local_experts, device=x.device), received_counts)
        by_expert = torch.argsort((blocks % local_experts) * ep + blocks // local_experts, stable=True)
        offsets = torch.cumsum(received_counts.view(ep, local_experts).sum(0), dim=0).to(torch.int32)
        w1, w2, w3 = (_ScaleGrad.apply(_local(w), 1.0 / ep) for w in (self.w1, self.w2, self.w3))
        local = received[by_expert]
        gate = torch._grouped_mm(local, w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(local, w3.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
        out = out[torch.argsort(by_expert)]  # back in source order
        out = all_to_all_single_autograd(out, send, receive, group)
        out = out * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tokens, out)  # the combine


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward. A rank's experts receive the gradients of the
    tokens of all ep ranks of its group, summed; FSDP averages them over the dp / ep ranks holding the same
    experts; this divides by ep, so that they are averaged over all of dp as every other weight's are (FSDP2's
    set_gradient_divide_factor would, but gloo has no pre-multiplied sum)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _received_counts(counts: torch.Tensor, group, ep: int, local_experts: int) -> torch.Tensor:
    """The pairs each source rank sends for each of this rank's experts, flattened [source, local expert]: from
    the group. On the fake process group (one rank of a big world, `autoplan apply --fake-world`) nothing
    moves: the routing is taken as balanced, as the pricing takes it (each rank's pairs spread evenly)."""
    if dist.get_backend(group) != "fake":
        received = all_to_all_single(counts, None, None, group)
        return received.wait() if hasattr(received, "wait") else received
    pairs = int(counts.sum())
    even = torch.full((ep * local_experts,), pairs // (ep * local_experts), dtype=counts.dtype, device=counts.device)
    even[0] += pairs - int(even.sum())
    return even


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def expert_stacks_of(model: nn.Module) -> frozenset[str]:
    """The model's expert stacks' module paths (FSDP alone shards them as `expert_placement` says too)."""
    return frozenset(experts_of(model).stacks)


def check_experts(model: nn.Module, ep: int, model_name: str, decisions: dict) -> None:
    """PlanFileError, before anything runs, where the plan's expert-parallel degree cannot split the model's
    experts: no experts, a degree not dividing them, stacks other than the zoo's, or an expert stack's
    decision (module path -> (sharding kind, offload)) that does not run beside the split."""
    if ep == 1:
        return
    info = experts_of(model)
    try:
        check_expert_degree(info, ep, model_name)
    except UsageError as exc:
        raise PlanFileError(f"the plan's expert-parallel degree: {exc}") from None
    for path in info.stacks:
        module = model.get_submodule(path)
        if type(module) is not Experts:
            raise PlanFileError(f"expert parallelism runs the zoo's mixture-of-experts layers; {path} is a "
                                f"{type(module).__name__} (plan this model without `ep`)")
        kind, offload = decisions.get(path, (None, False))
        if kind is not None and (kind.mesh != MeshShape.WORLD or offload):
            raise PlanFileError(f"expert stack {path}: {kind.name}{' with offload' if offload else ''} does not run "
                                "beside expert parallelism (shard, shard_keep; no offload)")


def apply_ep(model: nn.Module, record: Mesh, dp_mesh: DeviceMesh, model_name: str) -> ExpertMeshes | None:
    """Split the model's experts over the plan's expert-parallel groups (None without expert parallelism):
    each stack's module swapped for ExpertParallelExperts, its weights sharded on the expert dimension
    (`check_experts` has passed: apply's check_plan runs it)."""
    if record.ep == 1:
        return None
    info = experts_of(model)
    fsdp_mesh, ep_mesh = record.expert_meshes(dp_mesh)
    for path in info.stacks:
        module = model.get_submodule(path)
        module.__class__ = ExpertParallelExperts
        module.ep_mesh = ep_mesh
        for name, param in list(module.named_parameters(recurse=False)):
            local = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))
    return ExpertMeshes(frozenset(info.stacks), fsdp_mesh, ep_mesh)


def expert_placement(mesh: DeviceMesh):
    """FSDP2's shard_placement_fn for an expert stack sharded over `mesh` (its last dimension shards): a
    parameter's second dimension where a rank holds fewer experts than that dimension has ranks (torchtitan's
    choice: on the first, each rank would pad its share to a whole expert) where that dimension divides evenly,
    else the first."""
    shard = mesh.size(mesh.ndim - 1)

    def placement(param: nn.Parameter) -> Shard:
        local_experts = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        second = param.shape[1] if param.dim() > 1 else 0  # FSDP2 shards a dimension past the first only evenly
        return Shard(1) if local_experts < shard and second % shard == 0 and second else Shard(0)

    return placement


def fully_shard_experts(module: nn.Module, experts: ExpertMeshes, kind: ShardingKind, mp_policy, offload: bool) -> None:
    """FSDP2 on an expert stack: over the experts' FSDP mesh (dp / ep), resharded as its kind says (its
    gradients averaged over that mesh, and over ep by the forward's _ScaleGrad). Only the kinds that shard
    over the whole group run here."""
    if kind.mesh != MeshShape.WORLD or offload:
        raise PlanFileError(f"expert stack {type(module).__name__}: {kind.name}"
                            f"{' with offload' if offload else ''} does not run beside expert parallelism "
                            "(shard, shard_keep; no offload)")
    fully_shard(module, mesh=experts.fsdp, reshard_after_forward=kind.reshard_after_forward, mp_policy=mp_policy,
                shard_placement_fn=expert_placement(experts.fsdp))


