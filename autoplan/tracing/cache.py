"""Traces on disk: a model read once is not read again by the next command.

Tracing is most of what `explain`, `diff`, `estimate --plan` and a repeated search spend (gpt2-1.5b: a
second or more of ops run on meta tensors, and torch's compiler stack imported to run them); the traces
depend only on the model, the tracer, the sequence length, the compute dtype, the inputs and the pricing
(attention kernel, device, experts' capacity factor). So a trace pair is kept in `$AUTOPLAN_CACHE_DIR/traces` (default ~/.cache/autoplan/traces, beside the profiler's
measurements), one JSON file per key, and read back instead of tracing.

The key is a hash of everything a trace depends on: the model's structure (every module's path, class and
plain attributes, a zoo or Hugging Face config, every parameter's and buffer's name, shape, dtype and
flags: more than the plan's fingerprint, which leaves out head counts and buffers), the source of the
model's classes and of autoplan's tracer, the torch and autoplan versions, the tracer asked for, the
sequence length, the dtype and the example inputs' shapes. An edit to the model's code or to the tracer is
a new key; an entry of another format, one that does not parse, or one whose recorded key differs is
ignored and written again. Entries are data (JSON: op records, the graph's edges, storages), never
pickles: reading one runs no code. `AUTOPLAN_TRACE_CACHE=off` turns the cache off.

A pair expanded from a few periods of blocks (reuse, tracer.BlockTraces) is kept as those periods' traces and
expanded again when read: reading and checking every block's ops of a 3000-layer stack (132,000 ops per trace)
took longer than tracing it, and the entry would hold megabytes where a few blocks' ops say the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoplan.fileio import write_text_atomic
from autoplan.tracing import reuse
from autoplan.tracing.expand import Mismatch, Repeats
from autoplan.tracing.tracer import BlockTraces, ExampleInputs, Pricing, TracePair, trace_pair
from autoplan.version import __version__
from cost_models.records import GraphEdges, ModelTrace, OpRecord

__all__ = ["CACHE_DIR_ENV", "CACHE_SWITCH_ENV", "MAX_ENTRIES", "cached_trace_pair", "trace_cache_dir"]

CACHE_DIR_ENV = "AUTOPLAN_CACHE_DIR"  # the profiler's measurements live there too (autoplan.profiling.cache)
CACHE_SWITCH_ENV = "AUTOPLAN_TRACE_CACHE"
FORMAT = 2  # 2: a pair expanded from a few blocks is kept as those blocks' traces
MAX_ENTRIES = 64  # the oldest go first beyond this: a large model's pair is a few MB
_OP_FIELDS = tuple(f.name for f in dataclasses.fields(OpRecord))
_PLAIN = (type(None), bool, int, float, str)


def trace_cache_dir() -> Path | None:
    """Where traces are kept; None when the cache is off."""
    if os.environ.get(CACHE_SWITCH_ENV, "").lower() in ("0", "off", "no", "false"):
        return None
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "autoplan") / "traces"


def cached_trace_pair(model: nn.Module, seq_len: int, dtype: str = "bf16", inputs: ExampleInputs | None = None,
                      tracer: str | None = None, pricing: Pricing | None = None) -> TracePair:
    """`trace_pair`'s traces, from the cache when it holds them, else traced and stored. A pair read back
    prices as `pricing` alone (it does not keep the attention calls that would let another device reuse it)."""
    pricing = pricing or Pricing()
    folder = trace_cache_dir()
    if folder is None:
        return trace_pair(model, seq_len, dtype, inputs, tracer, pricing)
    key = _key(model, seq_len, dtype, inputs, tracer, pricing)
    path = folder / f"{key}.json"
    pair = _read(path, key, pricing)
    if pair is None:
        pair = trace_pair(model, seq_len, dtype, inputs, tracer, pricing)
        _write(path, key, pair)
    return pair


# --------------------------------------------------------------------------- #
# The key
# --------------------------------------------------------------------------- #


def _key(model: nn.Module, seq_len: int, dtype: str, inputs: ExampleInputs | None, tracer: str | None,
         pricing: Pricing) -> str:
    material = {
        "format": FORMAT, "autoplan": __version__, "torch": torch.__version__, "tracer": tracer, "seq_len": seq_len,
        "dtype": dtype, "pricing": dataclasses.asdict(pricing), "inputs": _inputs_signature(inputs), "reuse_min_periods": reuse.REUSE_MIN_PERIODS,
        "model": _model_signature(model), "code": _code_signature(model),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _value(value: Any) -> Any:
    """A module attribute as the key holds it: plain values themselves, tensors by shape and dtype, other
    objects by their type (a config object is taken apart by `_config`)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return [_value(v) for v in value]
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return type(value).__qualname__


