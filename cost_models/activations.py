"""What a unit's activations cost: the bytes a checkpointed unit keeps, and each segment's backward
simulated op by op (saved activations freed as their op's backward runs, gradients in flight, the
parameter gradients computed so far, and a checkpointed unit's recomputation).

The cost table (`table.py`) reads these per unit and option; they need only the traced ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.op_index import OpIndex
from cost_models.options import SAVED_BY_SELECTIVE_KINDS, Recompute
from cost_models.records import LOSS_NODE, ModelTrace, OpRecord, Unit

__all__ = ["BackwardPeak", "Segment", "activation_keep_bytes", "backward_keep_bytes", "checkpoint_keeps", "kept_saved_bytes",
           "backward_points", "backward_peak", "kept_outputs", "loss_kept_bytes", "loss_reads_key", "saved_by_selective"]


@dataclass(frozen=True)
class BackwardPeak:
    """What a segment's backward holds at its peak beyond the rest of the timeline (see backward_peak)."""

    activations: int  # its saved (or recomputed) activations not consumed yet
    temporaries: int  # gradients in flight and its unit's parameter gradients computed so far

    @property
    def total(self) -> int:
        return self.activations + self.temporaries


@dataclass
class Segment:
    """A maximal run of consecutive ops owned by one unit (a unit nested around others has several)."""

    unit: int
    first_op: int
    last_op: int
    saved_bytes: int
    fwd_temp_bytes: int
    bwd_peak: BackwardPeak = BackwardPeak(0, 0)  # its unit not checkpointed
    bwd_peak_checkpointed: BackwardPeak = BackwardPeak(0, 0)  # fully checkpointed
    bwd_peak_selective: BackwardPeak = BackwardPeak(0, 0)  # selectively checkpointed
    bwd_peak_alternate: BackwardPeak = BackwardPeak(0, 0)  # checkpointed keeping every other matmul's output
    # parameter gradients that the units around its unit have computed when its backward runs
    outer_grad_bytes: int = 0
    outside_model: bool = False  # the loss, computed on the model's output (it is the root's op)


def saved_by_selective(op: OpRecord) -> bool:
    """Whether selective checkpointing keeps this op's outputs (matmuls and attention; the rest is
    recomputed): the trace-side twin of the aten ops apply's policy saves (options.SAVED_BY_SELECTIVE_ATEN)."""
    return op.is_matmul or op.kind in SAVED_BY_SELECTIVE_KINDS


def kept_outputs(ops: list[OpRecord], recompute: Recompute) -> set[str]:
    """The names of a unit's ops (in forward order) whose outputs its checkpoint mode keeps: under CHEAP every
    matmul's and attention's; under ALTERNATE attention's and every other matmul's, the 1st, 3rd, ... as
    torchtitan's policy counts the region's matmuls (apply's run/ac.py counts the same, its aten matmuls);
    none otherwise."""
    if recompute is Recompute.CHEAP:
        return {op.name for op in ops if saved_by_selective(op)}
    if recompute is Recompute.ALTERNATE:
        matmuls = [op.name for op in ops if op.is_matmul and op.kind not in SAVED_BY_SELECTIVE_KINDS]
        return {op.name for op in ops if op.kind in SAVED_BY_SELECTIVE_KINDS} | set(matmuls[::2])
    return set()


@dataclass
class _TraceIndex:
    """What the per-unit functions below look up in the whole trace, indexed once per call over all units: a
    scan of every storage per unit made them quadratic in the number of blocks (1000 layers: 47 s)."""

    sizes: dict[int, int]  # bytes of every storage an op read or saved
    produced: dict[str, list[int]]  # op -> the storages it produced
    savers: set[str]  # ops that saved a storage first


