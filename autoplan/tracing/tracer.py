"""Which tracer reads a model, and with what inputs: torch.fx first, the dispatch tracer when fx fails.

Planning needs each op's cost at any micro-batch; costs are affine in it, so every model is traced
twice, at micro-batch 1 and 2 (see trace.extrapolate_ops). Both traces must come from the same
tracer and hold the same ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from autoplan.errors import TraceError, UsageError
from autoplan.tracing.dispatch_tracer import trace_dispatch
from autoplan.tracing.fx_tracer import symbolic_trace, trace_model
from cost_models.records import ModelTrace

TRACERS = ("fx", "dispatch")
TRACED_BATCHES = (1, 2)
TRACE_HINT = ("Tracing runs the model on meta tensors, which have shapes but no values: a forward that reads "
              "values (x.item(), `if mask.any():`) cannot be traced; a forward that takes other inputs than "
              "token ids [batch, seq] needs example_inputs (autoplan.trace(model, example_inputs=...)).")


@dataclass(frozen=True)
class ExampleInputs:
    """What the model's forward takes, when token ids [batch, seq] are not it: positional and keyword
    arguments whose tensors all have the batch in dim 0. Only shapes and dtypes are used."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, example: Any) -> ExampleInputs:
        """A tensor, a tuple/list of positional inputs, a dict of keyword inputs, or ExampleInputs."""
        if isinstance(example, ExampleInputs):
            return example
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
        """Dim 1 of the first input with at least two dims (token ids [batch, seq])."""
        for tensor in _tensor_leaves((self.args, self.kwargs)):
            if tensor.dim() >= 2:
                return int(tensor.shape[1])
        return None

    def at_batch(self, micro_batch_size: int) -> tuple[tuple, dict[str, Any]]:
        """Meta tensors of the same dtypes with the batch dim set to `micro_batch_size`."""
        def resize(value):
            if not isinstance(value, torch.Tensor):
                return value
            shape = (micro_batch_size, *value.shape[1:]) if value.dim() else ()
            return torch.empty(shape, dtype=value.dtype, device="meta")

        return tree_map(resize, self.args), tree_map(resize, self.kwargs)


def _tensor_leaves(value) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


@dataclass
class TracePair:
    tracer: str  # "fx" or "dispatch"
    at_1: ModelTrace  # micro-batch 1
    at_2: ModelTrace  # micro-batch 2


def _trace_fx(model: nn.Module, seq_len: int, dtype: str, inputs: ExampleInputs | None) -> list[ModelTrace]:
    if inputs is not None and inputs.kwargs:
        raise TraceError("torch.fx passes positional inputs only; keyword example inputs need the dispatch tracer")
    graph_module = symbolic_trace(model)
    return [trace_model(model, batch, seq_len, dtype, inputs=inputs.at_batch(batch)[0] if inputs else None,
                        graph_module=graph_module) for batch in TRACED_BATCHES]


def _trace_dispatch(model: nn.Module, seq_len: int, dtype: str, inputs: ExampleInputs | None) -> list[ModelTrace]:
    traces = []
    for batch in TRACED_BATCHES:
        args, kwargs = inputs.at_batch(batch) if inputs else (None, None)
        traces.append(trace_dispatch(model, batch, seq_len, dtype, args=args, kwargs=kwargs))
    names_1, names_2 = [op.name for op in traces[0].ops], [op.name for op in traces[1].ops]
    if names_1 != names_2:
        first = next((a, b) for a, b in zip(names_1 + [""], names_2 + [""]) if a != b)
        raise TraceError(f"the model runs different ops at micro-batch 1 and 2 (first difference: {first[0]!r} vs "
                         f"{first[1]!r}); autoplan needs a forward whose ops do not depend on the batch size")
    return traces


_TRACE_FUNCTIONS = {"fx": _trace_fx, "dispatch": _trace_dispatch}


def trace_pair(model: nn.Module, seq_len: int, dtype: str = "bf16", inputs: ExampleInputs | None = None,
               tracer: str | None = None) -> TracePair:
    """Traces at micro-batch 1 and 2 by the first tracer that works (or the one named). Raises
    TraceError naming every tracer tried and where each failed."""
    if tracer is not None and tracer not in TRACERS:
        raise UsageError(f"unknown tracer {tracer!r}; choose one of {', '.join(TRACERS)}")
    failures = []
    for name in (tracer,) if tracer else TRACERS:
        try:
            return TracePair(name, *_TRACE_FUNCTIONS[name](model, seq_len, dtype, inputs))
        except TraceError as exc:
            failures.append(f"{name}: {exc}")
    raise TraceError(f"cannot trace {type(model).__name__}; tried " + ", ".join((tracer,) if tracer else TRACERS)
                     + ":\n  " + "\n  ".join(failures) + "\n" + TRACE_HINT)


__all__ = ["ExampleInputs", "TRACERS", "TracePair", "trace_pair"]