def _config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if hasattr(config, "to_json_string"):  # a Hugging Face config
        return config.to_json_string()
    return None


def _model_signature(model: nn.Module) -> list:
    rows = []
    for path, module in model.named_modules(remove_duplicate=False):
        attributes = sorted((name, _value(value)) for name, value in vars(module).items()
                            if not name.startswith("_") and not isinstance(value, nn.Module))
        rows.append([path, type(module).__module__, type(module).__qualname__, module.training, attributes,
                     len(module._forward_hooks), len(module._forward_pre_hooks), _config(module)])
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        rows.append([name, list(tensor.shape), str(tensor.dtype), tensor.requires_grad,
                     isinstance(tensor, nn.Parameter)])
    return rows


def _code_signature(model: nn.Module) -> str:
    """A hash of the source files of the model's classes and of the tracer (this package, the op records)."""
    files = {Path(__file__).parent / name for name in os.listdir(Path(__file__).parent) if name.endswith(".py")}
    files.add(Path(inspect.getfile(OpRecord)))
    for cls in {type(module) for module in model.modules()}:
        try:
            files.add(Path(inspect.getfile(cls)))
        except (TypeError, OSError):  # a class made at run time
            files.add(Path(f"<{cls.__module__}.{cls.__qualname__}>"))
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(str(file).encode())
        try:
            digest.update(file.read_bytes())
        except OSError:
            pass
    return digest.hexdigest()


def _inputs_signature(inputs: ExampleInputs | None) -> Any:
    if inputs is None:
        return None
    return [_value(list(inputs.args)), sorted((k, _value(v)) for k, v in inputs.kwargs.items())]


# --------------------------------------------------------------------------- #
# Entries: JSON
# --------------------------------------------------------------------------- #


def _trace_data(trace: ModelTrace) -> dict | None:
    nodes = []
    for name, attributes in trace.nodes():
        if set(attributes) - {"op"}:
            return None  # a graph of another kind than the tracers make: not cached
        nodes.append([name, "op" in attributes])
    return {
        "micro_batch_size": trace.micro_batch_size, "seq_len": trace.seq_len, "dtype": trace.dtype,
        "ops": [[getattr(op, f) for f in _OP_FIELDS] for op in trace.ops], "nodes": nodes,
        "edges": [list(edge) for edge in trace.edges()],
        "input_storages": {name: storages for name, storages in trace.input_storages.items()},
        "storage_producer": [[key, name] for key, name in trace.storage_producer.items()],
        "saved_storages": [[key, nbytes, name] for key, (nbytes, name) in trace.saved_storages.items()],
    }


def _trace_of(data: dict) -> ModelTrace:
    ops = []
    for row in data["ops"]:
        fields = dict(zip(_OP_FIELDS, row, strict=True))
        fields["input_shapes"] = tuple(tuple(shape) for shape in fields["input_shapes"])
        ops.append(OpRecord(**fields))
    by_name = {op.name: op for op in ops}
    graph = GraphEdges(((name, by_name[name] if has_op else None) for name, has_op in data["nodes"]),
                       (tuple(edge) for edge in data["edges"]))  # networkx's graph built only where it is read
    return ModelTrace(
        graph=graph, ops=ops, micro_batch_size=data["micro_batch_size"], seq_len=data["seq_len"], dtype=data["dtype"],
        input_storages={name: [tuple(s) for s in storages] for name, storages in data["input_storages"].items()},
        storage_producer={key: name for key, name in data["storage_producer"]},
        saved_storages={key: (nbytes, name) for key, nbytes, name in data["saved_storages"]},
    )


