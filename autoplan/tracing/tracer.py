"""Which tracer reads a model, and with what inputs: torch.fx first, the dispatch tracer when fx fails.

Planning needs each op's cost at any micro-batch; costs are affine in it, so every model is traced
twice, at micro-batch 1 and 2 (see cost_models.records.extrapolate_ops). Both traces must come from
the same tracer and hold the same ops. A model whose blocks repeat is traced by a few of its blocks
(see reuse); a trace of every block shows its progress (see progress) when it takes a while.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from autoplan.errors import TraceError, UsageError
from autoplan.models.inputs import ModelInputs
from autoplan.models.structure import largest_module_list
from autoplan.tracing.attention import AttentionPolicy
from autoplan.tracing.counting import DTYPES, to_meta
from autoplan.tracing.dispatch_tracer import trace_dispatch
from autoplan.tracing.expand import Mismatch, Repeats, expand
from autoplan.tracing.fx_tracer import symbolic_trace, trace_model
from autoplan.tracing.meta_kernels import plain_meta_kernels
from autoplan.tracing.progress import BlockProgress
from autoplan.tracing.reuse import TRACED_PERIODS, block_tensors, find_repeats, predict_and_check, truncated
from autoplan.tracing.trace_options import TraceOptions
from cost_models.records import ModelTrace

TRACERS = ("fx", "dispatch")
TRACED_BATCHES = (1, 2)
TRACE_HINT = ("Tracing runs the model on meta tensors, which have shapes but no values: a forward that reads "
              "values (x.item(), `if mask.any():`) cannot be traced; a forward that takes other inputs than "
              "token ids [batch, seq] needs example_inputs (autoplan.trace(model, example_inputs=...)).")


@dataclass(frozen=True)
class ExampleInputs:
    """What the model's forward takes, when token ids [batch, seq] are not it: positional and keyword
    arguments whose tensors all have the batch in dim 0, or named inputs with named dimensions
    (autoplan.models.inputs: the batch and the sequence set at each trace). Only shapes and dtypes are
    used; floating inputs are made in the compute dtype, as FSDP2's mixed precision casts them."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    named: ModelInputs | None = None

    @classmethod
    def of(cls, example: Any) -> ExampleInputs:
        """A tensor, a tuple/list of positional inputs, a dict of keyword inputs, named inputs (ModelInputs,
        or their spec or JSON file: see autoplan.models.inputs), or ExampleInputs."""
        if isinstance(example, ExampleInputs):
            return example
        if isinstance(example, str):
            example = ModelInputs.parse(example)
        if isinstance(example, ModelInputs):
            return cls(named=example)
        if isinstance(example, torch.Tensor):
            return cls((example,))
        if isinstance(example, (tuple, list)):
            return cls(tuple(example))
        if isinstance(example, dict):
            return cls((), dict(example))
        raise UsageError(f"example_inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, "
                         f"not {type(example).__name__}")

    @property
    def seq_len(self) -> int | None:
        """Dim 1 of the first input with at least two dims (token ids [batch, seq]); named inputs: none."""
        for tensor in _tensor_leaves((self.args, self.kwargs)):
            if tensor.dim() >= 2:
                return int(tensor.shape[1])
        return None

    @property
    def has_sequence(self) -> bool:
        return self.named is None or self.named.has_sequence

    def at_batch(self, micro_batch_size: int, seq_len: int = 1, dtype: str = "fp32") -> tuple[tuple, dict[str, Any]]:
        """Meta tensors with the batch dim set to `micro_batch_size` (named inputs: and `seq` to `seq_len`),
        floating ones in `dtype`."""
        float_dtype = DTYPES[dtype]
        if self.named is not None:
            return (), self.named.at(micro_batch_size, seq_len, float_dtype)

        def resize(value):
            if not isinstance(value, torch.Tensor):
                return value
            shape = (micro_batch_size, *value.shape[1:]) if value.dim() else ()
            return torch.empty(shape, dtype=float_dtype if value.dtype.is_floating_point else value.dtype,
                               device="meta")

        return tree_map(resize, self.args), tree_map(resize, self.kwargs)


def _tensor_leaves(value) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


