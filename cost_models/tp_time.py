"""What tensor parallelism adds to a step's time: each unit's TP collectives, on the critical path between its
matmuls (compute-side time, not overlapped with it), and the network links a node's data-parallel groups
share (`tp_profile`). The layout and the per-rank view of ops and units are cost_models.tensor_parallel's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.choices import Option
from cost_models.comm import CommModel
from cost_models.options import Recompute
from cost_models.profile import DeviceProfile
from cost_models.records import Unit
from cost_models.tensor_parallel import TpLayout, TpRole, owners, parallelized_modules

__all__ = ["LOSS_COLLECTIVES", "TpTime", "add_tp_time", "tp_collectives", "tp_profile"]

# loss_parallel's forward all-reduces three per-token fp32 vectors across the group (max, sum of exp, target logit)
LOSS_COLLECTIVES = 3
_LOSS_BYTES = 4


@dataclass(frozen=True)
class TpTime:
    """One unit's tensor-parallel collectives per micro-batch: seconds and calls, forward and backward."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    calls_fwd: int = 0
    calls_bwd: int = 0

    def plus(self, collectives: list[tuple[str, float]], comm: CommModel, t: int, backward: bool) -> "TpTime":
        seconds = sum(comm.collective_s(name, nbytes, t, "intra_node") for name, nbytes in collectives)
        if backward:
            return replace(self, bwd_s=self.bwd_s + seconds, calls_bwd=self.calls_bwd + len(collectives))
        return replace(self, fwd_s=self.fwd_s + seconds, calls_fwd=self.calls_fwd + len(collectives))


def tp_collectives(units: list[Unit], layout: TpLayout, micro_batch_size: int, seq_len: int, compute_bytes: int,
                   profile: DeviceProfile, local_vocab: int = 0) -> list[TpTime]:
    """Per unit, its TP collectives on the profile's intra-node fits (the group is inside a node).
    A region (attention or MLP): without sequence parallelism one all-reduce of the activation
    [micro-batch, seq, hidden] forward (the row-wise output) and, backward, one per column-wise projection
    (torch's ColwiseParallel makes each projection's replicated input a DTensor of its own, whose gradient it
    all-reduces alone: q, k and v three, gate and up two; measured, 21 backward all-reduces per step for a
    4-block llama, not 9); with it, an all-gather and a reduce-scatter each way (PrepareModuleInput gives
    the projections one shared input, whose gradient is reduced once). The vocabulary-parallel embedding
    completes its output forward (all-reduce, or reduce-scatter along the sequence); the head gathers its
    input forward and reduces its gradient backward with sequence parallelism, only the latter without;
    the loss adds its small all-reduces, and, where the profile measured it (`loss_parallel`), what
    loss_parallel's decomposed cross-entropy costs beyond the fused one on the rank's micro-batch x seq x
    `local_vocab` logits (compute on the head's unit, counted with its collectives); and, where the profile
    measured it (`tp_dispatch`), DTensor's dispatch per parallelized module (`parallelized_modules`) on the
    unit that owns the module."""
    t = layout.degree
    times = [TpTime() for _ in units]
    if t == 1:
        return times
    owner = owners(units)
    comm = _Once(CommModel(profile))
    activation = micro_batch_size * seq_len * layout.hidden * compute_bytes
    sp = layout.sequence_parallel
    pair = [("all_gather", activation), ("reduce_scatter", activation)] if sp else [("all_reduce", activation)]
    columns_under = _columns_under(layout.roles)
    for region in layout.regions:
        u = owner(region)
        backward = pair if sp else pair * max(1, columns_under.get(region, 0))
        times[u] = times[u].plus(pair, comm, t, False).plus(backward, comm, t, True)
    if layout.embedding is not None:
        u = owner(layout.embedding)
        times[u] = times[u].plus([("reduce_scatter" if sp else "all_reduce", activation)], comm, t, False)
    if layout.head is not None:
        u = owner(layout.head)
        loss = [("all_reduce", micro_batch_size * seq_len * _LOSS_BYTES)] * LOSS_COLLECTIVES
        times[u] = times[u].plus(([("all_gather", activation)] if sp else []) + loss, comm, t, False)
        times[u] = times[u].plus([("reduce_scatter" if sp else "all_reduce", activation)], comm, t, True)
        extra = profile.loss_parallel
        if extra is not None and local_vocab:
            logits = micro_batch_size * seq_len * local_vocab
            times[u] = replace(times[u], fwd_s=times[u].fwd_s + extra.fwd_s + extra.fwd_s_per_logit * logits,
                               bwd_s=times[u].bwd_s + extra.bwd_s + extra.bwd_s_per_logit * logits)
    if profile.tp_dispatch is not None:
        fwd, bwd = profile.tp_dispatch.per_module(sp)
        for path in parallelized_modules(layout):
            u = owner(path)
            times[u] = replace(times[u], fwd_s=times[u].fwd_s + fwd, bwd_s=times[u].bwd_s + bwd)
    return times


