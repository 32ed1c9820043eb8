"""One unit's FSDP2 call, and where each unit's state lives: on the device, or offloaded to the host.

Why apart from apply.py: offload decides three things beyond the `fully_shard` call itself, which must
agree: the offload policy (FSDP2's CPUOffloadPolicy: the unit's sharded parameters, gradients and
optimizer states in host memory, pinned where the device is a GPU; FSDP2 copies each shard to the
device for its all-gather and each reduced gradient back), the device each parameter is materialised
on (FSDP2 refuses an offloaded parameter that is not on the host), and the optimizer's parameter
groups (one per device: torch picks its foreach implementation per group, and a group that mixed host
and GPU tensors would step one tensor at a time). On a CPU device the host is the device: the same
calls run and nothing is copied.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from cost_models.options import ShardingKind

__all__ = ["apply_fsdp", "host_state_bytes", "materialise", "offloaded_params", "param_groups",
           "watch_host_state"]


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, kind: ShardingKind, mp_policy: MixedPrecisionPolicy, *,
               offload: bool = False, pin_memory: bool = False, shard_placement_fn=None) -> None:
    """FSDP2's `fully_shard` on one unit as its sharding kind's row says (`mesh` is the kind's), its
    parameters, gradients and optimizer states on the host where `offload`; `shard_placement_fn`: the
    dimension each parameter is sharded on (None: the first; autoplan.run.experts for expert stacks)."""
    fully_shard(module, mesh=mesh, reshard_after_forward=kind.reshard_after_forward, mp_policy=mp_policy,
                offload_policy=CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy(),
                shard_placement_fn=shard_placement_fn)


def _unit_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 manages for this unit (its own, not those of units inside it)."""
    state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
    group = getattr(state, "_fsdp_param_group", None)
    return [fsdp_param.sharded_param for fsdp_param in group.fsdp_params] if group is not None else []


def offloaded_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the units that fully_shard put on the host (CPUOffloadPolicy)."""
    found: list[nn.Parameter] = []
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
            found += _unit_params(module)
    return found


def param_groups(model: nn.Module) -> list[dict] | list[nn.Parameter]:
    """The optimizer's parameters: all of them, or, where units are offloaded, a group of those on the
    device and a group of those on the host."""
    offloaded = offloaded_params(model)
    if not offloaded:
        return list(model.parameters())
    on_host = {id(param) for param in offloaded}
    on_device = [param for param in model.parameters() if id(param) not in on_host]
    return [group for group in ({"params": on_device}, {"params": offloaded}) if group["params"]]


def materialise(model: nn.Module, device: torch.device | str, seed: int) -> None:
    """Allocate a meta-built model on `device` (offloaded units' parameters on the host) and initialise it;
    the same seed on every rank.

    On a CPU mesh each rank draws its shards from its own generator: the same seed keeps replicated
    parameters equal across ranks (sharded ones are not the values a single process would draw).
    DTensor warns about exactly that, so the warning is silenced here.
    """
    on_host = {id(param) for param in offloaded_params(model)}
    if on_host and torch.device(device).type != "cpu":  # offloaded shards are made on the host (FSDP2 wants them there)
        model._apply(lambda t: torch.empty_like(t, device="cpu" if id(t) in on_host else device))
    else:
        model.to_empty(device=device)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")
        if hasattr(model, "init_weights"):
            model.init_weights()
            return
        for module in model.modules():  # a user model without init_weights: each layer's own init
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()


def host_state_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages that hold `params` (offloaded ones: see offloaded_params), their gradients and
    their optimizer states, each storage counted once: the host memory offload takes, measured."""
    storages: dict[int, int] = {}
    for param in params:
        state = optimizer.state.get(param, {})
        for tensor in (param, param.grad, *state.values()):
            if isinstance(tensor, torch.Tensor):
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def watch_host_state(model: nn.Module, optimizer: torch.optim.Optimizer, record: Callable[[int], None]) -> None:
    """After every optimizer step (gradients still there, states made), `record(bytes)` of what the offloaded
    units hold on the host (host_state_bytes). Nothing is watched where no unit is offloaded."""
    offloaded = offloaded_params(model)
    if offloaded:
        optimizer.register_step_post_hook(lambda *_: record(host_state_bytes(offloaded, optimizer)))
