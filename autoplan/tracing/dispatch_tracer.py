"""The fallback tracer, for models torch.fx cannot trace (current Hugging Face models among them).

It runs the model eagerly on the meta device, records what reaches the dispatcher, and attributes
each op to the module it ran in through forward hooks. Records keep the fx tracer's granularity, so
the cost model sees the same kind of ops either way:
- one record per call of a leaf module (a module without children: Linear, Embedding, a norm), as
  fx's call_module nodes;
- elsewhere one record per top-level torch function call (F.silu, torch.cat, Tensor.view), seen by a
  torch function mode, as fx's call_function / call_method nodes.
The result is the same ModelTrace the fx tracer gives: FLOPs and bytes per aten op from the shared
cost mode, bytes saved for backward from saved_tensors_hooks, backward work attributed through
grad_fn pre-hooks on each record's outputs. Eager execution cannot skip data-dependent Python
branches: a model that reads tensor values (`.item()`, `if x.any()`) fails here too, and the error
names the module it was in.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autoplan.errors import TraceError, UsageError
from autoplan.models.attention import dispatch
from autoplan.models.hf_attention import hf_attention_hooks
from autoplan.models.loss import logits_of, training_loss
from autoplan.tracing.counting import (
    BackwardAttribution,
    CostMode,
    clear_grads,
    default_inputs,
    fill_backward_liveness,
    fill_forward_transients,
    op_variant,
    saved_tensor_recorder,
    tensor_bytes,
    to_meta,
)
from autoplan.tracing.trace_options import TraceOptions
from cost_models.records import LOSS_NODE, GraphEdges, ModelTrace, OpRecord

__all__ = ["trace_dispatch"]


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


# Python operators reach a torch function mode as Tensor methods (Tensor.__add__, Tensor.__rmul__)
# and torch.fx as operator functions (operator.add, operator.mul): name both the fx way, so that op
# keys (and measured op times in a profile) agree across tracers.
_REFLECTED = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"}


def _function_kind(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("r") and name[1:] in _REFLECTED:
            name = name[1:]
    return name


def _call_label(func) -> str:
    """How the user's code spells the call, for error messages: Tensor.__bool__, cat, linear."""
    qualname = getattr(func, "__qualname__", None) or str(func)
    return "Tensor." + qualname.split(".")[-1] if "Tensor" in qualname.split(".")[0] else qualname.split(".")[-1]


class _Recorder:
    """Opens one OpRecord per leaf-module call or top-level torch function call, in execution order."""

    def __init__(self, model: nn.Module, mode: CostMode, records: dict[str, OpRecord], dtype: str):
        self.attribution = BackwardAttribution(mode)
        self.paths: dict[int, str] = {}
        for name, module in model.named_modules():
            self.paths.setdefault(id(module), name)
        self.leaves = {id(m) for m in model.modules() if next(m.children(), None) is None}
        # parameter -> the modules holding it (a tied weight: several), and the leaf modules called so far:
        # a leaf holding a parameter that a module not called yet also holds sums its gradients (op_variant)
        self.holders: dict[int, set[int]] = {}
        for module in model.modules():
            for param in module.parameters(recurse=False):
                self.holders.setdefault(id(param), set()).add(id(module))
        self.called: set[int] = set()
        self.mode, self.records, self.dtype = mode, records, dtype
        self.module_stack: list[str] = [""]
        self.leaf_depth = 0  # > 0 while inside a leaf module: its ops belong to its record
        self.leaf_records: list[str] = []
        self.calls = 0
        self.last_call = ""  # what ran last, for error messages
        self.input_storages: dict[str, list[tuple[int, int]]] = {}

    def begin(self, kind: str, inputs, variant: str, label: str | None = None) -> str:
        name = f"{kind}_{self.calls}"
        self.calls += 1
        module = self.module_stack[-1]
        tensors_in = _tensors(inputs)
        self.records[name] = OpRecord(name, kind, module, tuple(tuple(t.shape) for t in tensors_in), self.dtype,
                                      variant=variant)
        self.input_storages[name] = self.mode.read(tensors_in)
        self.mode.current = name
        self.last_call = f"{label or kind} in module {module or '<root>'!r}"
        return name

    def end(self, name: str, output) -> None:
        record = self.records[name]
        outs = _tensors(output)
        if not outs and record.fwd_bytes == 0 and record.fwd_flops == 0:
            # shape queries and other calls that run no kernel: no record, as fx would fold them away
            del self.records[name], self.input_storages[name]
            self.mode.current = LOSS_NODE
            return
        record.out_bytes = sum(map(tensor_bytes, outs))
        self.attribution.attach(name, outs)

    def pre_forward(self, module: nn.Module, args, kwargs):
        self.module_stack.append(self.paths[id(module)])
        if id(module) in self.leaves:
            if self.leaf_depth == 0:
                self.called.add(id(module))
                summed = sum(1 for p in module.parameters() if self.holders.get(id(p), set()) - self.called)
                self.leaf_records.append(self.begin(type(module).__name__, (args, kwargs),
                                                    op_variant(module, summed_grads=summed)))
            self.leaf_depth += 1

    def post_forward(self, module: nn.Module, args, kwargs, output):
        if id(module) in self.leaves:
            self.leaf_depth -= 1
            if self.leaf_depth == 0:
                self.end(self.leaf_records.pop(), output)
        self.module_stack.pop()


