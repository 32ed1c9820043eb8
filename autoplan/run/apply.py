"""Execute a plan: FSDP2 `fully_shard` per unit, leaves first and the root last.

    model = build_model(config)                     # on the meta device: no memory yet
    model, optimizer = autoplan.apply(model, plan)  # inside torchrun, after init_process_group
    model.to_empty(device="cuda"); model.init_weights()

In a team's own loop (examples/train.py): `mesh=` the script's DeviceMesh (the plan's "dp" and "tp"
dimensions by name, others its own: autoplan.run.meshes) or the plan's Mesh record; `optimizer=` any
factory of the parameters (`functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)`; the plan's
optimizer by default) and `scheduler=` a factory of the optimizer (an LR scheduler, `applied.scheduler`).

Per unit, the plan's decision maps to one FSDP2 call, as its sharding kind's row in the registry
(cost_models.options.SHARDING_KINDS) declares it; no kind is named here:
- the row's mesh: WORLD, a 1-D mesh over the world (shard, shard_keep); REPLICATE, an (N, 1) mesh
  named ("replicate", "shard"): full copies, gradients all-reduced (replicate); HYBRID, a
  (nodes, gpus_per_node) mesh: sharded within a node, replicated across nodes (hybrid);
- the row's reshard_after_forward: False keeps the parameters gathered from forward to backward;
- the checkpoint mode's row: what the unit recomputes (apply_ac in ac.py: none, selective by an op-level
  policy, full), on the unit's module before fully_shard; forward hooks, so module paths stay unchanged;
- offload: FSDP2's CPUOffloadPolicy on the unit's fully_shard (pinned host memory where the device is a
  GPU): its sharded parameters, gradients and optimizer states live on the host, and its optimizer step
  runs there. On a CPU device the host is the device: the same code path, no copy.

The precision's row gives the mixed-precision policy, the optimizer's row the torch.optim class.
The optimizer is built here over the parameters FSDP2 registered, one parameter group per device they
will live on (torch picks its foreach implementation per group, and a group mixing host and GPU
tensors would fall back to one tensor at a time). `materialise` keeps those parameter objects (FSDP2
resets its shards in place), so the optimizer stays valid; it puts offloaded units' shards on the host.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoplan.errors import PlanFileError, UsageError
from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.hf import HF_PREFIX
from autoplan.models.resolve import ResolvedModel, model_from_plan, resolve_model
from autoplan.plan.schema import Plan, UnitDecision
from autoplan.run.ac import apply_ac
from autoplan.run.experts import apply_ep, check_experts, expert_placement, expert_stacks_of, fully_shard_experts
from autoplan.run.fsdp import apply_fsdp, materialise, param_groups  # noqa: F401 - materialise: re-exported
from autoplan.run.meshes import plan_meshes
from autoplan.run.tp import apply_tp
from cost_models.mesh import Mesh
from cost_models.options import (
    CHECKPOINT_MODES,
    OPTIMIZERS,
    PRECISIONS,
    SHARDING_KINDS,
    Dtype,
    MeshShape,
    OptimizerKind,
    Precision,
    ShardingKind,
    UnknownOptionError,
    find,
    unknown_message,
)

DEFAULT_LR = 1e-3


class Applied(tuple):
    """What `apply` returns: `model, optimizer = apply(...)` unpacks it; `.scheduler` is the LR scheduler
    its `scheduler` factory made (None without one)."""

    def __new__(cls, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        applied = super().__new__(cls, (model, optimizer))
        applied.scheduler = scheduler
        return applied

    @property
    def model(self) -> nn.Module:
        return self[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self[1]


OptimizerFactory = Callable[..., torch.optim.Optimizer]  # the parameters (or their groups) -> an optimizer


def apply(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | Mesh | None = None,
    *,
    lr: float | None = None,
    dry_run: bool = False,
    optimizer: OptimizerFactory | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Applied:
    """Shard `model` as `plan` says and build its optimizer; returns (model, optimizer), and `.scheduler`.

    `model` may be on the meta device (then materialise it afterwards with `to_empty` and its
    initialisation) or on the CPU/GPU with the same weights on every rank. `mesh`: by default the whole
    world of the initialised process group; a 1-D DeviceMesh over the ranks that run the plan; a DeviceMesh
    whose dimensions are named, the plan running on its "dp" (and, tensor-parallel, "tp") dimension and any
    other being the caller's (a pipeline or context dimension); or the plan's `Mesh` record
    (plan.cluster.mesh). `optimizer`: a factory called with the parameters (one group per device they live
    on), e.g. `functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)`; by default the plan's optimizer
    with `lr`. `scheduler`: a factory called with the optimizer, e.g.
    `lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1, (step + 1) / 100))`.
    `dry_run=True` accepts fewer data-parallel ranks than the plan's, and applies its decisions there.
    Refuses a plan made for another model or world size with a PlanFileError naming the difference.
    """
    units, precision, optimizer_kind = check_plan(model, plan)
    if optimizer is not None and lr is not None:
        raise UsageError("`lr` is the plan's optimizer's; with an `optimizer` factory give the learning rate to it "
                         "(functools.partial(torch.optim.AdamW, lr=...))")
    meshes = plan_meshes(plan, mesh)
    check_world_size(meshes.ranks, plan, dry_run=dry_run)
    if meshes.tp is not None:  # tensor parallelism first (autoplan.run.tp); FSDP shards over the "dp" sub-mesh
        apply_tp(model, plan, meshes.tp)
    experts = apply_ep(model, plan.cluster.mesh, meshes.dp, plan.model.name)  # None without expert parallelism
    stacks = expert_stacks_of(model)
    fsdp_meshes: dict[MeshShape, DeviceMesh] = {}  # each made once, only when a unit's kind asks for it

    master = torch_dtype(precision.master_dtype)
    if master != torch.float32:  # models are built in fp32
        model.to(master)
    mp_policy = mixed_precision_policy(precision)
    pin_memory = meshes.dp.device_type != "cpu"  # pinned host memory needs an accelerator
    for decision, kind, module in units:
        apply_ac(module, _plan_row(CHECKPOINT_MODES, decision.checkpoint))
        if experts is not None and decision.module in experts.stacks:  # over the dp / ep ranks (run/experts.py)
            fully_shard_experts(module, experts, kind, mp_policy, decision.offload)
            continue
        if kind.mesh not in fsdp_meshes:
            fsdp_meshes[kind.mesh] = meshes.record.fsdp_mesh(meshes.dp, kind.mesh)
        placement = expert_placement(fsdp_meshes[kind.mesh]) if decision.module in stacks else None
        apply_fsdp(module, fsdp_meshes[kind.mesh], kind, mp_policy, offload=decision.offload, pin_memory=pin_memory,
                   shard_placement_fn=placement)
    built = (build_optimizer(param_groups(model), optimizer_kind, DEFAULT_LR if lr is None else lr)
             if optimizer is None else _from_factory(optimizer, param_groups(model), optimizer_kind))
    return Applied(model, built, None if scheduler is None else scheduler(built))


def _from_factory(factory: OptimizerFactory, params, planned: OptimizerKind) -> torch.optim.Optimizer:
    """The caller's optimizer; a warning where it keeps other state than the plan's optimizer was costed with."""
    built = factory(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise UsageError(f"the `optimizer` factory returned {type(built).__name__}, not a torch.optim.Optimizer; "
                         "give a torch.optim class or a function of the parameters that returns an optimizer")
    if type(built).__name__ != planned.torch_class:
        warnings.warn(f"the plan's memory and time were costed for {planned.name} ({planned.torch_class}); the "
                      f"optimizer is {type(built).__name__}, whose state may differ (search again with "
                      "`--optimizer` for a plan that counts it)", stacklevel=3)
    return built


def torch_dtype(dtype: Dtype | str) -> torch.dtype:
    """The torch dtype of a registry dtype name ("bf16" -> torch.bfloat16)."""
    return getattr(torch, Dtype(dtype).torch_name)


def mixed_precision_policy(precision: Precision | str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a precision row: gathered parameters in the compute dtype where it is not the
    master dtype, gradients reduced in the reduce dtype where it is not the compute dtype (bf16-mixed:
    fp32 master weights, bf16 gathered parameters and compute, fp32 reduction; fp32 and bf16: none)."""
    if isinstance(precision, str):
        precision = _plan_row(PRECISIONS, precision)
    compute, reduce = precision.compute_dtype, precision.reduce_dtype
    return MixedPrecisionPolicy(
        param_dtype=None if compute == precision.master_dtype else torch_dtype(compute),
        reduce_dtype=None if reduce == compute else torch_dtype(reduce),
    )