def _index(trace: ModelTrace) -> _TraceIndex:
    sizes = {storage: nbytes for storage, (nbytes, _) in trace.saved_storages.items()}
    for storages in trace.input_storages.values():
        for storage, nbytes in storages:
            sizes.setdefault(storage, nbytes)
    produced: dict[str, list[int]] = {}
    for storage, producer in trace.storage_producer.items():
        produced.setdefault(producer, []).append(storage)
    return _TraceIndex(sizes, produced, {name for _, name in trace.saved_storages.values()})


def _kept_inputs(trace: ModelTrace, unit: Unit, recompute: Recompute = Recompute.ALL,
                 index: _TraceIndex | None = None) -> dict[int, tuple[int, str | None]]:
    """What a checkpointed unit keeps: its inputs produced outside it, unless saved elsewhere already;
    selectively checkpointed (Recompute.CHEAP, ALTERNATE), also the outputs of the ops its mode keeps
    (kept_outputs) that another op reads or saves. Storage -> (bytes, the unit's op that saved it first, if one did)."""
    owned = set(unit.ops)
    keep: dict[int, tuple[int, str | None]] = {}
    for name in unit.ops:
        for storage, nbytes in trace.input_storages.get(name, []):
            producer = trace.storage_producer.get(storage)
            if producer is None or producer in owned:
                continue  # parameters, buffers, placeholders, or produced inside the unit
            saver = trace.saved_storages.get(storage)
            if saver is not None and saver[1] not in owned:
                continue  # already kept alive by an op outside this unit
            keep[storage] = (nbytes, saver[1] if saver is not None else None)
    if recompute.keeps_outputs:
        index = index if index is not None else _index(trace)
        kept_ops = kept_outputs([trace.op(name) for name in unit.ops], recompute)
        for name in unit.ops:
            if name not in kept_ops:
                continue
            for storage in index.produced.get(name, ()):
                if storage in index.sizes and storage not in keep:
                    saver = trace.saved_storages.get(storage)
                    if saver is not None and saver[1] not in owned:
                        continue
                    keep[storage] = (index.sizes[storage], saver[1] if saver is not None else None)
    return keep


def activation_keep_bytes(trace: ModelTrace, units: list[Unit], recompute: Recompute = Recompute.ALL) -> list[int]:
    """Per unit, the bytes it keeps from its forward to its backward when checkpointed this way."""
    return checkpoint_keeps(trace, units, (recompute,))[recompute][0]


def _kept_through_backward(trace: ModelTrace, unit: Unit, recompute: Recompute, index: _TraceIndex | None,
                           kept: dict[int, tuple[int, str | None]] | None = None) -> dict[int, tuple[int, str | None]]:
    """Of what the checkpointed unit keeps, what is still held once its backward has recomputed its forward.
    Fully checkpointed: all of it (its inputs). Selectively: its inputs, and the kept matmul and attention
    outputs the recomputation never reaches. torch's selective checkpoint holds those outputs in a cache
    that the recomputation empties as it replays each op; a replayed output then lives only as long as an
    op of the unit saves it (the backward simulation counts it there, as a recomputed activation). The
    replay stops at the unit's last op that saves a tensor for backward, which saves its inputs before it
    runs, so the outputs of that op and the ops after it stay in the cache (a Llama block: its down
    projection's output; measured with autoplan.memtrack at 16k tokens, where q/k/v/o were freed)."""
    kept = kept if kept is not None else _kept_inputs(trace, unit, recompute, index)
    if not recompute.keeps_outputs:
        return kept
    owned = set(unit.ops)
    savers = (index.savers if index is not None else _index(trace).savers) & owned
    order = {name: position for position, name in enumerate(unit.ops)}
    last_saver = max((order[name] for name in savers), default=-1)
    return {storage: entry for storage, entry in kept.items()
            if trace.storage_producer.get(storage) not in owned or order[trace.storage_producer[storage]] >= last_saver}


def backward_keep_bytes(trace: ModelTrace, units: list[Unit], recompute: Recompute = Recompute.ALL) -> list[int]:
    """Per unit, the kept bytes (activation_keep_bytes) still held after its backward's recomputation."""
    return checkpoint_keeps(trace, units, (recompute,))[recompute][1]


