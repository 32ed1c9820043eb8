"""Tracer choice: torch.fx first, the dispatch-level tracer where fx fails; example inputs; clear errors."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplan
from autoplan.errors import TraceError
from autoplan.models.zoo import build_model
from autoplan.tracing.dispatch_tracer import trace_dispatch
from autoplan.tracing.fx_tracer import trace_model
from autoplan.tracing.units import build_units
from cost_models.activations import activation_keep_bytes


def _per_unit(model, trace):
    units = build_units(model, trace)
    keep = activation_keep_bytes(trace, units)
    totals = {}
    for unit, kept in zip(units, keep):
        ops = [trace.op(name) for name in unit.ops]
        totals[unit.path] = dict(
            fwd_flops=sum(o.fwd_flops for o in ops), bwd_flops=sum(o.bwd_flops for o in ops),
            fwd_bytes=sum(o.fwd_bytes for o in ops), bwd_bytes=sum(o.bwd_bytes for o in ops),
            saved_bytes=sum(o.saved_bytes for o in ops), keep_bytes=kept,
            fwd_max_alloc=max([o.fwd_max_alloc_bytes for o in ops], default=0),
        )
    return totals


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_dispatch_tracer_costs_each_unit_as_fx_does(name):
    model = build_model(name)
    fx_trace, dispatch_trace = trace_model(model, 2, 32, "bf16"), trace_dispatch(model, 2, 32, "bf16")
    assert _per_unit(model, dispatch_trace) == _per_unit(model, fx_trace)
    # the ops that do work carry the same keys, so a profile's measured op times apply to both
    def keys(trace):
        return Counter(op.key for op in trace.ops if op.fwd_bytes or op.fwd_flops)

    assert keys(dispatch_trace) == keys(fx_trace)


def test_forced_dispatch_tracer_gives_the_fx_plan():
    settings = dict(gpus=2, batch_size=4)
    by_fx = autoplan.search(autoplan.trace("gpt2-tiny", seq_len=32), "20MB", **settings, fit_to="allocated")
    by_dispatch = autoplan.search(autoplan.trace("gpt2-tiny", seq_len=32, tracer="dispatch"), "20MB", **settings, fit_to="allocated")
    assert (by_fx.model.tracer, by_dispatch.model.tracer) == ("fx", "dispatch")
    assert [(u.sharding, u.checkpoint) for u in by_dispatch.units] == [(u.sharding, u.checkpoint) for u in by_fx.units]
    assert by_dispatch.predicted.peak_mem_bytes == by_fx.predicted.peak_mem_bytes
    assert by_dispatch.predicted.step_time_s == pytest.approx(by_fx.predicted.step_time_s, rel=0.05)


class ShapeBranchingLM(nn.Module):
    """Python control flow on a shape: fx cannot trace it (the shape is a proxy), eager meta runs can."""

    def __init__(self, vocab=128, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        if x.shape[-1] % 2 == 0:
            x = x * 0.5
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_fx_failure_falls_back_to_the_dispatch_tracer_and_says_so():
    plan = autoplan.search(ShapeBranchingLM(), "20MB", gpus=2, seq_len=16, fit_to="allocated")
    assert plan.model.tracer == "dispatch"
    assert [u.module for u in plan.units] == ["", "embed", "blocks.0", "blocks.1", "head"]
    assert "traced by dispatch" in plan.table()


class ValueGate(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        if x.abs().sum() > 0:  # reads tensor values: no tracer can follow this on meta tensors
            return self.proj(x)
        return x


class ValueBranchingLM(ShapeBranchingLM):
    def __init__(self):
        super().__init__()
        self.blocks[1].append(ValueGate(32))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_untraceable_model_names_the_module_and_every_tracer_tried():
    with pytest.raises(TraceError) as info:
        autoplan.search(ValueBranchingLM(), "20MB", gpus=2, seq_len=16)
    message = str(info.value)
    assert "tried fx, dispatch" in message
    assert "fx:" in message and "dispatch:" in message
    assert message.count("'blocks.1.3'") == 2  # the ValueGate, named by both tracers
    assert "__bool__" in message and "example_inputs" in message


class BatchBranchingLM(ShapeBranchingLM):
    def forward(self, input_ids):
        x = self.embed(input_ids)
        if x.shape[0] > 1:  # different ops at micro-batch 1 and 2
            x = torch.tanh(x)
        return self.head(x)


def test_batch_dependent_ops_are_refused():
    with pytest.raises(TraceError, match="different ops at micro-batch 1 and 2"):
        autoplan.trace(BatchBranchingLM(), seq_len=16, tracer="dispatch")


class FeatureModel(nn.Module):
    """Takes float features and a keyword mask, not token ids; returns a scalar-able tensor."""

    def __init__(self, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))

    def forward(self, features, mask=None):
        for layer in self.layers:
            features = F.relu(layer(features))
        return features if mask is None else features * mask.unsqueeze(-1)


def test_example_inputs_trace_other_forwards_and_give_the_sequence_length():
    example = {"features": torch.randn(4, 10, 16), "mask": torch.ones(4, 10)}
    traced = autoplan.trace(FeatureModel(), example_inputs=example)
    assert traced.seq_len == 10 and traced.tracer == "dispatch"  # keyword inputs: fx takes positional only
    plan = autoplan.search(traced, "10MB", gpus=2, batch_size=8, fit_to="allocated")
    assert plan.training.seq_len == 10
    assert [u.module for u in plan.units] == ["", "layers.0", "layers.1", "layers.2"]

    # fx makes the optional mask a graph input and then cannot run without it; the fallback can
    positional = autoplan.trace(FeatureModel(), example_inputs=torch.randn(2, 7, 16))
    assert positional.seq_len == 7 and positional.tracer == "dispatch"


def test_bad_example_inputs_and_tracer_names_are_usage_errors():
    with pytest.raises(autoplan.UsageError, match="example_inputs"):
        autoplan.trace(FeatureModel(), example_inputs="features")
    with pytest.raises(autoplan.UsageError, match="fx, dispatch"):
        autoplan.trace("gpt2-tiny", seq_len=16, tracer="jit")


def test_grouped_query_attention_traces_where_torch_formula_wants_equal_heads(monkeypatch):
    """torch 2.11's attention FLOP formula asserts as many key/value heads as query heads (2.13's counts the
    groups): a grouped-query model traces under it too, to the same FLOPs."""
    import torch.utils.flop_counter as flop_counter

    import autoplan.tracing.flops as flops

    model = build_model("llama-tiny")  # 4 query heads, 2 key/value heads
    expected = trace_model(model, 2, 32, "bf16")
    original = flop_counter.sdpa_flop_count

    def equal_heads_only(query_shape, key_shape, value_shape):
        assert query_shape[1] == key_shape[1] == value_shape[1], "sdpa_flop_count: q/k/v shapes are incompatible"
        return original(query_shape, key_shape, value_shape)

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", equal_heads_only)
    monkeypatch.setattr(flops, "sdpa_flop_count", equal_heads_only)
    strict = trace_model(model, 2, 32, "bf16")
    assert sum(op.fwd_flops for op in strict.ops) == sum(op.fwd_flops for op in expected.ops) > 0
    assert [op.bwd_flops for op in strict.ops] == [op.bwd_flops for op in expected.ops]