def build_optimizer(params, optimizer: OptimizerKind | str, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """The optimizer's row built: its torch.optim class with the row's arguments (torch's defaults
    otherwise). Plain SGD keeps no state, as the cost model assumes."""
    if isinstance(optimizer, str):
        optimizer = _plan_row(OPTIMIZERS, optimizer)
    cls = getattr(torch.optim, optimizer.torch_class, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UsageError(f"optimizer {optimizer.name!r}: torch.optim has no optimizer class {optimizer.torch_class!r} "
                         f"(torch {torch.__version__})")
    return cls(params, lr=lr, **optimizer.kwargs)


def _plan_row(registry, name: str):
    """The registered row a plan names; a name this autoplan does not know is a PlanFileError."""
    try:
        return find(registry, name)
    except UnknownOptionError as exc:
        raise PlanFileError(str(exc)) from None


def _sharding_kind(decision: UnitDecision) -> ShardingKind:
    """The unit's registered sharding kind; the plan's reshard_after_forward must be the kind's."""
    name = decision.module or "<root>"
    if decision.sharding not in SHARDING_KINDS:
        raise PlanFileError(unknown_message("sharding", decision.sharding, SHARDING_KINDS, f"in unit {name}"))
    kind = SHARDING_KINDS[decision.sharding]
    if decision.reshard_after_forward != kind.reshard_after_forward:
        raise PlanFileError(f"unit {name}: sharding {kind.name} contradicts "
                            f"reshard_after_forward={str(decision.reshard_after_forward).lower()}")
    return kind


# --------------------------------------------------------------------------- #
# Checks: before anything is touched
# --------------------------------------------------------------------------- #


def check_plan(model: nn.Module, plan: Plan) -> tuple[list[tuple[UnitDecision, ShardingKind, nn.Module]],
                                                     Precision, OptimizerKind]:
    """Everything `apply` checks of a plan against a model, without a process group: the model's
    fingerprint, every unit's module and sharding kind, the precision and the optimizer (its torch class
    included). `autoplan apply` runs it on the meta device before it launches a rank. Returns the units
    (decision, kind, module; leaves first), the precision row and the optimizer row."""
    check_model_matches(model, plan)
    # Every unit's module is looked up (and every decision checked) before anything is wrapped.
    units = [(decision, _sharding_kind(decision), _unit_module(model, decision))
             for decision in _leaves_first(plan.units)]
    check_experts(model, plan.cluster.ep_degree, plan.model.name,
                  {decision.module: (kind, decision.offload) for decision, kind, _ in units})
    optimizer_kind = _plan_row(OPTIMIZERS, plan.training.optimizer)
    cls = getattr(torch.optim, optimizer_kind.torch_class, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UsageError(f"optimizer {optimizer_kind.name!r}: torch.optim has no optimizer class "
                         f"{optimizer_kind.torch_class!r} (torch {torch.__version__})")
    return units, _plan_row(PRECISIONS, plan.training.dtype), optimizer_kind


def check_model_matches(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan made for another model; the message names the first difference found."""
    fingerprint = model_fingerprint(model)
    if fingerprint == plan.model.fingerprint:
        return
    raise PlanFileError(
        f"the plan was made for another model than the one given ({plan.model.name}): "
        f"{first_difference(model, plan)} (model fingerprint {fingerprint}, plan {plan.model.fingerprint}); "
        "make a plan for this model"
    )


def first_difference(model: nn.Module, plan: Plan) -> str:
    """The first parameter or unit module where `model` and the plan disagree, in model order."""
    plan_shapes = {name: list(shape) for unit in plan.units for name, shape in unit.param_shapes.items()}
    model_shapes = {name: list(param.shape) for name, param in model.named_parameters()}
    for name, shape in model_shapes.items():
        if name not in plan_shapes:
            return f"parameter {name} {shape} is not in the plan"
        if plan_shapes[name] != shape:
            return f"parameter {name} has shape {shape}, the plan has {plan_shapes[name]}"
    for name, shape in plan_shapes.items():
        if name not in model_shapes:
            return f"the plan's parameter {name} {shape} is not in the model"
    modules = dict(model.named_modules())
    for unit in plan.units:
        if unit.module not in modules:
            return f"the plan's unit module {unit.module!r} is not in the model"
    return "parameter names and shapes agree, so module names or types differ"


def check_world_size(world_size: int, plan: Plan, dry_run: bool = False) -> None:
    planned = plan.cluster.world_size
    if world_size == planned or (dry_run and world_size < planned):
        return
    if world_size > planned:
        raise PlanFileError(
            f"the plan is for a world of {planned} ranks, but {world_size} are running it; "
            f"make the plan again for {world_size} GPUs"
        )
    raise PlanFileError(
        f"the plan is for a world of {planned} ranks, but {world_size} are running it; "
        f"launch {planned} ranks, or apply it as a dry run on fewer (`nproc` {world_size})"
    )


def _unit_module(model: nn.Module, decision: UnitDecision) -> nn.Module:
    name = decision.module or "<root>"
    try:
        return model.get_submodule(decision.module)
    except AttributeError:
        raise PlanFileError(f"the plan's unit module {name} is not in the model") from None


def _leaves_first(units: list[UnitDecision]) -> list[UnitDecision]:
    """Deepest module paths first, the root ("") last: FSDP2 wraps children before parents."""
    return sorted(units, key=lambda unit: -1 if unit.module == "" else unit.module.count("."), reverse=True)


# --------------------------------------------------------------------------- #
# The model a plan describes
# --------------------------------------------------------------------------- #


def model_for_plan(plan: Plan, factory: str | None = None, plan_file: str | os.PathLike | None = None) -> nn.Module:
    """Build the plan's model on the meta device: see `resolve_plan_model`."""
    return resolve_plan_model(plan, factory, plan_file).module


def resolve_plan_model(plan: Plan, factory: str | None = None,
                       plan_file: str | os.PathLike | None = None) -> ResolvedModel:
    """The plan's model on the meta device, with the name of what is built (`.name`): the zoo config the
    plan holds, its Hugging Face config (a relative path, read from `plan_file`'s folder), or the model the
    user names (`factory`: a factory, a zoo name or "hf:PATH", i.e. `autoplan apply --model ...`).

    A plan file alone never makes autoplan import code: a plan made from a factory runs only with the
    factory named again by the user. The name comes from what is built, not from the plan's `model.name`:
    a plan whose name was edited to another zoo name is named by its config (see `model_label_note`).
    """
    if factory is not None:
        return resolve_model(factory)
    return model_from_plan(plan.model.name, plan.model.config, None if plan_file is None else Path(plan_file))


def model_label_note(plan: Plan, model: ResolvedModel) -> str | None:
    """Said when what runs is named otherwise than the plan names its model; None when they agree."""
    if model.name == plan.model.name:
        return None
    if plan.model.config is not None and not model.name.startswith(HF_PREFIX) and ":" not in model.name:
        return (f"the plan names its model {plan.model.name!r}, but its config, which is what runs, is "
                f"{model.name}'s; the run is labelled {model.name}")
    return (f"the plan was made for {plan.model.name!r}; running {model.name}, the model given, "
            "whose parameters match the plan's")