def loss_reads_key(producer: str) -> str:
    """kept_saved_bytes' key for the bytes of `producer`'s kept outputs that the loss reads."""
    return f"{LOSS_NODE} reads {producer}"


def kept_saved_bytes(trace: ModelTrace, units: list[Unit], recompute: Recompute = Recompute.ALL) -> dict[str, int]:
    """Per op, the bytes it saved first that its checkpointed unit keeps anyway (an input, e.g. a
    block's first norm saves the block's input; selectively, a matmul output the next op saves):
    counted in the unit's kept bytes, not recomputed.
    Under `loss_reads_key(op)`, the bytes of the op's outputs that its checkpointed unit keeps and the
    loss reads without anything saving them (selectively, the head's logits): the loss's forward counts
    its unsaved inputs among its transients (fwd_transient_bytes), and the unit's kept bytes count them
    already, so the cost table takes them off the loss's forward where that unit keeps them. They travel
    in this map, keyed by their producer, so that every caller extrapolating it carries them."""
    return checkpoint_keeps(trace, units, (recompute,))[recompute][2]


def checkpoint_keeps(trace: ModelTrace, units: list[Unit], modes: tuple[Recompute, ...] = (Recompute.ALL,)
                     ) -> dict[Recompute, tuple[list[int], list[int], dict[str, int]]]:
    """Per way of checkpointing, activation_keep_bytes, backward_keep_bytes and kept_saved_bytes at once: what each
    unit keeps is found once and the trace indexed once (the three apart found it four times per unit and mode,
    and indexed the trace each time)."""
    index = _index(trace)
    return {mode: _keeps(trace, units, mode, index) for mode in modes}


def _keeps(trace: ModelTrace, units: list[Unit], recompute: Recompute,
           index: _TraceIndex) -> tuple[list[int], list[int], dict[str, int]]:
    kept_inputs = [_kept_inputs(trace, unit, recompute, index) for unit in units]
    through = [_kept_through_backward(trace, unit, recompute, index, keep) for unit, keep in zip(units, kept_inputs)]
    kept: dict[str, int] = {}
    for held in through:  # a selectively kept output the recomputation replays is saved (and counted) as recomputed
        for nbytes, saver in held.values():
            if saver is not None:
                kept[saver] = kept.get(saver, 0) + nbytes
    loss_inputs = [storage for storage, _ in trace.input_storages.get(LOSS_NODE, [])
                   if storage not in trace.saved_storages]
    if loss_inputs:
        for unit, keep in zip(units, kept_inputs):
            owned = set(unit.ops)
            for storage in loss_inputs:
                producer = trace.storage_producer.get(storage)
                if storage in keep and producer in owned:
                    key = loss_reads_key(producer)
                    kept[key] = kept.get(key, 0) + keep[storage][0]
    return ([sum(nbytes for nbytes, _ in keep.values()) for keep in kept_inputs],
            [sum(nbytes for nbytes, _ in held.values()) for held in through], kept)


def loss_kept_bytes(ops: list[OpRecord], index: OpIndex,
                    kept_saved: dict[Recompute, dict[str, int]]) -> dict[tuple[int, Recompute], int]:
    """Per (unit, way of checkpointing), how much of the loss's forward temporaries the unit keeps already.
    The loss's forward counts its inputs that nothing saves among its transients (the logits); where the
    unit that produced one keeps it (a selectively checkpointed head keeps its matmul output), the unit's
    kept bytes count it too. kept_saved carries the bytes of each producer's kept outputs the loss reads
    (see kept_saved_bytes), taken as at most the producer's output as `ops` have it (a vocabulary-parallel
    head's 1/t). The loss's largest allocation stays. Several units' shares are each taken off the same
    transient (a lower bound then; one producer, the head, in the models seen). `index`: where the ops are
    (cost_models.op_index)."""
    if index.loss is None:
        return {}
    loss, prefix = ops[index.loss], loss_reads_key("")
    temp = max(loss.fwd_max_alloc_bytes, loss.fwd_transient_bytes)
    out: dict[tuple[int, Recompute], int] = {}
    for recompute, entries in kept_saved.items():
        for key, nbytes in entries.items():
            producer = index.position.get(key[len(prefix):]) if key.startswith(prefix) else None
            if producer is not None:
                read = min(nbytes, ops[producer].out_bytes)
                where = (index.owners[producer], recompute)
                out[where] = out.get(where, 0) + temp - max(loss.fwd_max_alloc_bytes, loss.fwd_transient_bytes - read)
    return out


