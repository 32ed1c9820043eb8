"""A model read once for planning: `autoplan.trace` and the TracedModel it returns.

Tracing is the slow part of a search (seconds for a large model), and its result does not depend on
the cluster, the memory limit or the micro-batch; a TracedModel keeps the traces and the cost tables
built from them, so that a sweep of limits (`autoplan.frontier`), other clusters and estimates trace
a model once. Across commands, the traces are kept on disk (autoplan.tracing.cache).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from autoplan.api.heap import young_collections_only
from autoplan.errors import UsageError
from autoplan.models.resolve import resolve_model
from autoplan.models.zoo import count_params
from autoplan.settings import check_choice, choices_of
from autoplan.solve.tables import CostTables, compute_dtype_of
from autoplan.tracing.cache import cached_trace_pair
from autoplan.tracing.pricing_notes import refuse_unpriced, trace_notes
from autoplan.tracing.tracer import ExampleInputs, Pricing, TracePair

__all__ = ["TracedModel", "trace", "reuse_traced"]


class TracedModel:
    """A model read once for planning: reuse it for any number of searches and estimates.

    `model` is a zoo name, "hf:path/to/config.json", "package.module:factory" or an nn.Module.
    Tracing runs the model on the meta device at micro-batch 1 and 2 (op costs are affine in the
    micro-batch), once per compute dtype, when a search or estimate first needs it. `seq_len` defaults
    to the model's context (zoo and Hugging Face models) or to dim 1 of `example_inputs`, which a model
    whose forward does not take token ids [batch, seq] needs (tensors with the batch in dim 0).
    `tracer` forces "fx" or "dispatch"; by default fx is tried first.
    """

    def __init__(self, model: str | nn.Module, *, seq_len: int | None = None, example_inputs: Any = None,
                 tracer: str | None = None):
        self.resolved = resolve_model(model)
        given = example_inputs if example_inputs is not None else self.resolved.inputs
        self.example_inputs = ExampleInputs.of(given) if given is not None else None
        if self.example_inputs is not None and not self.example_inputs.has_sequence:
            if seq_len not in (None, 1):
                raise UsageError(f"`seq_len` {seq_len}: the inputs of {self.resolved.name} "
                                 f"({self.example_inputs.named.text()}) have no `seq` dimension to take it")
            seq_len = 1  # no sequence: throughput in samples/s
        if seq_len is None:
            seq_len = self.resolved.max_seq_len or (self.example_inputs.seq_len if self.example_inputs else None)
        if seq_len is None:
            note = self.resolved.seq_len_note
            raise UsageError("give `seq_len` (the sequence length to plan for) " + (
                f"for {self.resolved.name}: {note}" if note else "for a model outside the zoo"))
        if seq_len < 1:
            raise UsageError(f"`seq_len` must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.forced_tracer = tracer
        self.pricing = Pricing()  # what traces price: see price_for
        self.allow_unpriced = False
        self._traces: dict[tuple, TracePair] = {}
        self._caches: dict[tuple, CostTables] = {}

    def price_for(self, settings: Any, device_type: str, plan: Any = None) -> TracedModel:
        """Trace for `settings`' attention kernel and capacity factor on a profile of `device_type`, or for
        what `plan` (a Plan) was made with; refuse unpriced work above the limit unless the settings allow it."""
        model = plan.model if plan is not None else None
        attention = getattr(settings, "attention", None) or (model.attention_request if model else None)
        factor = getattr(settings, "capacity_factor", None) or (model.capacity_factor if model else 1.0)
        self.pricing = Pricing(attention, "cuda" if device_type == "cuda" else "cpu", factor)
        self.allow_unpriced = bool(getattr(settings, "allow_unpriced", False)) or (
            model is not None and model.allow_unpriced)
        if model is not None and model.inputs and not self._traces and (
                self.example_inputs is None or self.example_inputs.named is None
                or self.example_inputs.named.text() != model.inputs):
            self.example_inputs = ExampleInputs.of(model.inputs)  # the inputs the plan was made for
        return self

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def module(self) -> nn.Module:
        return self.resolved.module

    @property
    def n_params(self) -> int:
        return count_params(self.resolved.module)

    @property
    def tracer(self) -> str | None:
        """The tracer that read the model ("fx" or "dispatch"), None before the first trace."""
        return next((pair.tracer for pair in self._traces.values()), None)

    def traces(self, compute_dtype: str = "bf16") -> TracePair:
        """The traces for `compute_dtype` as `pricing` prices them (a trace for another device is reused where
        every attention call takes the same kernel on both)."""
        key = self._trace_key(compute_dtype)
        if key not in self._traces:
            self._traces[key] = cached_trace_pair(self.resolved.module, self.seq_len, compute_dtype,
                                                  self.example_inputs, self.forced_tracer, self.pricing)
        return self._traces[key]

    def _trace_key(self, compute_dtype: str) -> tuple:
        for key, pair in self._traces.items():
            if key[0] == compute_dtype and pair.prices_as(self.pricing):
                return key
        return (compute_dtype, self.pricing)

    def notes(self, compute_dtype: str) -> dict[str, Any]:
        """The plan's record of how the model was priced (ModelRef's attention, unpriced, ... fields); UsageError
        where unpriced work passes the limit and `allow_unpriced` was not given (tracing.pricing_notes)."""
        named = self.example_inputs.named if self.example_inputs is not None else None
        if not self.allow_unpriced:  # a plan or an estimate of a model with work no formula prices
            refuse_unpriced(self.traces(compute_dtype).at_1, self.name)
        return {**trace_notes(self.traces(compute_dtype), self.pricing, self.allow_unpriced),
                "inputs": named.text() if named is not None else None}

    def cache(self, compute_dtype: str, granularity: str, extra_units: tuple[str, ...] = ()) -> CostTables:
        """The cost tables at `granularity`, with `extra_units` (module paths, e.g. pinned) made units too."""
        key = (self._trace_key(compute_dtype), granularity)
        if key not in self._caches:
            self._caches[key] = CostTables(self.resolved.module, self.seq_len, compute_dtype, granularity,
                                            self.traces(compute_dtype))
        extra = tuple(sorted(set(extra_units) - {unit.path for unit in self._caches[key].units}))
        if extra and key + extra not in self._caches:
            self._caches[key + extra] = CostTables(self.resolved.module, self.seq_len, compute_dtype, granularity,
                                                   self.traces(compute_dtype), extra)
        return self._caches[key + extra]

    def __repr__(self) -> str:
        return (f"TracedModel({self.name!r}, {self.n_params:,} parameters, seq_len={self.seq_len}, "
                f"tracer={self.tracer or 'not traced yet'})")


def trace(model: str | nn.Module, *, seq_len: int | None = None, example_inputs: Any = None,
          dtype: str = "bf16-mixed", tracer: str | None = None) -> TracedModel:
    """Read a model once for planning; pass the result to `search`, `estimate` or `frontier` in place of
    the model. Traces now (for `dtype`'s compute precision), so errors surface here.

    >>> import autoplan
    >>> traced = autoplan.trace("gpt2-tiny", seq_len=64)
    >>> traced.tracer, traced.n_params
    ('fx', 141056)
    """
    check_choice("dtype", dtype, choices_of("dtype"))
    with young_collections_only():  # the traces' records live on (autoplan.api.heap)
        traced = TracedModel(model, seq_len=seq_len, example_inputs=example_inputs, tracer=tracer)
        traced.traces(compute_dtype_of(dtype))
    return traced


def reuse_traced(model: str | nn.Module | TracedModel, seq_len: int | None, example_inputs: Any) -> TracedModel:
    """`model` itself when it is traced already (its sequence length and inputs are fixed), else a new one."""
    if not isinstance(model, TracedModel):
        return TracedModel(model, seq_len=seq_len, example_inputs=example_inputs)
    if seq_len is not None and seq_len != model.seq_len:
        raise UsageError(f"{model.name} was traced at sequence length {model.seq_len}, not {seq_len}; "
                         "trace it again with seq_len=" + str(seq_len))
    if example_inputs is not None:
        raise UsageError("example_inputs belong to autoplan.trace(); this model is traced already")
    return model
