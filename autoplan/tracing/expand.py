"""The trace of a model whose blocks repeat, from the trace of the model cut to a few periods of them.

`expand` takes the trace of the model truncated to `periods` periods of blocks (see reuse) and gives
the trace of the model with `total` periods: what runs before the blocks, the first period and the
last, and what runs after the blocks are the short trace's own; its middle (second) period is copied
into every middle period. A copy is renamed as a trace of the whole model would name it:
- module paths move by the period's blocks (`layers.1.mlp` -> `layers.7.mlp`);
- op names follow the tracer's numbering: the dispatch tracer numbers calls across the model
  (`linear_57`), so a copy's numbers move by the calls of one period; torch.fx numbers each function
  on its own (`add`, `add_1`, ...), so they move by that function's calls in one period, and a module
  call is named by its path (`transformer_h_3_ln_1`);
- storages (what ops read, produce and save) are new ones, numbered from -1 down; a storage that an
  op reads from an earlier period is that period's copy; one no op produced (a model input, a shared
  buffer) is shared, unless a single period reads it (each period's own empty KV cache); a block's
  parameters and buffers are that block's.
Anything that does not fit this shape raises Mismatch, and the whole model is traced instead.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from cost_models.records import LOSS_NODE, GraphEdges, ModelTrace, OpRecord

__all__ = ["Mismatch", "Repeats", "block_of", "expand"]


class Mismatch(Exception):
    """The short traces do not fit the pattern; the whole model is traced instead."""


@dataclass(frozen=True)
class Repeats:
    path: str  # the ModuleList of blocks
    count: int  # blocks in the model
    period: int  # blocks per period: their signatures repeat with it

    @property
    def periods(self) -> int:
        return self.count // self.period


def block_of(module: str, prefix: str) -> int | None:
    """The index of the block (under `prefix`, the blocks' path and a dot) that `module` is in."""
    if not module.startswith(prefix):
        return None
    head = module[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _layout(ops: list[OpRecord], repeats: Repeats, periods: int) -> list[int]:
    """Each op's segment: -1 before the blocks, the period it runs in (with the ops between its blocks and
    the next period's), `periods` after the last block."""
    blocks = [block_of(op.module, repeats.path + ".") for op in ops]
    last = max((i for i, block in enumerate(blocks) if block is not None), default=None)
    if last is None:
        raise Mismatch("no op runs in the blocks")
    homes, current = [], -1
    for index, block in enumerate(blocks):
        if block is not None:
            if block >= periods * repeats.period or block // repeats.period < current:
                raise Mismatch(f"block {block} runs out of order")
            current = block // repeats.period
        homes.append(periods if index > last else current)
    if set(homes) != set(range(-1, periods + 1)):
        raise Mismatch("a period runs no op")
    return homes


_NUMBERED = re.compile(r"^(.*)_(\d+)$")


def _number(name: str) -> tuple[str, int]:
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _snake(path: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]+", "_", path)


def _name_parts(op: OpRecord, block: int | None, tracer: str, step: int | Counter, repeats: Repeats):
    """(head, number, step, tail): the op's name `shift` periods later is head + (number + shift * step)
    + tail; None when it stays."""
    if op.name == LOSS_NODE:
        return None
    if tracer == "dispatch":
        kind, number = _number(op.name)
        return (kind + "_", number, step, "")
    if block is not None:
        own = _snake(f"{repeats.path}.{block}.")
        if op.name.startswith(own):
            return (_snake(f"{repeats.path}."), block, repeats.period, op.name[len(own) - 1:])
    base, number = _number(op.name)
    return (base + "_", number, step[base], "") if step[base] else None


@dataclass
class _Template:
    """One op of the short trace, ready to be copied `shift` periods later."""

    op: OpRecord
    position: int  # in its segment
    name_parts: tuple | None
    module_parts: tuple[str, int, str] | None  # blocks' path and dot, block, the rest of the module path
    inputs: list[tuple[tuple, int]]  # (storage, bytes); a storage is (kind, index, a, b, how far a shift moves index)
    produced: list[tuple]
    saved: list[tuple[tuple, int]]
    sources: list[tuple[int, int, int]]  # edges in: (segment, moves with a shift: 0 or 1, position)
    sinks_after: list[int]  # edges out to what runs after the blocks (positions there)


def _storage_ids(trace: ModelTrace, homes: list[int], positions: list[int], produced: dict[str, list[int]],
                 saved_by: dict[str, list[int]], tensors: dict[int, tuple[int, str]], period: int) -> dict[int, tuple]:
    """Template storage key -> (kind, index, a, b, how far a shift of one period moves index)."""
    index_of = {op.name: i for i, op in enumerate(trace.ops)}
    ids = {}
    for name, keys in produced.items():
        i = index_of[name]
        for ordinal, key in enumerate(keys):
            ids[key] = ("op", homes[i], positions[i], ordinal, int(homes[i] >= 0))
    for key, (block, tensor_name) in tensors.items():
        ids.setdefault(key, ("tensor", block, tensor_name, 0, period))
    readers: dict[int, set[int]] = {}
    read = [(name, key) for name, storages in trace.input_storages.items() for key, _nbytes in storages]
    for name, key in read + [(name, key) for name, keys in saved_by.items() for key in keys]:
        readers.setdefault(key, set()).add(homes[index_of[name]])
    for key, homes_reading in readers.items():
        if key not in ids:
            home = min(homes_reading)
            ids[key] = ("op", home, -1, key, 1) if len(homes_reading) == 1 and home >= 0 else ("ext", key, 0, 0, 0)
    return ids


def _templates(trace: ModelTrace, repeats: Repeats, periods: int, tracer: str, tensors) -> dict[int, list[_Template]]:
    """The short trace's ops by segment (-1 before the blocks, a period, `periods` after the blocks)."""
    ops = trace.ops
    homes = _layout(ops, repeats, periods)
    positions, seen = [], Counter()
    for home in homes:
        positions.append(seen[home])
        seen[home] += 1
    if tracer == "dispatch":
        first_of = {home: _number(op.name)[1] for op, home in reversed(list(zip(ops, homes)))}
        step = first_of[2] - first_of[1]  # calls in one middle period
    else:
        step = Counter(_number(op.name)[0] for op, home in zip(ops, homes) if home == 1)
    produced: dict[str, list[int]] = {}
    for key, name in trace.storage_producer.items():
        produced.setdefault(name, []).append(key)
    saved_by: dict[str, list[int]] = {}
    for key, (_nbytes, name) in trace.saved_storages.items():
        saved_by.setdefault(name, []).append(key)
    ids = _storage_ids(trace, homes, positions, produced, saved_by, tensors, repeats.period)
    index_of = {op.name: i for i, op in enumerate(ops)}
    predecessors, successors = trace.adjacency()
    segments: dict[int, list[_Template]] = {}
    for i, op in enumerate(ops):
        block = block_of(op.module, repeats.path + ".")
        module_parts = None
        if block is not None:
            own = f"{repeats.path}.{block}"
            module_parts = (repeats.path + ".", block, op.module[len(own):])
        sources, sinks_after = [], []
        for source in predecessors[op.name]:
            j = index_of[source]
            if not (0 <= homes[j] < periods and homes[i] == periods):  # those come with the period's copies
                sources.append((homes[j], int(homes[j] >= 0), positions[j]))
        if 0 <= homes[i] < periods:
            sinks_after = [positions[j] for j in map(index_of.get, successors[op.name])
                           if homes[j] == periods]
        segments.setdefault(homes[i], []).append(_Template(
            op, positions[i], _name_parts(op, block, tracer, step, repeats), module_parts,
            [(ids[key], nbytes) for key, nbytes in trace.input_storages.get(op.name, [])],
            [ids[key] for key in produced.get(op.name, [])],
            [(ids[key], trace.saved_storages[key][0]) for key in saved_by.get(op.name, [])],
            sources, sinks_after))
    return segments


def expand(trace: ModelTrace, repeats: Repeats, periods: int, total: int, tracer: str,
           tensors: dict[int, tuple[int, str]]) -> ModelTrace:
    """`trace`, of the model truncated to `periods` periods of blocks (at least 3), as the trace of the
    model with `total` periods. `tensors` are the blocks' parameters and buffers (reuse.block_tensors)
    of the truncated model it ran. Raises Mismatch when the trace does not have that shape."""
    segments = _templates(trace, repeats, periods, tracer, tensors)
    copies = [(-1, -1), (0, 0)] + [(j, 1) for j in range(1, total - 1)] + [(total - 1, periods - 1), (total, periods)]
    whole = _Copies(repeats, total)
    for target, template in copies:
        shift = target - template if template >= 0 else 0
        for t in segments[template]:
            whole.add(t, target, shift)
    graph = whole.graph()
    _check_storages(whole.keys, segments, dict(copies), repeats)
    return ModelTrace(graph=graph, ops=whole.ops, micro_batch_size=trace.micro_batch_size, seq_len=trace.seq_len,
                      dtype=trace.dtype, input_storages=whole.inputs, storage_producer=whole.producers,
                      saved_storages=whole.saved)


class _Copies:
    """The whole model's ops, storages and edges, as the short trace's templates are copied into each segment."""

    def __init__(self, repeats: Repeats, total: int):
        self.repeats, self.total = repeats, total
        self.ops: list[OpRecord] = []
        self.op_name: dict[tuple[int, int], str] = {}  # (segment, position) in the whole model -> op name
        self.inputs, self.producers, self.saved, self.keys = {}, {}, {}, {}
        self.edges: list[tuple] = []

    def key_of(self, sid: tuple, shift: int) -> int:
        """The whole model's storage key of template storage `sid` copied `shift` periods on (from -1 down)."""
        if sid[0] == "ext":
            return sid[1]
        moved = (sid[0], sid[1] + shift * sid[4], sid[2], sid[3])
        key = self.keys.get(moved)
        if key is None:
            key = self.keys[moved] = -1 - len(self.keys)
        return key

    def add(self, t: _Template, target: int, shift: int) -> None:
        """A copy of template `t` in segment `target`, `shift` periods after its own, renamed as the whole
        model's trace would name it."""
        record = object.__new__(OpRecord)  # a copy; copy.copy is 10x slower on a dataclass
        record.__dict__.update(t.op.__dict__)
        if shift and t.name_parts is not None:
            head, number, step, tail = t.name_parts
            record.name = f"{head}{number + shift * step}{tail}"
        if shift and t.module_parts is not None:
            prefix, block, rest = t.module_parts
            record.module = f"{prefix}{block + shift * self.repeats.period}{rest}"
        name = record.name
        self.ops.append(record)
        self.op_name[(target, t.position)] = name
        self.inputs[name] = [(self.key_of(sid, shift), nbytes) for sid, nbytes in t.inputs]
        for sid in t.produced:
            self.producers[self.key_of(sid, shift)] = name
        for sid, nbytes in t.saved:
            self.saved.setdefault(self.key_of(sid, shift), (nbytes, name))
        self.edges.extend(((home + shift * moves, position), name) for home, moves, position in t.sources)
        self.edges.extend((name, (self.total, position)) for position in t.sinks_after)

    def graph(self) -> GraphEdges:
        """The copies' graph, unbuilt (ModelTrace builds it when it is read); Mismatch where renamed ops collide
        or an edge leads to an op not copied."""
        ops = self.ops
        if len({record.name for record in ops}) != len(ops):
            raise Mismatch("renamed ops collide")
        op_name = self.op_name
        try:
            edges = [(op_name[a] if isinstance(a, tuple) else a, op_name[b] if isinstance(b, tuple) else b)
                     for a, b in self.edges]
        except KeyError as exc:
            raise Mismatch(f"an edge leads to op {exc} that the whole model does not have") from None
        return GraphEdges(((record.name, record) for record in ops), edges)


def _check_storages(keys: dict[tuple, int], segments: dict[int, list[_Template]], templates: dict[int, int],
                    repeats: Repeats) -> None:
    """Mismatch where a copied storage is one the whole model does not have: a block past its last, or an
    output its producing op does not make."""
    for sid in keys:
        if sid[0] == "tensor" and not 0 <= sid[1] < repeats.count:
            raise Mismatch(f"an op reads block {sid[1]}'s {sid[2]}, which the model does not have")
        if sid[0] == "op" and sid[2] >= 0:
            members = segments.get(templates.get(sid[1], -2), [])
            if sid[2] >= len(members) or sid[3] >= len(members[sid[2]].produced):
                raise Mismatch("an op reads a storage that the op it would come from does not produce")
