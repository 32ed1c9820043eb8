"""Trace a model into an operator graph with FLOPs, bytes and saved activations, on the meta device.

torch.fx gives the graph (one node per module call or function, with its module path); a meta-device
run of that graph, forward and backward, gives each node's cost:
- FLOPs from torch's own FlopCounter formulas (torch.utils.flop_counter.flop_registry), per aten op;
- bytes read and written per aten op (views move nothing);
- bytes saved for backward, caught with saved_tensors_hooks and deduplicated by storage, so a tensor
  saved by two ops counts once, for the op that saved it first; parameters are not activations;
- backward work is attributed to the fx node whose output's grad_fn ran last before it;
- what the backward holds: the storages it allocates are followed until freed, which gives each op
  the gradient bytes alive while its backward runs and the parameter gradients it computes (see
  fill_backward_liveness).
Nothing is allocated: meta tensors carry shapes and dtypes only.

Attention: on meta, F.scaled_dot_product_attention decomposes into the math path, which saves the
S x S score matrix. Training runs use a fused (flash) kernel that saves only q, k, v, the output and
the log-sum-exp, so the tracer runs the fused CPU flash kernel in its place when it applies.
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .errors import AutoplanError

LOSS_NODE = "loss"  # the loss computed after the model's output; belongs to the root module ""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_aten = torch.ops.aten
_FLASH_CPU = _aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class TraceError(AutoplanError):
    """The model could not be traced; the message names the failing module or op."""

    exit_code = 2


@dataclass
class OpRecord:
    """One fx node's cost at a given micro-batch size; bytes and FLOPs are per rank, per micro-batch."""

    name: str  # fx node name, unique in the graph
    kind: str  # op kind: module class ("Linear") or function name ("gelu", "scaled_dot_product_attention")
    module: str  # path of the innermost module the op runs in ("" is the root)
    input_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    out_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0  # bytes read + written by the forward's aten ops
    bwd_bytes: int = 0
    saved_bytes: int = 0  # bytes first saved for backward by this op (excluding parameters)
    fwd_max_alloc_bytes: int = 0  # largest single tensor the forward allocates (a transient)
    fwd_transient_bytes: int = 0  # held while the op runs beyond saved activations (see fill_forward_transients)
    # the backward's own storages (gradients and temporaries; not parameter gradients) alive when this
    # op's backward starts, and at most while it runs, and the parameter gradients it computes
    bwd_in_bytes: int = 0
    bwd_live_bytes: int = 0
    param_grad_bytes: int = 0
    is_matmul: bool = False  # dominated by matmul-like aten ops (for the compute model's fits)
    # what besides input shapes decides the work: a module's configuration (Linear's out_features),
    # a function's constant arguments (is_causal, a slice); "" when there is none
    variant: str = ""

    @property
    def key(self) -> str:
        """Identity of the op's work for measured timings: kind, input shapes, dtype, variant."""
        shapes = ";".join("x".join(map(str, shape)) for shape in self.input_shapes)
        return f"{self.kind}[{shapes}]{self.dtype}{self.variant}"


@dataclass
class ModelTrace:
    """The traced operator graph (networkx, nodes carry an OpRecord under 'op') in execution order."""

    graph: nx.DiGraph
    ops: list[OpRecord]
    micro_batch_size: int
    seq_len: int
    dtype: str
    # unit-boundary information: fx node name -> tensor-input storages (key, bytes) it reads
    input_storages: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # storage key -> name of the node that produced it
    storage_producer: dict[int, str] = field(default_factory=dict)
    # storages saved for backward: key -> (bytes, name of the first node that saved it)
    saved_storages: dict[int, tuple[int, str]] = field(default_factory=dict)

    def op(self, name: str) -> OpRecord:
        return self.graph.nodes[name]["op"]


_MATMUL_OPS = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.matmul, _aten.convolution,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention_for_cpu_backward,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten.convolution_backward,
}


