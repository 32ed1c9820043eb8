"""Context parallelism at run time: each sequence split over the plan's context-parallel ranks, ring attention.

A plan of context-parallel degree c runs as torchtitan runs it: FSDP shards the parameters over the
data x context-parallel ranks (one flattened mesh, `Mesh.split_context`), and every micro-batch's forward
and backward run inside torch's `context_parallel` (torch.distributed.tensor.experimental) on the "cp"
mesh, which cuts the token ids, the labels and the positions into 2c chunks, keeps chunks r and
2c - 1 - r on rank r (load-balanced causal attention), and turns each `F.scaled_dot_product_attention`
call into ring attention over the group. The rank's loss is the mean over its tokens; FSDP's gradient
averaging over the data x context ranks makes that the batch's mean.

Two pieces torch does not provide, and why they are here:
- **Positions.** torch shards the buffers it is given; a model that computes its rotary tables from
  `arange(seq_len)` inside its forward would compute them for positions 0..S/c. For the zoo's rotary
  transformers (autoplan.models.llama.RopeTransformer) a forward pre-hook on each block replaces the
  tables it is handed by those of the rank's positions (torch shards the positions as a third buffer).
- **The CPU kernel.** torch 2.13's ring dispatch (`_sdpa_handler`) handles the CUDA flash, efficient and
  cuDNN SDPA ops only; on the CPU, SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`, which
  DTensor then refuses ("does not have a sharding strategy registered"). `_register_cpu_ring` adds that op
  and its backward to the handlers context_parallel installs, running torch's own ring templates
  (`_templated_ring_attention` and its backward, the ones its CUDA handlers run) with the CPU kernel: the
  same rotation, load balancing and merging, so a gloo run checks the algorithm a GPU run uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.errors import PlanFileError
from autoplan.models.llama import RopeTransformer, rope_tables_at
from autoplan.plan.schema import Plan
from cost_models.options import SHARDING_KINDS, MeshShape

__all__ = ["ContextParallel"]

_SEQ_DIM = 2  # SDPA's [batch, heads, seq, head_dim]


class ContextParallel:
    """One rank's context parallelism over `mesh` (the plan's "cp" dimension) for `model`: `shard` is entered
    around each micro-batch's forward and backward."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: Plan):
        for decision in plan.units:
            kind = SHARDING_KINDS.get(decision.sharding)
            if kind is None or kind.mesh != MeshShape.WORLD:
                raise PlanFileError(f"unit {decision.module or '<root>'}: {decision.label} does not run beside context "
                                    "parallelism (FSDP shards over the data x context ranks: shard, shard_keep)")
        if not isinstance(model, RopeTransformer):
            raise PlanFileError(f"the plan is context-parallel, and {type(model).__name__} computes its positions in "
                                "its forward; apply shards the positions of the zoo's rotary transformers (Llama, "
                                "MoE) only: make the plan with `--cp 1`")
        _register_cpu_ring()
        self.mesh, self.model = mesh, model
        self.positions: torch.Tensor | None = None
        self._tables: dict = {}
        blocks = model.get_submodule(model.block_list_path)
        for block in blocks:
            block.register_forward_pre_hook(self._rank_tables)

    @contextlib.contextmanager
    def shard(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's chunks of the micro-batch's ids and labels ([batch, seq] each), with ring attention on."""
        from torch.distributed.tensor.experimental import context_parallel

        ids, targets = input_ids.contiguous().clone(), labels.contiguous().clone()
        positions = torch.arange(ids.size(1), device=ids.device)
        buffers = [ids, targets, positions]
        with context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)):
            self.positions, self._tables = positions, {}
            try:
                yield ids, targets
            finally:
                self.positions, self._tables = None, {}

    def _rank_tables(self, _block: nn.Module, args: tuple):
        """A block's (x, cos, sin) with the tables of this rank's positions (inside `shard` only)."""
        if self.positions is None or len(args) != 3:
            return None
        x, cos, _ = args
        key = (cos.dtype, cos.device)
        if key not in self._tables:
            self._tables[key] = rope_tables_at(self.model.inv_freq.to(cos.device), self.positions, cos.dtype)
        return (x, *self._tables[key])


def _register_cpu_ring() -> None:
    """The CPU SDPA op and its backward among the handlers `context_parallel` installs (see the module
    docstring); idempotent."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if forward in ring.custom_ops:
        return

    def handler(op_call, args, kwargs):
        from torch.distributed.tensor import DTensor, Shard

        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        mesh = info.compute_mesh
        a = _bound(op_call, info.local_args, info.local_kwargs)
        if a.get("attn_mask") is not None:
            raise NotImplementedError("context parallelism runs causal attention without a mask")
        options = dict(dropout_p=a["dropout_p"], scale=a["scale"])
        if op_call is forward:
            results = ring._templated_ring_attention(mesh.get_group(), _SEQ_DIM, forward, a["query"], a["key"],
                                                     a["value"], is_causal=a["is_causal"], **options)
        else:
            results = ring._templated_ring_attention_backward(
                mesh.get_group(), _SEQ_DIM, backward, a["grad_out"], "grad_out", a["query"], a["key"], a["value"],
                a["out"], a["logsumexp"], a["is_causal"], **options)
        return tuple(DTensor.from_local(t, mesh, [Shard(_SEQ_DIM)], run_check=False) for t in results)

    ring.custom_ops[forward] = handler
    ring.custom_ops[backward] = handler


def _bound(op, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by their schema's names, defaults filled in."""
    arguments = op._schema.arguments
    values = {a.name: a.default_value for a in arguments if a.has_default_value()}
    values.update(zip((a.name for a in arguments), args))
    values.update(kwargs)
    return values
