"""How much a model's own tensor sizes strand in the native caching allocator: a coefficient per model trace and
micro-batch, from a small allocator simulation of its forward.

Why: natively, what a step needs beyond its live bytes is free space inside segments a live block keeps, and
which block lands in which cached segment follows the tensors' sizes, not the bytes of a memory category.
llama2-7b's MLP (11008 wide: 86 MiB bf16 blocks at 4096 tokens) leaves segments that its 64 MiB fp32 and 32 MiB
bf16 saved tensors fill only in part; llama3-8b's (14336 wide: 224 MiB) holds three of its 64 MiB blocks and
more; gpt2-1.5b's 50 MiB MLP blocks hold four of its 12.5 MiB ones. One weight per category had to cover the
first, so it over-bounded the others by 7-10 points of the limit (benchmarks/RESULTS.md section 11b, "Why
category weights stop short natively"). The trace records every storage an op makes, the ops that read it and
whether it is saved for the backward, so the forward can be replayed here as the allocator would see it: each
storage allocated where its op runs, freed after its last reader unless saved. Without checkpointing (every
saved storage kept) and selectively checkpointed (those that matmuls and attention save), how much the
simulation's smallest limit less its allocated peak grows from the first half of the forward to the whole, per
byte its live peak grows by, is how much the model's blocks strand; the larger of the two is the model's
coefficient (`forward_stranding`), which the native bound's weight of each checkpoint mode's activations (and of
the gathered parameters) follows (cost_models.allocator_margin.native_margin). Per mode the simulation is not the
weight: from an empty cache a forward without checkpointing frees nothing and strands nothing (llama2-7b 0.000,
selectively 0.151) while a step's forward lands its saved tensors in the previous backward's segments. The growth,
not the ratio at the end: what one block's transients hold (a 20 MiB segment for a 2 MiB request) is there at any
depth, and on a forward that keeps little (fully checkpointed blocks keep their inputs alone) it would be most of a
ratio that says nothing of the blocks.

With expandable segments the same simulation (cost_models.expandable_segments) of a selectively checkpointed
forward gives the coefficient of that bound's selective term (`expandable_margin`): llama2-7b's saved matmul
outputs leave 4.5% of their pages unused at 4096 tokens, llama3-8b's 1.2-1.9%, gpt2-1.5b's 0.7%.

Only requests above 1 MiB are simulated: the small pool's 2 MiB pages strand a few MiB in all, which the bound's
slack holds. A prefix of the forward (`MAX_OPS` ops: a dozen or more repeated blocks) is enough, the blocks being
alike, and keeps the simulation to a few tens of milliseconds per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cost_models.activations import saved_by_selective
from cost_models.allocator import SMALL_SIZE
from cost_models.allocator_replay import run_and_min_limit
from cost_models.records import LOSS_NODE, ModelTrace

__all__ = ["MAX_OPS", "MODES", "forward_events", "forward_stranding"]

MAX_OPS = 600  # the ops of the forward simulated (a prefix: the repeated blocks strand alike)
MODES = ("none", "selective")  # what the forward keeps: every saved storage, or those matmuls and attention save


def forward_events(trace: ModelTrace, micro_batch: int, mode: str, ops: int = MAX_OPS,
                   scale: Mapping[str, float] | None = None) -> list[tuple]:
    """The allocations and frees of the forward's first `ops` ops (at most MAX_OPS), in order
    (cost_models.allocator_replay's events): each storage the trace records at micro-batch 1, scaled to
    `micro_batch` and by `scale` of the op that makes it (op name -> a rank's share of its outputs: a
    tensor-parallel rank's), allocated by that op and freed after its last reader, unless `mode` keeps it for the
    backward (see MODES); requests of at most 1 MiB left out."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    events, live, scale = [], set(), scale or {}
    kept = ("none", "selective") if mode == "none" else ("selective",)  # what the mode keeps for the backward
    for name, made, read_last in _forward(trace)[:ops]:
        share = scale.get(name, 1.0)
        for key, nbytes, _ in made:
            scaled = nbytes * micro_batch * share
            if scaled > SMALL_SIZE:  # the small pool's 2 MiB pages: the bound's slack's
                events.append(("alloc", key, math.ceil(scaled), 0))
                live.add(key)
        for key, keeps in read_last:
            if key in live and keeps not in kept:
                events.append(("free", key))
                live.discard(key)
    return events


def _forward(trace: ModelTrace) -> list[tuple[str, list, list]]:
    """Per op of the forward (up to the loss, at most MAX_OPS): its name, the storages it makes (key, bytes at
    micro-batch 1, which modes keep it: "selective" for both, "none" for no checkpointing alone, "" for neither)
    and those it is the last to read (key, the same), a storage read by nothing last read where it is made. Found
    once per trace (the ops are not changed once traced)."""
    found = trace.__dict__.get("_forward_storages")
    if found is not None:
        return found
    by_name = {op.name: op for op in trace.ops}
    size, last_read = {}, {}
    for index, op in enumerate(trace.ops):
        for key, nbytes in trace.input_storages.get(op.name, []):
            size[key], last_read[key] = nbytes, index
    for key, (nbytes, _) in trace.saved_storages.items():
        size[key] = nbytes
    made: dict[str, list[int]] = {}
    for key, producer in trace.storage_producer.items():
        if size.get(key, 0) > 0:
            made.setdefault(producer, []).append(key)

    def keeps(key: int) -> str:
        saver = trace.saved_storages.get(key)
        if saver is None:
            return ""
        return "selective" if saver[1] not in by_name or saved_by_selective(by_name[saver[1]]) else "none"

    forward, read_at = [], {}
    for key, index in last_read.items():
        read_at.setdefault(index, []).append(key)
    for index, op in enumerate(trace.ops[:MAX_OPS]):
        if op.name == LOSS_NODE:
            break
        mine = [(key, size[key], keeps(key)) for key in made.get(op.name, [])]
        last = [(key, keeps(key)) for key in read_at.get(index, [])]
        last += [(key, kept) for key, _, kept in mine if key not in last_read]
        forward.append((op.name, mine, last))
    trace.__dict__["_forward_storages"] = forward
    return forward


def forward_stranding(trace: ModelTrace, micro_batch: int, expandable: bool = False,
                      scale: Mapping[str, float] | None = None) -> float | None:
    """What the model's tensor sizes strand per byte its forward keeps: the larger, over MODES, of how much the
    simulated forward's smallest limit less its allocated peak grows from the first half of its ops (at most
    MAX_OPS) to the whole, per byte its live peak grows by: the repeated blocks' stranding, without what one
    block's transients hold whatever the depth. `expandable`: with expandable segments, of selectively
    checkpointed blocks alone (what that bound's selective term weights), the whole simulated forward's smallest
    limit less its allocated peak per byte of its live peak (pages strand too little for a growth between two
    prefixes to measure); `scale`: as forward_events'. None where the trace records no storages (a trace made without
    them: the caller keeps the bound that needs none)."""
    if not trace.storage_producer or not trace.input_storages:
        return None
    ops, worst = len(_forward(trace)), 0.0
    if expandable:  # a selective forward keeps its matmuls' outputs: enough bytes for the ratio itself
        excess, live = _excess(forward_events(trace, micro_batch, "selective", ops, scale), expandable)
        return excess / live if live else 0.0
    for mode in MODES:
        (half_excess, half_live), (excess, live) = (
            _excess(forward_events(trace, micro_batch, mode, prefix, scale)) for prefix in (ops // 2, ops))
        if live > half_live:
            worst = max(worst, (excess - half_excess) / (live - half_live))
    return worst


def _excess(events: list[tuple], expandable: bool = False) -> tuple[int, int]:
    """The smallest limit `events` run in less their allocated peak, and their live peak (0, 0 for none). The limit
    is the bisection's (no grid above it): the bounds' coefficients were fitted to the simulation so measured."""
    if not events:
        return 0, 0
    run, needed = run_and_min_limit(events, expandable=expandable, above=0)  # the bisection's, as fitted
    return needed - run.peak_allocated, run.peak_requested
