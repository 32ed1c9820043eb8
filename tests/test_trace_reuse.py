"""Repeated blocks traced once (autoplan.tracing.reuse): the trace built from a few blocks is the trace of
the whole model, field by field (ops, units, the storages the cost model reads), plans do not move,
blocks that differ are traced in full, a trace of every block shows progress, and a deep model traces
without the segfault its autograd graph once caused."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch.nn as nn
import torch.nn.functional as F

import autoplan
from autoplan.models.config import get_config
from autoplan.models.zoo import build_model
from autoplan.tracing import progress, reuse
from autoplan.tracing.tracer import trace_pair
from autoplan.tracing.units import build_units
from cost_models.activations import activation_keep_bytes, kept_saved_bytes

SEQ = 32


@pytest.fixture
def trace_every_block(monkeypatch):
    """Within the test, the whole model is traced (what a trace was before reuse)."""
    def full(model, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(reuse, "REUSE_MIN_PERIODS", 10**9)
            return trace_pair(model, SEQ, "bf16", **kwargs)
    return full


def _storages(trace):
    """What each op reads, produces and saves first, storages numbered in order of appearance."""
    numbers = {}
    produced, saved = {}, {}
    for key, name in trace.storage_producer.items():
        produced.setdefault(name, []).append(key)
    for key, (nbytes, name) in trace.saved_storages.items():
        saved.setdefault(name, []).append((key, nbytes))
    rows = [(op.name,
             [(numbers.setdefault(key, len(numbers)), nbytes) for key, nbytes in trace.input_storages[op.name]],
             [numbers.setdefault(key, len(numbers)) for key in produced.pop(op.name, [])],
             [(numbers.setdefault(key, len(numbers)), nbytes) for key, nbytes in saved.pop(op.name, [])])
            for op in trace.ops]
    assert not produced and not saved and set(trace.input_storages) == {op.name for op in trace.ops}
    return rows


def assert_same_traces(model, reused, full):
    assert reused.tracer == full.tracer
    for fast, slow in ((reused.at_1, full.at_1), (reused.at_2, full.at_2)):
        assert (fast.micro_batch_size, fast.seq_len, fast.dtype) == (slow.micro_batch_size, slow.seq_len, slow.dtype)
        assert len(fast.ops) == len(slow.ops)
        for a, b in zip(fast.ops, slow.ops):
            assert dataclasses.asdict(a) == dataclasses.asdict(b)  # every field, the name and module path too
        assert _storages(fast) == _storages(slow)
        assert set(fast.graph.nodes) == set(slow.graph.nodes) and set(fast.graph.edges) == set(slow.graph.edges)
        assert all(fast.op(op.name) is op for op in fast.ops)
        for granularity in ("block", "fine", "leaf"):
            units = build_units(model, fast, granularity)
            assert units == build_units(model, slow, granularity)
            assert activation_keep_bytes(fast, units) == activation_keep_bytes(slow, units)
            assert kept_saved_bytes(fast, units) == kept_saved_bytes(slow, units)


def _zoo(name: str, layers: int = 9) -> nn.Module:
    return build_model(dataclasses.replace(get_config(name), n_layers=layers))


def _hf_llama(tmp_path, layers: int):
    pytest.importorskip("transformers")
    from autoplan.models.hf import build_hf_model

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return build_hf_model(tmp_path).module


@pytest.mark.parametrize("name, tracer", [("gpt2-tiny", None), ("llama-tiny", None), ("bert-tiny", None),
                                          ("gpt2-tiny", "dispatch"), ("llama-tiny", "dispatch")])
def test_a_zoo_models_blocks_traced_once_give_its_full_trace(name, tracer, trace_every_block):
    model = _zoo(name)
    reused = trace_pair(model, SEQ, "bf16", tracer=tracer)
    assert reused.reuse.endswith("from traces of 3 and 4") and reused.reuse.startswith("9 blocks")
    full = trace_every_block(model, tracer=tracer)
    assert "too few" in full.reuse
    assert_same_traces(model, reused, full)


def test_a_hugging_face_llamas_blocks_traced_once_give_its_full_trace(tmp_path, trace_every_block):
    model = _hf_llama(tmp_path, 10)
    reused = trace_pair(model, SEQ, "bf16")
    assert reused.tracer == "dispatch" and reused.reuse.startswith("10 blocks of model.layers")
    assert_same_traces(model, reused, trace_every_block(model))


def test_plans_from_reused_traces_are_the_plans_of_full_traces(monkeypatch):
    model = _zoo("llama-tiny", 12)
    settings = dict(gpus=2, seq_len=SEQ, profile="cpu-gloo-2")
    reused = autoplan.search(model, "30MB", **settings).to_dict()
    monkeypatch.setattr(reuse, "REUSE_MIN_PERIODS", 10**9)
    full = autoplan.search(model, "30MB", **settings).to_dict()
    for plan in (reused, full):
        del plan["timing"]  # the sweeps' wall-clock times, kept apart from the rest
    assert json.dumps(reused, sort_keys=True) == json.dumps(full, sort_keys=True)


class Block(nn.Module):
    def __init__(self, dim: int, index: int, scale: float = 1.0, wide: bool = False):
        super().__init__()
        self.index, self.scale = index, scale  # `index` only counts the block (as Hugging Face's layer_idx)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim if wide else dim)
        self.down = nn.Linear(4 * dim if wide else dim, dim)

    def forward(self, x):
        return x + self.scale * self.down(F.gelu(self.up(self.norm(x))))


class IndexBranching(Block):
    def forward(self, x):
        x = super().forward(x)
        return x * 2 if self.index == 2 else x  # a decision no attribute shows


class Stack(nn.Module):
    def __init__(self, blocks, vocab=64, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_that_differ_are_each_traced(trace_every_block):
    model = Stack([Block(16, i, scale=2.0 if i == 6 else 1.0) for i in range(10)])
    reused = trace_pair(model, SEQ, "bf16")
    assert reused.reuse.startswith("blocks differ")
    assert_same_traces(model, reused, trace_every_block(model))


def test_a_forward_that_branches_on_the_block_index_is_caught_and_traced_in_full(trace_every_block):
    model = Stack([IndexBranching(16, i) for i in range(10)])
    reused = trace_pair(model, SEQ, "bf16")
    assert reused.reuse.startswith("traced every block: a 4-period trace is not the 3-period one repeated")
    assert_same_traces(model, reused, trace_every_block(model))


@pytest.mark.parametrize("tracer", ["fx", "dispatch"])
def test_alternating_blocks_repeat_with_a_period_of_two(tracer, trace_every_block):
    model = Stack([Block(16, i, wide=i % 2 == 1) for i in range(16)])
    reused = trace_pair(model, SEQ, "bf16", tracer=tracer)
    assert reused.reuse == "16 blocks of blocks from traces of 6 and 8"
    assert_same_traces(model, reused, trace_every_block(model, tracer=tracer))


def test_a_trace_of_every_block_shows_progress_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    trace_pair(Stack([Block(16, i, scale=float(i)) for i in range(10)]), SEQ, "bf16")
    err = capsys.readouterr().err
    assert "tracing Stack at micro-batch 1" in err and "tracing Stack at micro-batch 2" in err
    assert "20/20" in err and "block/s" in err  # 10 blocks forward and 10 backward


def test_a_quick_trace_prints_nothing(capsys):
    trace_pair(_zoo("gpt2-tiny", 2), SEQ, "bf16")
    assert capsys.readouterr().err == ""


DEEP_CHAIN = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    from autoplan.tracing.dispatch_tracer import trace_dispatch

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return x + self.lin(x)

    class Deep(nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(4, 8)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    with torch.device("meta"):
        model = Deep(int(sys.argv[1]))
    print(len(trace_dispatch(model, 1, 2, "fp32").ops))
""")


