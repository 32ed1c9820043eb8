"""Activation checkpointing of one unit, as its checkpoint mode's row says (cost_models.options.CHECKPOINT_MODES).

Why one place: the cost model prices a checkpoint mode by what it recomputes (`CheckpointMode.recompute`);
this module turns that same property into torch calls, so that what runs is what was priced, and a new
row with a known `recompute` runs without a change here. No mode is named.

- Recompute.NOTHING: the unit is left alone; its ops save what autograd saves.
- Recompute.ALL: the unit's forward runs under torch.utils.checkpoint (non-reentrant): it keeps the
  unit's inputs only and is re-run in its backward.
- Recompute.ALTERNATE (torchtitan's selective op policy): as CHEAP, but of the matmuls (the registry's aten
  matmul names) only every other one's output is kept, the 1st, 3rd, ... of the region's forward, counted
  apart in the forward and in the recompute (which replays the same ops in the same order): the trace side
  counts the unit's matmul ops alike (activations.kept_outputs).
- Recompute.CHEAP (selective checkpointing): the same, with torch's op-level policy
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`): the outputs of the ops that do the
  heavy work are kept from the forward (MUST_SAVE) and every other op is re-run (PREFER_RECOMPUTE). The
  kept ops are the registry's aten names (options.SAVED_BY_SELECTIVE_ATEN: matmuls and the attention
  kernels, the trace-side twin of which is activations.saved_by_selective) and the c10d functional
  collectives (re-running one would repeat its communication; torchtitan keeps them for the same reason).

How: the module's own `forward` is replaced (on the instance) by one that runs it under the checkpoint,
so module paths, parameter names and the model's fingerprint stay unchanged, and FSDP2's hooks (on the
module's __call__) stay outside the checkpointed region: the all-gather and the input cast run before
it in the forward, the pre-backward hook gathers the parameters before the recompute, and the recompute
runs the module's ops only. Not torch's composable `checkpoint(module, context_fn=...)`, although torch
2.13's accepts the selective policy: its recompute calls the module with its hooks, so FSDP2's
pre-forward (the mixed-precision cast of the inputs) runs inside the recompute but ran outside the
forward's region, and the selective policy, which replays the forward's ops one for one, fails ("...
encountered during backward but not found in storage") on every plan with a bf16-mixed policy.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from cost_models.options import SAVED_BY_SELECTIVE_ATEN, CheckpointMode, Recompute

__all__ = ["SAVED_COLLECTIVES", "alternate_context_fn", "apply_ac", "saved_by_selective_ops", "selective_context_fn",
           "selective_policy"]

# The c10d functional collectives (torch.ops._c10d_functional) whose outputs a selective checkpoint keeps.
SAVED_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single",
)


def apply_ac(module: nn.Module, mode: CheckpointMode) -> None:
    """Checkpoint `module`'s activations as `mode.recompute` says (nothing to do for Recompute.NOTHING).
    Before or after `fully_shard` on the same module: its hooks stay outside the region either way."""
    if mode.recompute is Recompute.NOTHING:
        return
    contexts = {Recompute.ALL: noop_context_fn, Recompute.CHEAP: selective_context_fn,
                Recompute.ALTERNATE: alternate_context_fn}
    if mode.recompute not in contexts:  # a Recompute value with no way to run it here
        raise NotImplementedError(f"checkpoint mode {mode.name!r}: apply has no way to run recompute="
                                  f"{mode.recompute.value!r}; known: {', '.join(r.value for r in Recompute)}")
    context_fn = contexts[mode.recompute]
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = checkpointed_forward


@functools.lru_cache(maxsize=1)
def saved_by_selective_ops() -> frozenset:
    """The op packets a selective checkpoint keeps: the registry's aten names that this torch has, and the
    c10d functional collectives (those registered: importing torch.distributed registers them)."""
    packets = [getattr(torch.ops.aten, name) for name in SAVED_BY_SELECTIVE_ATEN if hasattr(torch.ops.aten, name)]
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed._functional_collectives")  # registers torch.ops._c10d_functional
        functional = torch.ops._c10d_functional
        packets += [getattr(functional, name) for name in SAVED_COLLECTIVES if hasattr(functional, name)]
    return frozenset(packets)


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of matmuls, attention and collectives; re-run everything else in the backward."""
    packet = getattr(func, "overloadpacket", func)
    return CheckpointPolicy.MUST_SAVE if packet in saved_by_selective_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """The (forward, recompute) context pair of one selectively checkpointed forward (checkpoint's context_fn)."""
    return create_selective_checkpoint_contexts(selective_policy)


@functools.lru_cache(maxsize=1)
def _matmul_ops() -> frozenset:
    """The matmul packets among the registry's aten names a selective checkpoint keeps (not the attention ones)."""
    names = [name for name in SAVED_BY_SELECTIVE_ATEN if "attention" not in name]
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


def alternate_context_fn():
    """The context pair of one forward under torchtitan's selective op policy: attention and collective outputs
    kept, and every other matmul's (the 1st, 3rd, ...), counted afresh for each checkpointed call and apart in
    its forward and its recompute."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(func, "overloadpacket", func)
        if packet in _matmul_ops():
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return selective_policy(ctx, func, *args, **kwargs)

    return create_selective_checkpoint_contexts(policy)