@dataclass(frozen=True)
class Pricing:
    """What a trace prices besides the model: the attention kernel asked for (None: torch's pick) on the
    profile's device ("cuda" or "cpu"), and the capacity factor of mixture-of-experts expert matmuls."""

    attention: str | None = None
    device: str = "cuda"
    capacity_factor: float = 1.0

    def policy(self) -> AttentionPolicy:
        return AttentionPolicy(self.attention, self.device)


@dataclass(frozen=True)
class BlockTraces:
    """What a reused pair was expanded from: the traces of the model cut to `periods` periods of its blocks and
    the short model's block parameters and buffers (reuse.block_tensors). A few blocks' ops, which the trace cache
    keeps in place of the whole model's (expanding them again is cheaper than reading every block's)."""

    tracer: str
    repeats: Repeats
    periods: int
    at_1: ModelTrace
    at_2: ModelTrace
    tensors: dict[int, tuple[int, str]]

    def expanded(self) -> list[ModelTrace]:
        """The whole model's traces at micro-batch 1 and 2."""
        return [expand(trace, self.repeats, self.periods, self.repeats.periods, self.tracer, self.tensors)
                for trace in (self.at_1, self.at_2)]


@dataclass
class TracePair:
    tracer: str  # "fx" or "dispatch"
    at_1: ModelTrace  # micro-batch 1
    at_2: ModelTrace  # micro-batch 2
    # how the blocks were traced: "48 blocks of transformer.h from traces of 3 and 4", or why all were
    reuse: str = ""
    pricing: Pricing = Pricing()
    attention: AttentionPolicy | None = None  # the kernels' choices, with the attention calls seen
    blocks: BlockTraces | None = None  # what the traces were expanded from, where blocks were reused

    def prices_as(self, pricing: Pricing) -> bool:
        """Whether these traces are what `pricing` would trace: the same but perhaps the device, where every
        attention call takes the same kernel on both."""
        if pricing == self.pricing:
            return True
        same = (pricing.attention, pricing.capacity_factor) == (self.pricing.attention, self.pricing.capacity_factor)
        return same and self.attention is not None and self.attention.same_on(pricing.device)


TraceFunction = Callable[[nn.Module, Any], list[ModelTrace]]  # (model on meta, progress) -> traces at 1 and 2


def _trace_fx(model: nn.Module, seq_len: int, dtype: str, inputs: ExampleInputs | None, progress=None,
              policy: AttentionPolicy | None = None, capacity_factor: float = 1.0) -> list[ModelTrace]:
    if inputs is not None and (inputs.kwargs or inputs.named):
        raise TraceError("torch.fx passes positional inputs only; keyword example inputs need the dispatch tracer")
    graph_module = symbolic_trace(model)  # before copying the model: it fails at once where it fails
    meta = to_meta(model, dtype)
    return [trace_model(meta, batch, seq_len, dtype,
                        inputs=inputs.at_batch(batch, seq_len, dtype)[0] if inputs else None,
                        graph_module=graph_module,
                        options=TraceOptions(progress and progress(batch), policy, capacity_factor))
            for batch in TRACED_BATCHES]


def _trace_dispatch(model: nn.Module, seq_len: int, dtype: str, inputs: ExampleInputs | None, progress=None,
                    policy: AttentionPolicy | None = None, capacity_factor: float = 1.0) -> list[ModelTrace]:
    traces, meta = [], to_meta(model, dtype)
    for batch in TRACED_BATCHES:
        args, kwargs = inputs.at_batch(batch, seq_len, dtype) if inputs else (None, None)
        traces.append(trace_dispatch(meta, batch, seq_len, dtype, args=args, kwargs=kwargs,
                                     options=TraceOptions(progress and progress(batch), policy, capacity_factor)))
    names_1, names_2 = [op.name for op in traces[0].ops], [op.name for op in traces[1].ops]
    if names_1 != names_2:
        first = next((a, b) for a, b in zip(names_1 + [""], names_2 + [""]) if a != b)
        raise TraceError(f"the model runs different ops at micro-batch 1 and 2 (first difference: {first[0]!r} vs "
                         f"{first[1]!r}); autoplan needs a forward whose ops do not depend on the batch size")
    return traces