class _FunctionMode(TorchFunctionMode):
    """Gives each torch function call outside a leaf module its own record; fuses attention."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, label = _function_kind(func), _call_label(func)
        if func is F.scaled_dot_product_attention:
            func = dispatch  # the attention kernel that is priced (autoplan.tracing.attention)
        if self.recorder.leaf_depth:
            return func(*args, **kwargs)
        name = self.recorder.begin(kind, (args, kwargs), op_variant(None, args, kwargs), label)
        output = func(*args, **kwargs)
        self.recorder.end(name, output)
        return output


def _run(meta_model: nn.Module, args: tuple, kwargs: dict, recorder: _Recorder, pack,
         options: TraceOptions) -> None:
    """Forward, loss and backward; the graph's tensors are this frame's alone, gone when it returns."""
    mode, records = recorder.mode, recorder.records
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        with _FunctionMode(recorder), options.attention_executor(mode), hf_attention_hooks(meta_model):
            output = meta_model(*args, **kwargs)
        mode.current = LOSS_NODE
        recorder.last_call = "the loss (cross-entropy over the model's output)"
        records[LOSS_NODE].input_shapes = (tuple(logits_of(output).shape),)
        logits = logits_of(output)
        recorder.input_storages[LOSS_NODE] = mode.read([logits])
        loss = training_loss(output)
    mode.backward = True
    recorder.last_call = "the backward pass"
    with mode:
        clear_grads(meta_model)
        loss.backward()


@contextlib.contextmanager
def _module_hooks(model: nn.Module, recorder: _Recorder):
    """Every module of `model` tells `recorder` as its forward starts and ends, while this is entered."""
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(recorder.pre_forward, with_kwargs=True))
        handles.append(module.register_forward_hook(recorder.post_forward, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_dispatch(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    args: tuple | None = None,
    kwargs: dict | None = None,
    options: TraceOptions | None = None,
) -> ModelTrace:
    """Trace `model` (any device; copied to meta in `dtype`) by running it eagerly on meta tensors.
    `args`/`kwargs` are the forward's inputs at this micro-batch (default: token ids); `options` say who is
    told of each op, which kernel each attention call is priced as and how expert matmuls scale (see
    TraceOptions; default: torch's attention pick on CUDA)."""
    options = options or TraceOptions()
    meta_model = to_meta(model, dtype)
    if args is None and not kwargs:
        args = default_inputs(meta_model, micro_batch_size, seq_len)
    args, kwargs = tuple(args or ()), dict(kwargs or {})

    records: dict[str, OpRecord] = {LOSS_NODE: OpRecord(LOSS_NODE, "cross_entropy", "", (), dtype)}
    mode = options.cost_mode(records)
    recorder = _Recorder(meta_model, mode, records, dtype)
    saved, pack = saved_tensor_recorder(meta_model, mode)

    failure = None
    try:
        with _module_hooks(meta_model, recorder):
            _run(meta_model, args, kwargs, recorder, pack, options)
    except UsageError as exc:  # an attention kernel asked for that cannot run a call: said as it is
        failure = exc
        raise
    except Exception as exc:
        failure = exc
        raise TraceError(f"running {type(model).__name__} on the meta device failed at {recorder.last_call}: "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        recorder.attribution.release(failure)

    for nbytes, name in saved.values():
        records[name].saved_bytes += nbytes
    fill_forward_transients(records, mode, saved, recorder.input_storages)
    fill_backward_liveness(records, mode, meta_model)
    ops = [record for name, record in records.items() if name != LOSS_NODE] + [records[LOSS_NODE]]
    return ModelTrace(
        graph=_op_graph(recorder), ops=ops, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
        input_storages=recorder.input_storages,
        storage_producer={k: v for k, v in mode.storage_producer.items() if v in records},
        saved_storages={k: v for k, v in saved.items() if v[1] in records},
    )


def _op_graph(recorder: _Recorder) -> GraphEdges:
    """The ops linked from the op that produced each storage to those that read it, every last op feeding the
    loss; each op marked a matmul when matmuls did at least half its work."""
    records, mode = recorder.records, recorder.mode
    for name, record in records.items():
        work = record.fwd_flops + record.bwd_flops
        record.is_matmul = work > 0 and mode.matmul_flops.get(name, 0) >= 0.5 * work
    edges = []
    for name, inputs in recorder.input_storages.items():
        for storage, _nbytes in inputs:
            producer = mode.storage_producer.get(storage)
            if producer in records and producer != name:
                edges.append((producer, name))
    return GraphEdges(records.items(), edges).feeding(LOSS_NODE)
