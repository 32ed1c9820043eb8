"""The trace cache: a model traced once is read from disk by the next command, under a key that changes with
anything the traces depend on; entries are JSON, and a damaged or stale one is traced again and rewritten."""

import importlib
import json
import sys
import textwrap

import pytest

import autoplan
from autoplan.api.traced import TracedModel
from autoplan.tracing import cache


@pytest.fixture
def on(tmp_path, monkeypatch):
    """The cache on, in a folder of its own; returns the calls to the real tracer."""
    monkeypatch.setenv(cache.CACHE_SWITCH_ENV, "on")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    calls = []
    real = cache.trace_pair
    monkeypatch.setattr(cache, "trace_pair", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def _entries(tmp_path):
    return sorted((tmp_path / "cache" / "traces").glob("*.json"))


def _comparable(traced: TracedModel):
    return cache._comparable(traced.traces("bf16"))


def test_a_second_read_of_a_model_comes_from_disk_and_is_the_same(tmp_path, on):
    first = TracedModel("llama-tiny", seq_len=32)
    again = TracedModel("llama-tiny", seq_len=32)
    assert _comparable(first) == _comparable(again)
    assert len(on) == 1 and len(_entries(tmp_path)) == 1
    data = json.loads(_entries(tmp_path)[0].read_text())  # data, not a pickle
    assert data["format"] == cache.FORMAT and data["tracer"] == "fx" and len(data["traces"]) == 2


def test_a_search_from_cached_traces_makes_the_same_plan(tmp_path, on, monkeypatch):
    def plan():
        found = autoplan.search("gpt2-tiny", "20MB", gpus=2, seq_len=64, profile="cpu-gloo-2").model_dump(mode="json")
        found.pop("timing", None)  # the search's wall times
        return found

    cold, warm = plan(), plan()
    assert len(on) == 1 and cold == warm
    monkeypatch.setenv(cache.CACHE_SWITCH_ENV, "off")
    assert plan() == cold and len(on) == 2  # off: traced, and nothing more written
    assert len(_entries(tmp_path)) == 1


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"format": 0}), "[]", ""])
def test_a_damaged_or_stale_entry_is_traced_again_and_rewritten(tmp_path, on, damage):
    TracedModel("gpt2-tiny", seq_len=32).traces()
    [entry] = _entries(tmp_path)
    entry.write_text(damage)
    assert _comparable(TracedModel("gpt2-tiny", seq_len=32)) == _comparable(TracedModel("gpt2-tiny", seq_len=32))
    assert len(on) == 2 and json.loads(entry.read_text())["format"] == cache.FORMAT


def test_an_entry_recorded_for_another_key_is_not_used(tmp_path, on):
    TracedModel("gpt2-tiny", seq_len=32).traces()
    [entry] = _entries(tmp_path)
    data = json.loads(entry.read_text())
    data["key"] = "something else"
    entry.write_text(json.dumps(data))
    TracedModel("gpt2-tiny", seq_len=32).traces()
    assert len(on) == 2


def test_what_the_traces_depend_on_is_in_the_key(tmp_path, on):
    TracedModel("gpt2-tiny", seq_len=32).traces()
    TracedModel("gpt2-tiny", seq_len=64).traces()  # the sequence length
    TracedModel("gpt2-tiny", seq_len=32).traces("fp32")  # the compute dtype
    TracedModel("gpt2-tiny[n_heads=2]", seq_len=32).traces()  # same parameters and fingerprint, other heads
    TracedModel("gpt2-tiny", seq_len=32, tracer="dispatch").traces()  # the tracer asked for
    assert len(on) == 5 and len(_entries(tmp_path)) == 5


def test_an_edit_to_the_models_code_is_a_new_key(tmp_path, on, monkeypatch):
    source = textwrap.dedent("""
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(64, 16)
                self.proj = nn.Linear(16, 64)

            def forward(self, ids):
                return self.proj(self.embed(ids){edit})
    """)
    (tmp_path / "edited_net.py").write_text(source.format(edit=""))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_net")
    TracedModel(module.Net(), seq_len=8).traces()
    TracedModel(module.Net(), seq_len=8).traces()
    assert len(on) == 1
    (tmp_path / "edited_net.py").write_text(source.format(edit=".relu()"))
    module = importlib.reload(module)
    ops = TracedModel(module.Net(), seq_len=8).traces().at_1.ops
    assert len(on) == 2 and any(op.kind == "relu" for op in ops)
    sys.modules.pop("edited_net", None)


def test_the_cache_keeps_at_most_its_entries(tmp_path, on, monkeypatch):
    monkeypatch.setattr(cache, "MAX_ENTRIES", 2)
    for seq_len in (8, 16, 24):
        TracedModel("gpt2-tiny", seq_len=seq_len).traces()
    assert len(_entries(tmp_path)) == 2


def test_a_stack_of_reused_blocks_is_kept_as_a_few_blocks_and_read_back_whole(tmp_path, on):
    first = TracedModel("gpt2-tiny[n_layers=24]", seq_len=32)
    pair = first.traces()
    assert pair.blocks is not None and pair.reuse.startswith("24 blocks")
    data = json.loads(_entries(tmp_path)[0].read_text())
    assert data["blocks"]["count"] == 24 and len(data["traces"]) == 2
    assert all(len(stored["ops"]) < len(pair.at_1.ops) / 4 for stored in data["traces"])  # 3 blocks, not 24
    again = TracedModel("gpt2-tiny[n_layers=24]", seq_len=32)
    assert _comparable(first) == _comparable(again) and len(on) == 1  # expanded as the trace was