class _Once:
    """A CommModel whose collective_s is computed once per distinct call (every block's region asks the same)."""

    def __init__(self, comm: CommModel):
        self.comm, self.seen = comm, {}

    def collective_s(self, *args) -> float:
        if args not in self.seen:
            self.seen[args] = self.comm.collective_s(*args)
        return self.seen[args]


_COLUMNS: dict[int, tuple] = {}  # id(roles) -> (roles, module path -> column-wise projections below it)


def _columns_under(roles) -> dict[str, int]:
    """Per module path, the column-wise projections below it, once per layout's roles (a pipeline's stages share
    them: cut layouts keep the model's roles)."""
    if id(roles) not in _COLUMNS or _COLUMNS[id(roles)][0] is not roles:
        columns_under: dict[str, int] = {}
        for path, role in roles.items():
            if role is TpRole.COLWISE:
                parts = path.split(".")
                for depth in range(1, len(parts)):
                    ancestor = ".".join(parts[:depth])
                    columns_under[ancestor] = columns_under.get(ancestor, 0) + 1
        if len(_COLUMNS) > 64:
            _COLUMNS.clear()
        _COLUMNS[id(roles)] = (roles, columns_under)
    return _COLUMNS[id(roles)][1]


def add_tp_time(options: list[list[Option]], costs: list, times: list[TpTime], call_fwd_s: float = 0.0,
                call_bwd_s: float = 0.0) -> None:
    """Add each unit's TP collectives to its costs (in place): to the forward, and to the backward with,
    for a fully checkpointed unit, the forward's again (its recomputation runs them again; a selective
    checkpoint keeps the collectives' outputs, see autoplan.run.ac). `call_*_s`: the profile's in-step
    cost of one collective call (FsdpOverhead), charged per TP call as per FSDP call."""
    for unit_options, unit_costs, time in zip(options, costs, times):
        if not (time.calls_fwd or time.calls_bwd):
            continue
        fwd = time.fwd_s + time.calls_fwd * call_fwd_s
        bwd = time.bwd_s + time.calls_bwd * call_bwd_s
        for option, cost in zip(unit_options, unit_costs):
            cost.fwd_s += fwd
            cost.bwd_s += bwd + (fwd if option.recompute is Recompute.ALL else 0.0)


def tp_profile(profile: DeviceProfile, degree: int) -> DeviceProfile:
    """The profile as one data-parallel group sees it: the inter-node collective fits were measured by rings
    over whole nodes, which use every NIC of a node; with degree t, t data-parallel groups run side by side
    and share them, so each gets 1/t of that bandwidth (beta x t). Intra-node links are per GPU (NVSwitch)
    and stay as they are."""
    if degree == 1:
        return profile
    fits = [fit.model_copy(update={"beta_s_per_byte": fit.beta_s_per_byte * degree}) if fit.scope == "inter_node"
            else fit for fit in profile.collectives]
    return profile.model_copy(update={"collectives": fits})