@pytest.mark.slow
def test_a_deep_autograd_graph_is_freed_without_overflowing_the_stack():
    # 20,000 blocks, 40,000 hooked grad_fn nodes: freeing them recursively segfaulted (exit 139)
    done = subprocess.run([sys.executable, "-c", DEEP_CHAIN, "20000"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["40003"]


@pytest.mark.slow
def test_a_2000_layer_hugging_face_llama_plans(tmp_path):
    model = _hf_llama(tmp_path, 2000)
    traced = autoplan.trace(model, seq_len=SEQ)
    pair = traced.traces("bf16")
    assert pair.reuse == "2000 blocks of model.layers from traces of 3 and 4"
    assert len(build_units(model, pair.at_1)) == 2003  # embedding, 2000 layers, head, root


@pytest.mark.parametrize("tracer", ["fx", "dispatch"])
def test_a_traces_graph_read_without_networkx_is_the_networkx_graph(tracer):
    """The tracers and the expansion keep a graph as its nodes and edges (cost_models.records.GraphEdges): what the
    cache, the reuse check and the expansion read of it (nodes, edges, neighbours) is what networkx's graph built
    from it holds, in networkx's order."""
    pair = trace_pair(_zoo("gpt2"), SEQ, "bf16", tracer=tracer)
    assert pair.blocks is not None
    for trace in (pair.at_1, pair.at_2, pair.blocks.at_1, pair.blocks.at_2):
        nodes, edges = trace.nodes(), trace.edges()
        pred, succ = ({name: list(ends) for name, ends in side.items()} for side in trace.adjacency())
        graph = trace.graph  # built here
        assert type(graph).__module__.startswith("networkx") and len(edges) > len(nodes) > 50
        assert list(graph.nodes(data=True)) == nodes and list(graph.edges) == edges
        assert pred == {name: list(graph.predecessors(name)) for name in graph}
        assert succ == {name: list(graph.successors(name)) for name in graph}
        assert trace.nodes() == nodes and trace.edges() == edges  # read from the built graph now
