"""What a model's own tensor sizes strand in the native caching allocator (cost_models.stranding), and the native
bound that follows it: on hand-made forwards, on real models' traces, and in the figures a plan reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.api.prepare import prepare
from autoplan.settings import EstimateSettings
from cost_models.allocator_margin import NATIVE, native_margin, needed_of_parts, point_margin
from cost_models.records import ModelTrace, OpRecord
from cost_models.stranding import forward_events, forward_stranding

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
NATIVE_CONF = "expandable_segments:False"


def _trace(blocks: int, transient: int, saved: int) -> ModelTrace:
    """`blocks` blocks of three ops: `up` makes a transient of `transient` bytes that `mid` reads, `mid` a 2 MiB one
    that `down` reads, and `down` a storage of `saved` bytes that it saves for the backward (made once the
    transient is freed, as a layer's next saved tensor is)."""
    ops, reads, producer, saved_storages = [], {}, {}, {}
    for block in range(blocks):
        up, mid, down = f"up_{block}", f"mid_{block}", f"down_{block}"
        ops += [OpRecord(up, "Linear", "", (), "bf16", is_matmul=True), OpRecord(mid, "silu", "", (), "bf16"),
                OpRecord(down, "mul", "", (), "bf16")]
        producer.update({3 * block: up, 3 * block + 1: mid, 3 * block + 2: down})
        reads[mid], reads[down] = [(3 * block, transient)], [(3 * block + 1, 2 * MiB)]
        saved_storages[3 * block + 2] = (saved, down)
    return ModelTrace(graph=None, ops=ops, micro_batch_size=1, seq_len=1, dtype="bf16", input_storages=reads,
                      storage_producer=producer, saved_storages=saved_storages)


def test_the_forward_allocates_each_storage_where_it_is_made_and_frees_it_after_its_last_reader():
    events = forward_events(_trace(2, 86 * MiB, 64 * MiB), micro_batch=2, mode="none")
    assert events[:6] == [("alloc", 0, 172 * MiB, 0), ("alloc", 1, 4 * MiB, 0), ("free", 0),
                          ("alloc", 2, 128 * MiB, 0), ("free", 1), ("alloc", 3, 172 * MiB, 0)]
    assert ("free", 2) not in events and ("free", 5) not in events  # saved: kept for the backward
    # selectively checkpointed, a mul's saved output is recomputed: freed once made (read by nothing in the forward)
    selective = forward_events(_trace(1, 86 * MiB, 64 * MiB), micro_batch=1, mode="selective")
    assert selective[-2:] == [("free", 1), ("free", 2)]
    assert forward_events(_trace(2, MiB, MiB), 1, "none") == [("alloc", 1, 2 * MiB, 0), ("free", 1),
                                                              ("alloc", 4, 2 * MiB, 0), ("free", 4)]  # small: slack's
    with pytest.raises(ValueError, match="unknown mode"):
        forward_events(_trace(1, 2 * MiB, 2 * MiB), 1, "full")


def test_blocks_whose_saved_tensors_fill_a_transients_segment_in_part_strand_more():
    """86 MiB transients freed before each 64 MiB saved tensor: the next saved tensor lands in the freed segment and
    strands 22 MiB there (llama2-7b's MLP at 4096 tokens); saved tensors the transient's size strand nothing."""
    strands = forward_stranding(_trace(8, 86 * MiB, 64 * MiB), 1)
    assert strands > 0.2
    assert forward_stranding(_trace(8, 64 * MiB, 64 * MiB), 1) == 0
    assert native_margin(strands).weights["activations"] > native_margin(0.0).weights["activations"]


def test_a_trace_without_storages_keeps_the_bound_that_needs_none():
    bare = ModelTrace(graph=None, ops=[], micro_batch_size=1, seq_len=1, dtype="bf16")
    assert forward_stranding(bare, 1) is None
    assert native_margin(None) is NATIVE and point_margin(NATIVE_CONF) is NATIVE


def _estimate_and_stranding(model: str, checkpoint: str = "none"):
    """`autoplan estimate --json` of every unit sharded in one checkpoint mode (natively), its timeline, and what its
    model strands (cost_models.stranding)."""
    done = subprocess.run([sys.executable, "-m", "autoplan", "estimate", "--model", model, "--seq-len", "1024",
                           "--gpus", "8", "--profile", "h100-sxm-80gb", "--strategy", "shard", "--checkpoint",
                           checkpoint, "--allocator-conf", NATIVE_CONF, "--json"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    assert done.returncode == 0, done.stderr
    est = json.loads(done.stdout)
    timeline = [{k.removesuffix("_bytes"): v for k, v in p["breakdown"].items()} for p in est["predicted"]["timeline"]]
    settings = EstimateSettings(model=model, seq_len=1024, gpus=8, profile="h100-sxm-80gb")
    return est["predicted"], timeline, forward_stranding(prepare(settings).tables.trace_1,
                                                         est["training"]["micro_batch_size"])


def _at(strands: float, mode: str):
    """native_margin(strands) with every activation weighted as `mode`'s."""
    margin = native_margin(strands)
    return replace(margin, weights=dict(margin.weights, activations=margin.by_mode[mode]), by_mode=None)


def test_a_model_whose_blocks_strand_more_is_given_a_larger_native_bound():
    """llama2-7b's MLP (11008 wide) leaves segments its saved tensors fill in part, llama3-8b's (14336) much less:
    the simulation of each forward tells them apart, and the needed figure a plan reports weights its activations
    by its own model's (the same timeline with llama3-8b's stranding would need less). Without checkpointing every
    activation is weighted as that mode's."""
    llama2, llama2_timeline, llama2_strands = _estimate_and_stranding("llama2-7b[n_layers=4]")
    llama3, llama3_timeline, llama3_strands = _estimate_and_stranding("llama3-8b[n_layers=4]")
    assert llama2_strands > llama3_strands + 0.1
    for predicted, timeline, strands in ((llama2, llama2_timeline, llama2_strands),
                                         (llama3, llama3_timeline, llama3_strands)):
        # each option's weighted bytes rounded up: a byte or so per segment
        assert predicted["needed_bytes"] == pytest.approx(
            needed_of_parts(timeline, NATIVE_CONF, margin=_at(strands, "nothing")), abs=1024)
        assert predicted["needed_bytes"] > predicted["peak_mem_bytes"]
    with_llama3s = needed_of_parts(llama2_timeline, NATIVE_CONF, margin=_at(llama3_strands, "nothing"))
    assert llama2["needed_bytes"] > with_llama3s


def test_each_checkpoint_modes_activations_are_weighted_by_what_that_mode_strands():
    """Fully checkpointed blocks keep their inputs alone and strand less per byte than selective ones on a model
    whose blocks strand (allocator_margin.BY_MODE): the plan's needed figure weights each unit's activations by
    its own mode's weight (the root, not checkpointed, by that mode's), under the figure that weights them all as
    the heaviest mode's and over the one that weights them all as full checkpointing's."""
    predicted, timeline, strands = _estimate_and_stranding("llama2-7b[n_layers=4]", "full")
    margin = native_margin(strands)
    assert margin.by_mode["all"] < margin.by_mode["cheap"] < margin.by_mode["nothing"] == margin.weights["activations"]
    heaviest = needed_of_parts(timeline, NATIVE_CONF, margin=margin)
    assert needed_of_parts(timeline, NATIVE_CONF, margin=_at(strands, "all")) <= predicted["needed_bytes"] < heaviest
