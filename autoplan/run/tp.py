"""Run a plan's tensor-parallel layout: DTensor's `parallelize_module` on the TP sub-mesh, before FSDP.

As torchtitan does: the world becomes a (world / t) x t mesh named ("dp", "tp") (rank r is tensor-parallel
rank r % t of data-parallel rank r // t, so a TP group is t neighbouring ranks, inside a node); each block
gets the Megatron layout on the "tp" sub-mesh (ColwiseParallel q/k/v and gate/up, RowwiseParallel o/down;
with sequence parallelism SequenceParallel norms and PrepareModuleInput gathering the sequence before
attention and the MLP); the embedding is split by vocabulary rows (RowwiseParallel) and the head by
vocabulary columns of its output (ColwiseParallel, logits left as a DTensor for torch's loss_parallel);
then `fully_shard` runs on the "dp" sub-mesh (autoplan.run.apply), which shards the tensor-parallel
DTensors over the data-parallel ranks.

The layout is found from the model by the same function the search costed (autoplan.models.tp_layout), and
checked against the units' layouts the plan records. The attention modules' head counts are set to the
heads one rank holds (torchtitan does the same): the zoo's attention splits its projections by these
attributes, so the model's code stays free of parallelism.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from autoplan.errors import CheckpointError, PlanFileError
from autoplan.models.structure import largest_module_list
from autoplan.models.tp_layout import (
    ATTENTION,
    MLP,
    TpRefusal,
    block_shape,
    check_with_experts,
    local_heads,
    recognise,
)
from autoplan.plan.schema import Plan
from autoplan.run.tp_styles import ExpertsParallel, OwnedRowwiseParallel, order_sections
from cost_models.options import SHARDING_KINDS, MeshShape
from cost_models.records import ParamInfo, Unit
from cost_models.tensor_parallel import TpLayout, TpRole, unit_layouts

__all__ = ["apply_tp", "check_resume_degree", "local_loss", "parallelize_tp", "training_context"]


def training_context(plan: Plan):
    """What the training loop runs in: torch's loss_parallel where the head is vocabulary-parallel (its
    cross-entropy, forward and backward, on logits split by vocabulary), else nothing."""
    if plan.cluster.tp_degree > 1 and any(unit.tp == "vocab" for unit in plan.units):
        return loss_parallel()
    return contextlib.nullcontext()


def local_loss(loss):
    """A loss from vocabulary-parallel logits is a replicated DTensor: its local value (differentiable)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _check(plan: Plan, model: nn.Module, layout: TpLayout) -> None:
    """The plan's unit layouts must be what the layout makes of its units; the data-parallel kinds must be
    ones that run beside tensor parallelism."""
    units = [Unit(path=u.module, params=[ParamInfo(n, tuple(s)) for n, s in u.param_shapes.items()])
             for u in plan.units]
    expected = unit_layouts(units, layout)
    for decision, tag in zip(plan.units, expected):
        name = decision.module or "<root>"
        if decision.tp != (tag.value if tag is not None else None):
            raise PlanFileError(f"unit {name}: the plan records tensor-parallel layout {decision.tp}, but at degree "
                                f"{layout.degree} the model's layout makes it {tag.value if tag else None}; "
                                "make the plan again")
        kind = SHARDING_KINDS.get(decision.sharding)
        if kind is None or kind.mesh != MeshShape.WORLD or decision.offload:
            raise PlanFileError(f"unit {name}: {decision.label} does not run beside tensor parallelism (the "
                                "data-parallel dimension shards: shard, shard_keep; no offload)")


