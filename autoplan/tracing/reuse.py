"""Tracing a stack of identical blocks by a few of them: the trace of the whole model, from a short one.

A trace runs every op of the model on the meta device, forward and backward, at micro-batch 1 and 2:
20 to 250 ms per block here, so minutes for a model of a few hundred layers. The blocks of a model
(GPT-2's `transformer.h`, Llama's `layers`) are mostly alike, and alike blocks run alike ops: the same
kinds, shapes, FLOPs, bytes and lifetimes, under other names, module paths and storages. So:

1. The blocks are the largest ModuleList's (the ones `units` makes FSDP units of). Each block's
   signature is its module tree: module types, parameter and buffer shapes, dtypes and flags, hooks,
   and every module's plain attributes (those that decide which ops run: `sliding_window`,
   `attention_type`) except one that only counts the block (`layer_idx` = its index). When the
   signatures repeat with a period p that divides the number of blocks, and there are enough
   periods for this to pay, the model is traced truncated to 3 periods and to 4 (the ModuleList is
   shortened in place, and restored).
2. The first period, the last, and what runs before and after the blocks are the short trace's own;
   its middle period is repeated for every middle period of the model, with op names, module paths
   and storages renamed as a trace of the whole model names them (`expand`).
3. Being conservative: the 4-period trace is predicted from the 3-period one the same way and must
   match it exactly (every field of every op, the graph, which storages each op reads, produces and
   saves), at both micro-batches; only then is the 3-period trace expanded to the whole model.
   Otherwise, or when anything else does not fit, the whole model is traced.

What the check cannot see: a forward that branches on the block's index itself, not on an attribute,
and only past the fourth block (`if self.layer_idx >= 10:`); such a model would be traced as if all its
middle blocks were the second. Hugging Face models keep those decisions in attributes
(`attention_type`, `sliding_window`), which the signature compares. A REUSE_MIN_PERIODS above the
number of blocks turns reuse off (tests/test_trace_reuse.py compares reused traces with full ones).
"""

from __future__ import annotations

import enum
import types
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from autoplan.tracing.counting import storage_key
from autoplan.tracing.expand import Mismatch, Repeats, expand
from cost_models.records import ModelTrace

__all__ = ["find_repeats", "truncated", "block_tensors", "trace_difference", "storage_layout", "predict_and_check",
           "REUSE_MIN_PERIODS", "TRACED_PERIODS"]

REUSE_MIN_PERIODS = 8  # reuse traces 3 + 4 periods: below 8 periods it saves little
TRACED_PERIODS = (3, 4)
_PLAIN = (type(None), bool, int, float, str, bytes, enum.Enum, torch.dtype, torch.device)


def _value_signature(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_signature(v) for v in value))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, types.MethodType):  # a block's own method, bound to each block
        return ("method", id(value.__func__))
    return (type(value).__qualname__, id(value))  # an object: alike only when it is the same one


def _attributes(block: nn.Module) -> dict[tuple[str, str], object]:
    found = {}
    for path, module in block.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if not name.startswith("_") and not isinstance(value, nn.Module):
                found[(path, name)] = _value_signature(value)
    return found


def _structure(block: nn.Module) -> tuple:
    rows = []
    for path, module in block.named_modules(remove_duplicate=False):
        rows.append((path, type(module).__module__, type(module).__qualname__, module.training,
                     len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks)))
    for name, tensor in [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]:
        rows.append((name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad, isinstance(tensor, nn.Parameter)))
    return tuple(rows)


def _signatures(blocks: list[nn.Module]) -> list[tuple]:
    attributes = [_attributes(block) for block in blocks]
    # an int attribute that is the block's index plus a constant in every block only counts the block
    def counts_blocks(key) -> bool:
        return all(type(attrs.get(key)) is int and attrs[key] - index == attributes[0][key]
                   for index, attrs in enumerate(attributes))

    counters = {key for key in attributes[0] if counts_blocks(key)}
    return [(_structure(block), tuple(sorted(((k, v) for k, v in attrs.items() if k not in counters), key=repr)))
            for block, attrs in zip(blocks, attributes)]