_TRACE_FUNCTIONS = {"fx": _trace_fx, "dispatch": _trace_dispatch}


def _by_blocks(model: nn.Module, repeats: Repeats, tracer: str, run: TraceFunction, dtype: str) -> BlockTraces:
    """The traces of the model truncated to 3 and 4 periods of its blocks (see reuse), the whole model's to be
    expanded from the 3-period ones. Raises Mismatch when the 4-period traces are not the 3-period ones repeated."""
    short, longer = {}, {}
    for periods, into in zip(TRACED_PERIODS, (short, longer)):
        with truncated(model, repeats, periods):
            meta = to_meta(model, dtype)
            into["traces"], into["tensors"] = run(meta, None), block_tensors(meta, repeats)
    for trace, longer_trace in zip(short["traces"], longer["traces"]):
        predict_and_check(trace, longer_trace, repeats, tracer, short["tensors"])
    return BlockTraces(tracer, repeats, TRACED_PERIODS[0], *short["traces"], short["tensors"])


def reused_note(repeats: Repeats) -> str:
    """TracePair.reuse of traces expanded from a few periods of blocks."""
    traced = " and ".join(str(periods * repeats.period) for periods in TRACED_PERIODS)
    return f"{repeats.count} blocks of {repeats.path} from traces of {traced}"


def _traced(model: nn.Module, tracer: str, seq_len: int, dtype: str, inputs: ExampleInputs | None,
            blocks_path: str | None, repeats: Repeats | None, pricing: Pricing) -> TracePair:
    policy = pricing.policy()

    def run(some_model: nn.Module, progress) -> list[ModelTrace]:
        return _TRACE_FUNCTIONS[tracer](some_model, seq_len, dtype, inputs, progress, policy, pricing.capacity_factor)

    blocks = len(model.get_submodule(blocks_path)) if blocks_path else 0
    reuse = ("no repeated blocks" if not blocks else f"blocks differ, or too few to reuse ({blocks} blocks)")
    if repeats is not None:
        try:
            short = _by_blocks(model, repeats, tracer, run, dtype)
            return TracePair(tracer, *short.expanded(), reuse=reused_note(repeats), pricing=pricing,
                             attention=policy, blocks=short)
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - reuse only saves time: whatever stops it, trace every block
            reuse = f"traced every block: {exc}" if isinstance(exc, (Mismatch, TraceError)) else (
                f"traced every block: {type(exc).__name__}: {exc}")
    progress = (lambda batch: BlockProgress(f"tracing {type(model).__name__} at micro-batch {batch}", blocks_path,
                                            blocks)) if blocks else None
    return TracePair(tracer, *run(model, progress), reuse=reuse, pricing=pricing, attention=policy)


def trace_pair(model: nn.Module, seq_len: int, dtype: str = "bf16", inputs: ExampleInputs | None = None,
               tracer: str | None = None, pricing: Pricing | None = None) -> TracePair:
    """Traces at micro-batch 1 and 2 by the first tracer that works (or the one named), priced as
    `pricing` says (default: torch's attention kernels on CUDA). Raises TraceError naming every tracer
    tried and where each failed, UsageError for an attention kernel that cannot run a call."""
    if tracer is not None and tracer not in TRACERS:
        raise UsageError(f"unknown tracer {tracer!r}; choose one of {', '.join(TRACERS)}")
    failures = []
    blocks_path = largest_module_list(model)
    repeats = find_repeats(model, blocks_path)
    with plain_meta_kernels():  # torch._dynamo not imported (autoplan.tracing.meta_kernels)
        for name in (tracer,) if tracer else TRACERS:
            try:
                return _traced(model, name, seq_len, dtype, inputs, blocks_path, repeats, pricing or Pricing())
            except TraceError as exc:
                failures.append(f"{name}: {exc}")
    raise TraceError(f"cannot trace {type(model).__name__}; tried " + ", ".join((tracer,) if tracer else TRACERS)
                     + ":\n  " + "\n  ".join(failures) + "\n" + TRACE_HINT)


__all__ = ["BlockTraces", "ExampleInputs", "Pricing", "TRACERS", "TracePair", "reused_note", "trace_pair"]