def _block_plan(path: str, layout: TpLayout, norms: list[str], owned: bool) -> dict:
    """The block's column- and row-wise projections, as the layout names them (the zoo's, Hugging Face's), and
    its experts split by width; `owned`: row-wise outputs that the block adds into in place (Falcon's)."""
    plan, sp = {}, layout.sequence_parallel
    rowwise = OwnedRowwiseParallel if owned else RowwiseParallel
    for module, role in layout.roles.items():
        if module.startswith(path + ".") and role in (TpRole.COLWISE, TpRole.ROWWISE):
            plan[module[len(path) + 1:]] = ColwiseParallel() if role is TpRole.COLWISE else (
                rowwise(output_layouts=Shard(1)) if sp else rowwise())
        elif module.startswith(path + ".") and role is TpRole.EXPERTS:
            plan[module[len(path) + 1:]] = ExpertsParallel({name.rpartition(".")[2]: dim for name, dim
                                                            in layout.split_params.items()
                                                            if name.rpartition(".")[0] == module})
    if sp:  # the zoo's block only (autoplan.models.tp_layout)
        for norm in norms:
            plan[norm] = SequenceParallel()
        # the attention's forward takes (x, cos, sin): only x is gathered along the sequence
        plan[ATTENTION[0]] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None))
        plan[MLP[0]] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def check_resume_degree(model: nn.Module, saved: int, degree: int, where: str) -> None:
    """A checkpoint holds fused projections (Phi-3's q/k/v, experts' gate_up) with their rows in the order of the
    tensor-parallel degree it was saved at (autoplan.run.tp_styles.order_sections), which DCP cannot reorder:
    CheckpointError where this run's degree differs and the model has such projections."""
    if saved == degree:
        return
    try:
        fused = recognise(model, max(saved, degree), False).fused
    except TpRefusal:
        return
    if fused:
        raise CheckpointError(f"{where} was saved at tensor-parallel degree {saved}, and its fused projections "
                              f"({next(iter(fused))} and {len(fused) - 1} more) hold their rows in that degree's "
                              f"order; resume it under a plan of tensor-parallel degree {saved} (this one's is "
                              f"{degree})")


def apply_tp(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> None:
    """Apply the plan's tensor-parallel layout to `model` on `tp_mesh` (this rank's tensor-parallel group, the
    "tp" dimension of the plan's mesh: cost_models.mesh.Mesh.split)."""
    mesh = plan.cluster.mesh
    try:
        layout = recognise(model, mesh.tp, mesh.sequence_parallel)
        check_with_experts(layout, mesh.ep)
    except TpRefusal as exc:
        raise PlanFileError(f"the plan's tensor-parallel layout does not fit the model: {exc}") from None
    _check(plan, model, layout)
    parallelize_tp(model, layout, tp_mesh)


def parallelize_tp(model: nn.Module, layout: TpLayout, tp_mesh: DeviceMesh) -> None:
    """DTensor's `parallelize_module` with the layout's styles on `tp_mesh` (1-D, one tensor-parallel group):
    the Megatron plan on each block (fused projections' rows reordered first, autoplan.run.tp_styles; its
    attention's head counts set to the heads one rank holds), then the vocabulary-parallel embedding and head
    and, with sequence parallelism, the final norm. What `apply_tp` runs, and what the profiler times
    (autoplan.profiling.tp_dispatch)."""
    t, sp = layout.degree, layout.sequence_parallel
    order_sections(model, dict(layout.fused), dict(layout.split_params), t)
    blocks_path = largest_module_list(model)
    for index, block in enumerate(model.get_submodule(blocks_path)):
        path = f"{blocks_path}.{index}"
        norms = [name for name, _ in block.named_children() if layout.roles.get(f"{path}.{name}") is TpRole.SEQUENCE]
        parallelize_module(block, tp_mesh, _block_plan(path, layout, norms, block_shape(block) == "falcon"))
    local_heads(model, layout)
    top = {}
    if layout.embedding is not None:
        top[layout.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if sp:
        # the final norm: the one sequence-parallel module outside the blocks (whose paths hold a dot)
        top.update({path: SequenceParallel() for path, role in layout.roles.items()
                    if role is TpRole.SEQUENCE and "." not in path})
    if layout.head is not None:
        top[layout.head] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                           use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