def find_repeats(model: nn.Module, path: str | None) -> Repeats | None:
    """The period with which the blocks under `path` repeat, when there are enough periods to reuse."""
    if not path:
        return None
    blocks = list(model.get_submodule(path))
    signatures = _signatures(blocks)
    for period in range(1, len(blocks) // REUSE_MIN_PERIODS + 1):
        if len(blocks) % period == 0 and all(signatures[i] == signatures[i - period]
                                             for i in range(period, len(blocks))):
            return Repeats(path, len(blocks), period)
    return None


@contextmanager
def truncated(model: nn.Module, repeats: Repeats, periods: int) -> Iterator[None]:
    """The model with only its first `periods` periods of blocks, while inside."""
    blocks = model.get_submodule(repeats.path)
    kept = blocks._modules
    blocks._modules = OrderedDict(list(kept.items())[: periods * repeats.period])
    try:
        yield
    finally:
        blocks._modules = kept


def block_tensors(model: nn.Module, repeats: Repeats) -> dict[int, tuple[int, str]]:
    """Storage key -> (block index, name in the block) of the parameters and buffers of each block."""
    found = {}
    for index, block in enumerate(model.get_submodule(repeats.path)):
        for name, tensor in [*block.named_parameters(remove_duplicate=False),
                             *block.named_buffers(remove_duplicate=False)]:
            found.setdefault(storage_key(tensor), (index, name))
    return found


def storage_layout(trace: ModelTrace) -> list[tuple]:
    """What each op reads, produces and first saves, with storages numbered in order of appearance: two
    traces with the same layout hold the same storages under other keys."""
    numbers: dict[int, int] = {}
    produced: dict[str, list[int]] = {}
    for key, name in trace.storage_producer.items():
        produced.setdefault(name, []).append(key)
    saved: dict[str, list[tuple[int, int]]] = {}
    for key, (nbytes, name) in trace.saved_storages.items():
        saved.setdefault(name, []).append((key, nbytes))
    layout = []
    for op in trace.ops:
        layout.append((
            op.name,
            [(numbers.setdefault(key, len(numbers)), nbytes) for key, nbytes in trace.input_storages.get(op.name, [])],
            [numbers.setdefault(key, len(numbers)) for key in produced.pop(op.name, [])],
            [(numbers.setdefault(key, len(numbers)), nbytes) for key, nbytes in saved.pop(op.name, [])],
        ))
    names = {op.name for op in trace.ops}
    layout.append(("not an op's", sorted(produced), sorted(saved), sorted(set(trace.input_storages) - names)))
    return layout


def trace_difference(a: ModelTrace, b: ModelTrace) -> str | None:
    """The first way two traces differ (ops, graph, storages), or None when they are the same trace."""
    if (a.micro_batch_size, a.seq_len, a.dtype) != (b.micro_batch_size, b.seq_len, b.dtype):
        return "micro-batch, sequence length or dtype"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} ops, not {len(b.ops)}"
    for x, y in zip(a.ops, b.ops):
        if x != y:
            return f"op {x.name} vs {y.name}: {x} != {y}"
    if {name for name, _ in a.nodes()} != {name for name, _ in b.nodes()} or set(a.edges()) != set(b.edges()):
        return f"graph edges: {sorted(set(a.edges()) ^ set(b.edges()))[:4]}"
    for x, y in zip(storage_layout(a), storage_layout(b)):
        if x != y:
            return f"storages at op {x[0]}: {x[1:]} vs {y[1:]}"
    return None


def predict_and_check(short: ModelTrace, longer: ModelTrace, repeats: Repeats, tracer: str,
                      tensors: dict[int, tuple[int, str]]) -> None:
    """Raises Mismatch unless `longer` (one more period) is what `short` predicts."""
    periods = TRACED_PERIODS[0]
    difference = trace_difference(expand(short, repeats, periods, periods + 1, tracer, tensors), longer)
    if difference is not None:
        raise Mismatch(f"a {periods + 1}-period trace is not the {periods}-period one repeated: {difference}")

