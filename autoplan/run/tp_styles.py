"""The two pieces of a tensor-parallel layout that DTensor's stock styles do not cover: fused projections split
section by section, and experts split by width (autoplan.models.tp_experts).

A fused projection (Phi-3's q/k/v and gate/up, transformers' stacked experts' gate_up) concatenates sections
along the dimension tensor parallelism splits. ColwiseParallel's Shard(0) gives rank r the r-th block of
rows, which for Phi-3's q/k/v at degree 2 is all of q and half of k: wrong heads. `order_sections` reorders the
rows before the weight is distributed (rank r's block holds its share of each section, in the sections' order)
so that each rank's local projection writes [its q heads, its k heads, its v heads], which the model's own
code splits at the local widths (autoplan.models.tp_layout.local_heads). The parameter's global value is the
reordered weight: `restore_sections` undoes the order (what a loss-parity test compares with).

`ExpertsParallel` is torchtitan's TensorParallel for grouped experts without expert parallelism: the stacked
weights become DTensors sharded by width (gate/up Shard(1), down Shard(2)), so FSDP shards them over the
data-parallel ranks as any tensor-parallel parameter, while the experts' own forward (the zoo's or
transformers' grouped_mm code, free of parallelism) runs on the local shards: the module's parameters are
swapped for their local tensors for the call. Each rank's output is a partial sum over its slice of every
expert's width; the combined output is all-reduced (forward), and the gradients of the inputs (the tokens and
the routing weights, whose gradients each rank computes from its slice only) are all-reduced in the backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

__all__ = ["ExpertsParallel", "OwnedRowwiseParallel", "order_sections", "restore_sections", "section_order"]


def section_order(sections: tuple[int, ...], t: int) -> torch.Tensor:
    """Indices along the split dimension that put rank r's share of every section in the r-th block."""
    starts = [sum(sections[:i]) for i in range(len(sections))]
    return torch.tensor([start + r * (size // t) + i for r in range(t) for start, size in zip(starts, sections)
                         for i in range(size // t)])


@torch.no_grad()
def order_sections(model: nn.Module, fused: dict[str, tuple[int, ...]], split: dict[str, int], t: int) -> None:
    """Reorder each fused parameter's rows (before it is distributed) so that Shard(dim) splits each section."""
    for name, sections in fused.items():
        param = model.get_parameter(name)
        param.data = param.data.index_select(split[name], section_order(sections, t).to(param.device))


@torch.no_grad()
def restore_sections(tensor: torch.Tensor, sections: tuple[int, ...], dim: int, t: int) -> torch.Tensor:
    """The model's own order of a fused parameter's (full) value."""
    return tensor.index_select(dim, torch.argsort(section_order(sections, t)).to(tensor.device))


def _summed_grad(value, mesh: DeviceMesh):
    """The tensor as it is (replicated across the group), its gradient all-reduced over the group in backward."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class ExpertsParallel(ParallelStyle):
    """Experts split by width: `dims` maps each stacked parameter to the dimension split over the group."""

    def __init__(self, dims: dict[str, int]):
        super().__init__()
        self.dims = dims
        self._whole: dict[str, nn.Parameter] = {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.dims.items():
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(dim)]),
                                                         requires_grad=param.requires_grad))

        def enter(mod: nn.Module, args: tuple) -> tuple:
            for name in self.dims:  # the parameters FSDP put in place for this call (DTensors on the group)
                self._whole[name] = mod._parameters[name]
                mod._parameters[name] = self._whole[name].to_local()
            return tuple(_summed_grad(arg, device_mesh) for arg in args)

        def leave(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            for name in self.dims:
                mod._parameters[name] = self._whole.pop(name)
            return DTensor.from_local(output, device_mesh, [Partial()], run_check=False).full_tensor()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class OwnedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose local output is a tensor of its own, not to_local's view: Falcon adds the attention's
    output into its MLP's in place, which autograd refuses on a custom Function's view."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        local = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return local.clone() if use_local_output else local
