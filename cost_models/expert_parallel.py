"""Expert parallelism: what one rank of an expert-parallel group holds, sends and runs.

With degree e (borrowed from the data-parallel ranks, as torchtitan's: cost_models.mesh.Mesh.ep), each
mixture-of-experts layer's stacked experts are split by expert over a group of e neighbouring ranks: a rank
holds E / e experts, and the experts' FSDP shards those over the dp / e ranks that hold the same ones. So
per rank the experts' parameters, gradients and optimizer states are (E / e) / (dp / e) of a stack, as under
FSDP alone over dp, but each gather and reduction moves 1/e of the stack over a group of dp / e (and a
replicated or kept-gathered expert unit holds 1/e of it). Other weights shard over all of dp as before.

What it adds is the token exchange: before its experts a rank sends every (token, expert) pair to the rank
holding that expert and receives the pairs routed to its own (the dispatch), and sends the outputs back
after them (the combine): two all-to-alls forward, two backward, of the rank's routed tokens
(micro-batch x seq x top_k x hidden x the compute dtype's bytes, times the capacity factor: the most loaded
rank receives that many times the average), inside a node where the group is, else over the network, on
the critical path between the router and the experts' matmuls. An all-to-all sends (e - 1) / e of its
buffer as an all-gather of the same buffer does, and is priced as one where the profile has no all-to-all
fit. The experts' FLOPs per rank are those of its own tokens' pairs (balanced routing sends as many pairs
to each rank as it routes; the imbalance is the capacity factor's, already in the traced expert matmuls),
and its activations stay as traced (the received pairs replace the gathered ones).

This module imports nothing from autoplan and nothing from torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.comm import CommModel
from cost_models.mesh import Mesh
from cost_models.options import SHARDING_KINDS, MeshShape
from cost_models.profile import DeviceProfile
from cost_models.records import ParamInfo, Unit
from cost_models.tp_time import TpTime

__all__ = ["ALL_TO_ALLS_BWD", "ALL_TO_ALLS_FWD", "ExpertLayout", "all_to_all_bytes", "all_to_all_times",
           "ep_units", "expert_kind_runs", "expert_options", "expert_unit_indices"]

ALL_TO_ALLS_FWD = 2  # dispatch and combine
ALL_TO_ALLS_BWD = 2  # their gradients, sent back the other way


@dataclass(frozen=True)
class ExpertLayout:
    """A model's experts at one expert-parallel degree: the stacks' module paths, the experts per stack, the
    routing's top-k, the routed token's width, and the capacity factor the expert matmuls are priced at."""

    degree: int
    stacks: tuple[str, ...]
    n_experts: int
    top_k: int
    hidden: int
    capacity_factor: float = 1.0


def expert_unit_indices(units: list[Unit], layout: ExpertLayout) -> list[int]:
    """The units that are expert stacks."""
    stacks = set(layout.stacks)
    return [i for i, unit in enumerate(units) if unit.path in stacks]


def ep_units(units: list[Unit], layout: ExpertLayout, shard: int = 1) -> list[Unit]:
    """The units with each expert stack's parameters as one rank holds them: E / e experts. Where fewer local
    experts than the `shard` ranks of the experts' FSDP group, FSDP shards them on their second dimension
    (as torchtitan does; on the first, each rank would pad to a whole expert): their shapes are given with
    that dimension first, which is the one the FSDP pricing splits (cost_models.option_cost.local_numel);
    FSDP2 splits a dimension past the first only evenly, so where it does not divide, the first it is.
    At degree 1 (FSDP alone over more ranks than experts) only that."""
    e = layout.degree
    out = list(units)
    for i in expert_unit_indices(units, layout):
        params = []
        for param in units[i].params:
            if param.shape[0] % e:
                raise ValueError(f"parameter {param.name} {list(param.shape)}: its {param.shape[0]} experts do not "
                                 f"divide by the expert-parallel degree {e}")
            local = (param.shape[0] // e,) + tuple(param.shape[1:])
            if local[0] < shard and len(local) > 1 and local[1] % shard == 0:  # FSDP2: only evenly past dim 0
                local = (local[1], local[0]) + local[2:]
            params.append(ParamInfo(param.name, local))
        out[i] = replace(units[i], params=params)
    return out


def all_to_all_bytes(layout: ExpertLayout, micro_batch_size: int, seq_len: int, compute_bytes: int) -> int:
    """One dispatch's (or combine's) buffer on a rank: its routed pairs x hidden, at the capacity factor."""
    pairs = micro_batch_size * seq_len * layout.top_k
    return int(pairs * layout.hidden * compute_bytes * layout.capacity_factor)


def all_to_all_times(units: list[Unit], layout: ExpertLayout, nbytes: int, profile: DeviceProfile,
                     mesh: Mesh) -> list[TpTime]:
    """Per unit, its expert-parallel all-to-alls per micro-batch (none but on expert stacks): ALL_TO_ALLS_FWD
    forward and ALL_TO_ALLS_BWD backward over the `mesh.ep` group, in its scope (`Mesh.expert_scope`)."""
    times = [TpTime() for _ in units]
    if layout.degree == 1:
        return times
    comm = CommModel(profile, mesh.gpus_per_node, mesh.dp_per_node)
    scope = mesh.expert_scope
    fits = any(f.collective == "all_to_all" for f in profile.collectives)
    one = comm.collective_s("all_to_all" if fits else "all_gather", nbytes, layout.degree, scope)
    for i in expert_unit_indices(units, layout):
        times[i] = TpTime(fwd_s=ALL_TO_ALLS_FWD * one, bwd_s=ALL_TO_ALLS_BWD * one,
                          calls_fwd=ALL_TO_ALLS_FWD, calls_bwd=ALL_TO_ALLS_BWD)
    return times


def expert_kind_runs(strategy: str, offload: bool) -> bool:
    """Whether a uniform strategy runs on expert stacks beside expert parallelism (see expert_options)."""
    return SHARDING_KINDS[strategy].mesh == MeshShape.WORLD and not offload


def expert_options(options: list) -> list[int]:
    """Of an expert stack's options, those that run beside expert parallelism (their indices): kinds sharding
    over the whole experts' data-parallel group, without offload (replicate and hybrid would need meshes of
    the experts' group that apply does not build; offload is not offered beside DTensor's parameters)."""
    return [i for i, option in enumerate(options) if option.kind.mesh == MeshShape.WORLD and not option.offload]