def _read(path: Path, key: str, pricing: Pricing) -> TracePair | None:
    """The entry at `path`, None when there is none or it is not one this autoplan wrote for `key`."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        pair = _pair_of(data, pricing)
        os.utime(path)  # recently used: the last to be pruned
        return pair
    except (OSError, ValueError, KeyError, TypeError, AttributeError, Mismatch):  # absent, damaged, of another shape
        return None


def _pair_of(data: dict, pricing: Pricing = Pricing()) -> TracePair:
    """The pair an entry holds: its traces, or the whole model's expanded from the few blocks' it holds."""
    tracer, reuse, traces, short = _stored(data)
    if short is None:
        return TracePair(tracer, *traces, reuse=reuse, pricing=pricing)
    return TracePair(tracer, *short.expanded(), reuse=reuse, pricing=pricing, blocks=short)


def _stored(data: dict) -> tuple[str, str, list[ModelTrace], BlockTraces | None]:
    """An entry's tracer, reuse note, traces and, for a pair expanded from a few blocks, those blocks' traces."""
    traces = [_trace_of(trace) for trace in data["traces"]]
    blocks = data.get("blocks")
    short = None if blocks is None else BlockTraces(
        data["tracer"], Repeats(blocks["path"], blocks["count"], blocks["period"]), blocks["periods"], *traces,
        tensors={key: (block, name) for key, block, name in blocks["tensors"]})
    return data["tracer"], data["reuse"], traces, short


def _write(path: Path, key: str, pair: TracePair) -> None:
    """Store `pair` (when it reads back as itself); a cache that cannot be written only costs a trace next time.
    A pair expanded from a few blocks is stored as those blocks' traces (see BlockTraces)."""
    short = pair.blocks
    traces = [_trace_data(short.at_1 if short else pair.at_1), _trace_data(short.at_2 if short else pair.at_2)]
    if None in traces:
        return
    entry = {"format": FORMAT, "key": key, "tracer": pair.tracer, "reuse": pair.reuse, "traces": traces}
    if short is not None:
        entry["blocks"] = {"path": short.repeats.path, "count": short.repeats.count, "period": short.repeats.period,
                           "periods": short.periods,
                           "tensors": [[key, block, name] for key, (block, name) in short.tensors.items()]}
    text = json.dumps(entry, separators=(",", ":"))
    try:
        tracer, reuse, traces, short_read = _stored(json.loads(text))
        read = TracePair(tracer, *traces, reuse=reuse, blocks=short_read)
        if _comparable(read, stored=True) != _comparable(pair, stored=True):
            return
        write_text_atomic(path, text)
        _prune(path.parent)
    except (OSError, ValueError, TypeError) as exc:
        print(f"autoplan: note: the trace cache {path.parent} could not be written ({exc}); tracing again next time",
              file=sys.stderr)


def _comparable(pair: TracePair, stored: bool = False) -> Any:
    """What a pair holds, to compare; `stored`: what its entry holds (a reused pair's few blocks, not the whole)."""
    def one(trace: ModelTrace):
        return (trace.ops, trace.micro_batch_size, trace.seq_len, trace.dtype, [name for name, _ in trace.nodes()],
                trace.edges(), trace.input_storages, trace.storage_producer, trace.saved_storages)
    if stored and pair.blocks is not None:
        short = pair.blocks
        return (pair.tracer, pair.reuse, one(short.at_1), one(short.at_2), short.repeats, short.periods,
                short.tensors)
    return pair.tracer, pair.reuse, one(pair.at_1), one(pair.at_2)


def _prune(folder: Path) -> None:
    entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for old in entries[:-MAX_ENTRIES]:
        old.unlink(missing_ok=True)