def _storage_key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aten_flops(func, args, kwargs, out) -> int:
    if func is _FLASH_CPU:
        query, key, value = args[:3]
        return sdpa_flop_count(query.shape, key.shape, value.shape)
    if func is _FLASH_CPU_BWD:
        grad_out, query, key, value = args[:4]
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    counter = flop_registry.get(func._overloadpacket)
    if counter is None:
        return 0
    return int(counter(*args, **(kwargs or {}), out_val=out))


class _CostMode(TorchDispatchMode):
    """Charges each aten op's FLOPs and bytes to the current fx node (forward or backward bucket)."""

    def __init__(self, records: dict[str, OpRecord]):
        super().__init__()
        self.records = records
        self.backward = False
        self.current = LOSS_NODE
        self.matmul_flops: dict[str, int] = {}
        self.storage_producer: dict[int, str] = {}
        # Storages are keyed by address; holding every output storage until the trace ends keeps an
        # address from being reused by a later tensor (meta storages cost no memory).
        self.keep_alive: list = []
        self.storage_bytes: dict[int, int] = {}  # forward allocations: storage -> bytes
        self.fwd_allocs: dict[str, list[int]] = {}  # node -> storages its forward allocated
        # the backward's allocations and frees, in order, with the op running at each (fill_backward_liveness):
        # ("enter", op), ("alloc", id, bytes, op), ("free", id); ids number the allocations
        self.bwd_events: list[tuple] = []
        self.bwd_live: dict[int, int] = {}  # storage key -> allocation id, while alive
        self._allocs = 0

    @property
    def current(self) -> str:
        return self._current

    @current.setter
    def current(self, name: str) -> None:
        self._current = name
        if self.backward:
            self.bwd_events.append(("enter", name))

    def _track_backward_alloc(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key in self.storage_bytes or key in self.bwd_live:
            return  # a forward storage (kept alive, never reused) or one already followed
        storage = tensor.untyped_storage()
        alloc = self._allocs
        self._allocs += 1
        self.bwd_live[key] = alloc
        self.bwd_events.append(("alloc", alloc, storage.nbytes(), self._current))
        weakref.finalize(storage, self._backward_free, key, alloc)

    def _backward_free(self, key: int, alloc: int) -> None:
        if self.bwd_live.get(key) == alloc:
            del self.bwd_live[key]
        self.bwd_events.append(("free", alloc))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        record = self.records[self.current]
        flops = _aten_flops(func, args, kwargs, out)
        moved = 0
        if not func.is_view and func._overloadpacket not in (_aten.detach, _aten.lift_fresh):
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            moved = sum(map(_tensor_bytes, inputs)) + sum(map(_tensor_bytes, outputs))
            if self.backward:
                for tensor in outputs:
                    self._track_backward_alloc(tensor)
            else:
                largest = max(map(_tensor_bytes, outputs), default=0)
                record.fwd_max_alloc_bytes = max(record.fwd_max_alloc_bytes, largest)
                for tensor in outputs:
                    self.keep_alive.append(tensor.untyped_storage())
                    key = _storage_key(tensor)
                    self.storage_producer.setdefault(key, self.current)
                    self.storage_bytes.setdefault(key, tensor.untyped_storage().nbytes())
                    self.fwd_allocs.setdefault(self.current, []).append(key)
        if self.backward:
            record.bwd_flops += flops
            record.bwd_bytes += moved
        else:
            record.fwd_flops += flops
            record.fwd_bytes += moved
        if func._overloadpacket in _MATMUL_OPS:
            self.matmul_flops[self.current] = self.matmul_flops.get(self.current, 0) + flops
        return out


def saved_tensor_recorder(model: nn.Module, mode: _CostMode):
    """A saved_tensors_hooks pack function that records each storage saved for backward, once, for
    the op that saved it first (mode.current); parameters are not activations. Returns (saved, pack):
    saved maps storage key -> (bytes, op name)."""
    param_storages = {_storage_key(p) for p in model.parameters()}
    saved: dict[int, tuple[int, str]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not mode.backward:
            storage = _storage_key(tensor)
            if storage not in param_storages and storage not in saved:
                saved[storage] = (tensor.untyped_storage().nbytes(), mode.current)
        return tensor

    return saved, pack


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stand-in for F.scaled_dot_product_attention that saves what a fused training kernel saves.

    Fused GPU kernels take dropout (they keep the RNG state, not a mask) and grouped-query attention;
    the CPU flash kernel's meta function accepts dropout, and GQA is run as repeated k/v heads."""
    if enable_gqa and query.shape[-3] != key.shape[-3] and query.shape[-3] % key.shape[-3] == 0:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
        enable_gqa = False
    if attn_mask is not None or enable_gqa or query.shape[-3] != key.shape[-3] or (
            dropout_p != 0.0 and query.device.type != "meta"):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    out, _logsumexp = _FLASH_CPU(query, key, value, dropout_p, is_causal, scale=scale)
    return out


def _kind(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


_MAX_VARIANT_CHARS = 160


def _variant(gm: fx.GraphModule, node: fx.Node, args, kwargs) -> str:
    if node.op == "call_module":
        return op_variant(gm.get_submodule(node.target))
    return op_variant(None, args, kwargs)


def op_variant(module: nn.Module | None, args=(), kwargs=None) -> str:
    """Two ops with the same kind and input shapes can differ in work: Linear(64, 64) and Linear(64, 512)
    both read [B, S, 64]. The module's extra_repr, or the function's non-tensor arguments, tell them apart."""
    if module is not None:
        detail = module.extra_repr() or ",".join(
            f"{name}={'x'.join(map(str, p.shape))}" for name, p in module.named_parameters())
    else:
        def constants(value) -> list[str]:
            return [repr(leaf) for leaf in tree_flatten(value)[0] if not isinstance(leaf, torch.Tensor)]

        detail = ",".join(constants(args) + [f"{k}={','.join(constants(v))}" for k, v in (kwargs or {}).items()])
    if len(detail) > _MAX_VARIANT_CHARS:
        detail = hashlib.sha1(detail.encode()).hexdigest()[:16]
    return f"({detail})" if detail else ""


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return next(reversed(stack.values()))[0]


class _PathTracer(fx.Tracer):
    """fx's tracer, remembering the modules it is inside so that a failure can name the innermost."""

    def __init__(self):
        super().__init__()
        self.entered_modules: list[str] = []

    def call_module(self, m, forward, args, kwargs):
        self.entered_modules.append(self.path_of_module(m))
        out = super().call_module(m, forward, args, kwargs)
        self.entered_modules.pop()
        return out


def symbolic_trace(model: nn.Module) -> fx.GraphModule:
    tracer = _PathTracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many types; the user needs the module that failed
        where = f" in module {tracer.entered_modules[-1]!r}" if tracer.entered_modules else ""
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__}{where}: {type(exc).__name__}: {exc}. "
            "torch.fx needs a forward without data-dependent Python control flow."
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def default_inputs(model: nn.Module, micro_batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Token ids [micro_batch, seq_len], the input of every zoo model (and most language models)."""
    return (torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta"),)


def _logits(output) -> torch.Tensor:
    """The logits in a model's output: the output itself, its first element, or (Hugging Face models)
    the output object's `logits`."""
    output = getattr(output, "logits", output)
    return output[0] if isinstance(output, (tuple, list)) else output


def _loss(output) -> torch.Tensor:
    """The training loss the run uses: next-token cross-entropy in fp32 over logits [B, S, V]."""
    logits = _logits(output)
    if logits.dim() == 3:
        labels = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return logits.float().sum()


def trace_model(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    inputs: tuple[torch.Tensor, ...] | None = None,
    graph_module: fx.GraphModule | None = None,
) -> ModelTrace:
    """Trace `model` (any device; it is copied to meta in `dtype`) at one micro-batch size."""
    meta_model = copy.deepcopy(model).to(device="meta", dtype=DTYPES[dtype]) if _needs_copy(model, dtype) else model
    gm = graph_module if graph_module is not None else symbolic_trace(meta_model)
    if graph_module is not None:
        gm = _rebind(graph_module, meta_model)
    if inputs is None:
        inputs = default_inputs(meta_model, micro_batch_size, seq_len)

    records: dict[str, OpRecord] = {}
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_function", "call_method"):
            records[node.name] = OpRecord(node.name, _kind(gm, node), _module_path(node), (), dtype)
    records[LOSS_NODE] = OpRecord(LOSS_NODE, "cross_entropy", "", (), dtype)

    mode = _CostMode(records)
    saved, pack = saved_tensor_recorder(meta_model, mode)
    input_storages: dict[str, list[tuple[int, int]]] = {}

    def make_prehook(name: str):
        def prehook(grad_outputs):
            mode.current = name
        return prehook

    class _Interpreter(fx.Interpreter):
        def run_node(self, node: fx.Node):
            if node.name not in records:
                return super().run_node(node)
            mode.current = node.name
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            tensors_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            records[node.name].input_shapes = tuple(tuple(t.shape) for t in tensors_in)
            records[node.name].variant = _variant(gm, node, args, kwargs)
            input_storages[node.name] = [(_storage_key(t), t.untyped_storage().nbytes()) for t in tensors_in]
            out = super().run_node(node)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            records[node.name].out_bytes = sum(map(_tensor_bytes, outs))
            for tensor in outs:
                if tensor.grad_fn is not None:
                    tensor.grad_fn.register_prehook(make_prehook(node.name))
            return out

        def call_function(self, target, args, kwargs):
            if target is F.scaled_dot_product_attention:
                target = _fused_sdpa
            return super().call_function(target, args, kwargs)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            output = _Interpreter(gm).run(*inputs)
            mode.current = LOSS_NODE
            records[LOSS_NODE].input_shapes = (tuple(_logits(output).shape),)
            input_storages[LOSS_NODE] = [(_storage_key(_logits(output)), _logits(output).untyped_storage().nbytes())]
            loss = _loss(output)
        mode.backward = True
        with mode:
            _clear_grads(meta_model)
            loss.backward()
    except Exception as exc:
        failing = records.get(mode.current)
        where = f"op {failing.name} ({failing.kind}) in module {failing.module or '<root>'!r}" if failing else "?"
        raise TraceError(f"tracing failed at {where}: {type(exc).__name__}: {exc}") from exc

    for storage, (nbytes, name) in saved.items():
        records[name].saved_bytes += nbytes
    fill_forward_transients(records, mode, saved, input_storages)
    fill_backward_liveness(records, mode, meta_model)
    for name, record in records.items():
        total = record.fwd_flops + record.bwd_flops
        record.is_matmul = total > 0 and mode.matmul_flops.get(name, 0) >= 0.5 * total
        graph.add_node(name, op=record)
    for node in gm.graph.nodes:
        if node.name in records:
            for user in node.users:
                if user.name in records:
                    graph.add_edge(node.name, user.name)
    last_nodes = [n for n in graph.nodes if n != LOSS_NODE and graph.out_degree(n) == 0]
    for name in last_nodes:
        graph.add_edge(name, LOSS_NODE)

    ops = [records[n.name] for n in gm.graph.nodes if n.name in records] + [records[LOSS_NODE]]
    return ModelTrace(
        graph=graph, ops=ops, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
        input_storages=input_storages, storage_producer=dict(mode.storage_producer), saved_storages=saved,
    )


def fill_forward_transients(records: dict[str, OpRecord], mode: _CostMode, saved: dict[int, tuple[int, str]],
                            input_storages: dict[str, list[tuple[int, int]]]) -> None:
    """What each op holds beyond the saved activations while it runs: its activation inputs that
    nothing saves (still referenced by the op) and the tensors it allocates that nothing saves (its
    output and intermediates). E.g. the loss holds the bf16 logits, their fp32 copy and the saved
    log-softmax at once."""
    for name, record in records.items():
        allocated = sum(mode.storage_bytes[key] for key in set(mode.fwd_allocs.get(name, [])) if key not in saved)
        inputs = sum(nbytes for key, nbytes in dict(input_storages.get(name, [])).items()
                     if key not in saved and mode.storage_producer.get(key, name) != name)
        record.fwd_transient_bytes = allocated + inputs


def fill_backward_liveness(records: dict[str, OpRecord], mode: _CostMode, model: nn.Module) -> None:
    """Replays the backward's allocations and frees (mode.bwd_events): each op's bwd_in_bytes and
    bwd_live_bytes count the backward's storages alive when its backward starts and at most while it
    runs (the gradient it receives, those it produces, its temporaries, the gradients of other ops
    not consumed yet); the parameter gradients (the storages left in .grad) count apart, for the op
    that computed them, in param_grad_bytes. Saved activations are not here: the cost model frees
    them op by op from saved_bytes."""
    param_grads = {mode.bwd_live.get(_storage_key(p.grad)) for p in model.parameters() if p.grad is not None}
    sizes: dict[int, int] = {}
    live = 0
    entered: set[str] = set()
    for event in mode.bwd_events:
        if event[0] == "enter":
            record = records.get(event[1])
            if record is not None and event[1] not in entered:
                entered.add(event[1])
                record.bwd_in_bytes = live
                record.bwd_live_bytes = max(record.bwd_live_bytes, live)
        elif event[0] == "alloc":
            _, alloc, nbytes, name = event
            record = records[name]
            if alloc in param_grads:
                record.param_grad_bytes += nbytes
                continue
            sizes[alloc] = nbytes
            live += nbytes
            record.bwd_live_bytes = max(record.bwd_live_bytes, live)
        else:
            live -= sizes.pop(event[1], 0)


_SCALED_FIELDS = (
    "out_bytes", "fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "saved_bytes",
    "fwd_max_alloc_bytes", "fwd_transient_bytes", "bwd_in_bytes", "bwd_live_bytes",
    "param_grad_bytes",
)


def extrapolate_ops(ops_at_1: list[OpRecord], ops_at_2: list[OpRecord], micro_batch_size: int) -> list[OpRecord]:
    """Op costs at any micro-batch size from traces at 1 and 2: every count here is affine in the
    batch (per-sample activations and FLOPs plus batch-independent parameter traffic)."""
    result = []
    for one, two in zip(ops_at_1, ops_at_2, strict=True):
        assert one.name == two.name, "traces at different batch sizes must share one fx graph"
        values = {f: max(0, getattr(one, f) + (getattr(two, f) - getattr(one, f)) * (micro_batch_size - 1))
                  for f in _SCALED_FIELDS}
        shapes = tuple((micro_batch_size,) + s[1:] if s and s[0] == 1 and s != t else s
                       for s, t in zip(one.input_shapes, two.input_shapes))
        # constant arguments can hold the batch size (a view's sizes); batch 2's are the nearer guess
        variant = one.variant if micro_batch_size == 1 else two.variant
        result.append(OpRecord(one.name, one.kind, one.module, shapes, one.dtype,
                               is_matmul=one.is_matmul, variant=variant, **values))
    return result


def _clear_grads(model: nn.Module) -> None:
    """A model traced again (one already on meta) must not accumulate into the last trace's gradients."""
    for param in model.parameters():
        param.grad = None


def _needs_copy(model: nn.Module, dtype: str) -> bool:
    return any(p.device.type != "meta" or p.dtype != DTYPES[dtype] for p in model.parameters())


def _rebind(graph_module: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A graph traced from one copy of a model, run against another copy's modules and parameters."""
    return fx.GraphModule(model, graph_module.graph)
