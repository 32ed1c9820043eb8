"""How tensor parallelism splits a mixture of experts' MLP (without expert parallelism), found from the modules.

As torchtitan does for tensor parallelism on grouped experts when no expert-parallel dimension is set
(torchtitan.distributed.expert_parallel.TensorParallel): every rank holds every expert, each split by its
hidden width, the gate and up projections by rows (the stacked weight's dimension 1) and the down projection
by columns (dimension 2); the router stays replicated (every rank routes every token alike), the dispatch
and the combine run whole on every rank, and the combined output is a partial sum that one all-reduce
completes (autoplan.run.tp's ExpertsParallel), as a dense MLP's row-wise projection. Shared experts (a dense
MLP every token passes) are split as the dense MLP is. Expert parallelism (experts placed on ranks, an
all-to-all) is another dimension's (Mesh.ep), not this one's.

A fused gate_up projection (transformers' `gate_up_proj`, gate rows then up rows) is split section by
section, so each rank holds its share of the gate and of the up rows (TpLayout.fused): split as one block
of rows, rank 0 would hold all of the gate and rank 1 all of the up.
"""

from __future__ import annotations

import torch.nn as nn

from autoplan.models.structure import expert_stacks
from cost_models.tensor_parallel import TpRole

__all__ = ["COLUMN_STACKS", "ROW_STACKS", "LayoutParts", "TpRefusal", "moe_layout"]

COLUMN_STACKS = ("w1", "w3", "gate_proj", "up_proj", "gate_up_proj")  # [experts, width, model]: split by rows
ROW_STACKS = ("w2", "down_proj")  # [experts, model, width]: split by columns
_FUSED_STACKS = ("gate_up_proj",)
# dense MLPs beside the experts (shared experts): column-wise projections, row-wise projection
_DENSE = ((("w1", "w3"), "w2"), (("gate_proj", "up_proj"), "down_proj"))


class TpRefusal(ValueError):
    """The model (or this degree) cannot take the tensor-parallel layout; the message says why (raised here and
    by autoplan.models.tp_layout, which exports it)."""


class LayoutParts:
    """What the layout makes of a block (or of its mixture of experts): roles, split parameters, regions, the
    experts' widths and the fused sections, as TpLayout takes them."""

    def __init__(self) -> None:
        self.roles: dict[str, TpRole] = {}
        self.split: dict[str, int] = {}
        self.regions: list[str] = []
        self.widths: dict[str, tuple[int, ...]] = {}
        self.fused: dict[str, tuple[int, ...]] = {}


def _stack(module: nn.Module, where: str, t: int, out: LayoutParts) -> None:
    """The stacked experts' parameters, each split by its hidden width."""
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        raise TpRefusal(f"{where}: its experts are stored transposed or with biases, which the tensor-parallel "
                       "layout does not split yet")
    widths = []
    for name, param in module.named_parameters(recurse=False):
        full = f"{where}.{name}"
        if param.dim() != 3:
            raise TpRefusal(f"{full} ({list(param.shape)}) is not a stacked expert weight the layout places")
        if name in COLUMN_STACKS:
            sections = (param.shape[1] // 2,) * 2 if name in _FUSED_STACKS else (param.shape[1],)
            if any(s % t for s in sections) or sum(sections) != param.shape[1]:
                raise TpRefusal(f"{full}: the experts' width {sections[0]} does not divide by the tensor-parallel "
                               f"degree {t}")
            out.split[full] = 1
            widths += [param.shape[1], *sections[:1]] if len(sections) > 1 else [param.shape[1]]
            if len(sections) > 1:
                out.fused[full] = sections
        elif name in ROW_STACKS:
            if param.shape[2] % t:
                raise TpRefusal(f"{full}: the experts' width {param.shape[2]} does not divide by the "
                               f"tensor-parallel degree {t}")
            out.split[full] = 2
        else:
            raise TpRefusal(f"{full}: a stacked expert weight the layout does not place (it knows "
                           f"{', '.join(COLUMN_STACKS + ROW_STACKS)})")
    out.roles[where] = TpRole.EXPERTS
    out.regions.append(where)
    out.widths[where] = tuple(dict.fromkeys(widths))


def _dense(module: nn.Module, where: str, t: int, out: LayoutParts) -> bool:
    """A dense MLP beside the experts (a shared expert): split as the dense MLP is; False when it is not one."""
    for columns, row in _DENSE:
        names = (*columns, row)
        if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
            continue
        if any(any(True for _ in m.parameters()) for n, m in module.named_children() if n not in names):
            return False
        for name in columns:
            linear = getattr(module, name)
            if linear.out_features % t:
                raise TpRefusal(f"{where}.{name} has {linear.out_features} output features, which do not divide by "
                               f"the tensor-parallel degree {t}")
            out.roles[f"{where}.{name}"] = TpRole.COLWISE
            out.split[f"{where}.{name}.weight"] = 0
            if linear.bias is not None:
                out.split[f"{where}.{name}.bias"] = 0
        out.roles[f"{where}.{row}"] = TpRole.ROWWISE
        out.split[f"{where}.{row}.weight"] = 1
        out.roles[where] = TpRole.SHARDED
        out.regions.append(where)
        return True
    return False


def moe_layout(mlp: nn.Module, where: str, t: int) -> LayoutParts:
    """The roles of a block's mixture of experts `mlp` (at path `where`): its stacked experts split by width,
    its shared experts as a dense MLP, everything else (the router, a shared expert's gate) replicated."""
    out = LayoutParts()
    stacks = expert_stacks(mlp)
    if len(stacks) != 1 or any(True for _ in mlp.parameters(recurse=False)):
        raise TpRefusal(f"{where}: a mixture of experts the layout places has one module of stacked experts "
                       f"(found {len(stacks)})")
    stack = mlp.get_submodule(stacks[0])
    _stack(stack, f"{where}.{stacks[0]}", t, out)
    for name, child in mlp.named_children():
        if child is stack or not any(True for _ in child.parameters()):
            continue
        if any(p.dim() >= 3 for p in child.parameters()):
            raise TpRefusal(f"{where}.{name}: stacked weights outside the experts module")
        _dense(child, f"{where}.{name}", t, out)  # a shared expert; anything else (the router) is replicated
    return out