def backward_points(ops: list[OpRecord], owners: list[int], seg: Segment, checkpointed: bool,
                    kept_saved: dict[str, int] | None = None,
                    positions: list[int] | None = None) -> list[tuple[str, BackwardPeak]]:
    """The backward of a segment, op by op in reverse order. While op j's backward runs it holds:
    - the activations saved by the segment's ops up to j (an op's are freed once its backward ran;
      a storage that several ops saved counts for the first, see trace.saved_tensor_recorder);
    - the backward's own storages alive then, at their most during j (op.bwd_live_bytes: the gradient
      coming in, those going out, temporaries; traced);
    - the parameter gradients its unit has computed so far, unsharded (in later segments and j..last).
    Activations of earlier segments are the timeline's. Checkpointed, the unit's saved activations
    are recomputed when its backward first needs one, in the backward of its last op that saved
    any: the recomputation's forward (saved activations so far plus the op's transients, as in the
    forward) runs then, with that op's incoming gradients alive; and the activations of the unit's
    earlier segments are recomputed ones, alive through this segment; what the unit keeps from the
    forward (kept_saved, see kept_saved_bytes) is the timeline's. Labelled by op name. `positions`: where
    the unit's ops are in `ops` (found in `owners` when not given; a table passes them, or a deep model
    costs a scan of every op per segment)."""
    unit = seg.unit
    positions = positions if positions is not None else [p for p, u in enumerate(owners) if u == unit]
    span = range(seg.first_op, seg.last_op + 1)
    kept_saved = kept_saved if checkpointed and kept_saved else {}

    def saved(op: OpRecord) -> int:
        return op.saved_bytes - kept_saved.get(op.name, 0)

    grads_after = {}  # the unit's parameter gradients computed by the ops after each (its backward ran)
    grads = sum(ops[p].param_grad_bytes for p in positions if p > seg.last_op)
    for position in reversed(span):
        grads_after[position] = grads
        grads += ops[position].param_grad_bytes
    saved_upto = {}  # saved by the segment's ops up to and including each (and by earlier segments when recomputed)
    running = sum(saved(ops[p]) for p in positions if p < seg.first_op) if checkpointed else 0
    for position in span:
        running += saved(ops[position])
        saved_upto[position] = running
    points = [(ops[p].name, BackwardPeak(saved_upto[p], ops[p].bwd_live_bytes + ops[p].param_grad_bytes
                                         + grads_after[p])) for p in reversed(span)]
    last_saver = max((p for p in positions if ops[p].saved_bytes), default=None)
    if checkpointed and last_saver in span:
        held = ops[last_saver].bwd_in_bytes + grads_after[last_saver]
        points += [(f"recompute {ops[p].name}", BackwardPeak(
            saved_upto[p], held + max(ops[p].fwd_max_alloc_bytes, ops[p].fwd_transient_bytes)))
            for p in span if p <= last_saver]
    return points


def backward_peak(ops: list[OpRecord], owners: list[int], seg: Segment, checkpointed: bool,
                  kept_saved: dict[str, int] | None = None, positions: list[int] | None = None) -> BackwardPeak:
    """The most the segment's backward holds (see backward_points)."""
    return max((point for _, point in backward_points(ops, owners, seg, checkpointed, kept_saved, positions)),
               key=lambda point: point.total, default=BackwardPeak(0, 0))
