"""The fx tracer: a model's operator graph from torch.fx, costed by a meta-device run.

torch.fx gives the graph (one node per module call or function, with its module path); running that
graph on the meta device, forward and backward, under `counting.CostMode` gives each node's cost:
- FLOPs from torch's own FlopCounter formulas, per aten op; bytes read and written (views move nothing);
- bytes saved for backward, caught with saved_tensors_hooks and deduplicated by storage, so a tensor
  saved by two ops counts once, for the op that saved it first; parameters are not activations;
- backward work is attributed to the fx node whose output's grad_fn ran last before it;
- what the backward holds: the storages it allocates are followed until freed, which gives each op
  the gradient bytes alive while its backward runs and the parameter gradients it computes.
Nothing is allocated: meta tensors carry shapes and dtypes only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from autoplan.errors import TraceError, UsageError
from autoplan.models.attention import dispatch
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
    summed_grad_params,
    tensor_bytes,
    to_meta,
)
from autoplan.tracing.trace_options import TraceOptions
from cost_models.records import LOSS_NODE, GraphEdges, ModelTrace, OpRecord

__all__ = ["param_uses", "symbolic_trace", "trace_model"]

def _kind(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _variant(gm: fx.GraphModule, node: fx.Node, args, kwargs, summed_grads: int = 0) -> str:
    if node.op == "call_module":
        return op_variant(gm.get_submodule(node.target), summed_grads=summed_grads)
    return op_variant(None, args, kwargs, summed_grads=summed_grads)


def param_uses(gm: fx.GraphModule) -> list[tuple[str, list[int]]]:
    """(node name, ids of the parameters it uses) for each call node, in graph order: a module's own
    parameters, and those a function or method reads through get_attr nodes."""
    uses = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            uses.append((node.name, [id(p) for p in gm.get_submodule(node.target).parameters()]))
        elif node.op in ("call_function", "call_method"):
            attrs = [_attr(gm, str(n.target)) for n in node.all_input_nodes if n.op == "get_attr"]
            uses.append((node.name, [id(p) for p in attrs if isinstance(p, nn.Parameter)]))
    return uses


def _attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


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

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """torch.nn's modules, and childless subclasses of them (the zoo's RMSNorm, a user's Linear with
        another forward): one op each, as the dispatch tracer records a childless module."""
        if super().is_leaf_module(m, module_qualified_name):
            return True
        return next(m.children(), None) is None and any(
            cls.__module__.startswith("torch.nn.modules") for cls in type(m).__mro__[1:] if cls is not nn.Module)

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


def trace_model(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    inputs: tuple[torch.Tensor, ...] | None = None,
    graph_module: fx.GraphModule | None = None,
    options: TraceOptions | None = None,
) -> ModelTrace:
    """Trace `model` (any device; it is copied to meta in `dtype`) at one micro-batch size. `options` say who
    is told of each op, which kernel each attention call is priced as and how expert matmuls scale (see
    TraceOptions; default: torch's attention pick on CUDA)."""
    options = options or TraceOptions()
    meta_model = to_meta(model, dtype)
    gm = graph_module if graph_module is not None else symbolic_trace(meta_model)
    if graph_module is not None:
        gm = _rebind(graph_module, meta_model)
    if inputs is None:
        inputs = default_inputs(meta_model, micro_batch_size, seq_len)
    records = _open_records(gm, dtype)
    mode = options.cost_mode(records)
    tally = _Tally(records, mode, BackwardAttribution(mode),
                   {name: len(params) for name, params in summed_grad_params(param_uses(gm)).items()})
    saved, pack = saved_tensor_recorder(meta_model, mode)

    failure = None
    try:
        _run(gm, meta_model, inputs, pack, tally, options)
    except UsageError as exc:  # an attention kernel asked for that cannot run a call: said as it is
        failure = exc
        raise
    except Exception as exc:
        failure = exc
        failing = records.get(mode.current)
        where = f"op {failing.name} ({failing.kind}) in module {failing.module or '<root>'!r}" if failing else "?"
        raise TraceError(f"tracing failed at {where}: {type(exc).__name__}: {exc}") from exc
    finally:
        tally.attribution.release(failure)

    for storage, (nbytes, name) in saved.items():
        records[name].saved_bytes += nbytes
    fill_forward_transients(records, mode, saved, tally.input_storages)
    fill_backward_liveness(records, mode, meta_model)
    ops = [records[n.name] for n in gm.graph.nodes if n.name in records] + [records[LOSS_NODE]]
    return ModelTrace(
        graph=_op_graph(gm, records, mode), ops=ops, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
        input_storages=tally.input_storages, storage_producer=dict(mode.storage_producer), saved_storages=saved,
    )


def _open_records(gm: fx.GraphModule, dtype: str) -> dict[str, OpRecord]:
    """An empty record for each call node of the graph, and one for the loss."""
    records = {node.name: OpRecord(node.name, _kind(gm, node), _module_path(node), (), dtype)
               for node in gm.graph.nodes if node.op in ("call_module", "call_function", "call_method")}
    records[LOSS_NODE] = OpRecord(LOSS_NODE, "cross_entropy", "", (), dtype)
    return records


@dataclass
class _Tally:
    """What a trace fills in as the graph runs: the records, the cost mode counting into them, the backward's
    attribution to ops, each node's parameters whose gradients it sums, and the storages each op reads."""

    records: dict[str, OpRecord]
    mode: CostMode
    attribution: BackwardAttribution
    summed: dict[str, int]
    input_storages: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


class _CostInterpreter(fx.Interpreter):
    """Runs the graph node by node, each call node's ops charged to its record; attention as it is priced."""

    def __init__(self, gm: fx.GraphModule, tally: _Tally):
        super().__init__(gm)
        self.tally = tally

    def run_node(self, node: fx.Node):
        tally = self.tally
        record = tally.records.get(node.name)
        if record is None:
            return super().run_node(node)
        tally.mode.current = node.name
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        tensors_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        record.input_shapes = tuple(tuple(t.shape) for t in tensors_in)
        record.variant = _variant(self.module, node, args, kwargs, tally.summed.get(node.name, 0))
        tally.input_storages[node.name] = tally.mode.read(tensors_in)
        out = super().run_node(node)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        record.out_bytes = sum(map(tensor_bytes, outs))
        tally.attribution.attach(node.name, outs)
        return out

    def call_function(self, target, args, kwargs):
        if target is F.scaled_dot_product_attention:
            target = dispatch  # the attention kernel that is priced (autoplan.tracing.attention)
        return super().call_function(target, args, kwargs)


def _run(gm: fx.GraphModule, meta_model: nn.Module, inputs: tuple, pack, tally: _Tally,
         options: TraceOptions) -> None:
    """Forward, loss and backward; the graph's tensors are this frame's alone, gone when it returns."""
    mode, records = tally.mode, tally.records
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode, options.attention_executor(mode):
        output = _CostInterpreter(gm, tally).run(*inputs)
        mode.current = LOSS_NODE
        records[LOSS_NODE].input_shapes = (tuple(logits_of(output).shape),)
        tally.input_storages[LOSS_NODE] = mode.read([logits_of(output)])
        loss = training_loss(output)
    mode.backward = True
    with mode:
        clear_grads(meta_model)
        loss.backward()


def _op_graph(gm: fx.GraphModule, records: dict[str, OpRecord], mode: CostMode) -> GraphEdges:
    """The ops as the graph's data flow, every last op feeding the loss; each op marked a matmul when matmuls
    did at least half its work."""
    for name, record in records.items():
        total = record.fwd_flops + record.bwd_flops
        record.is_matmul = total > 0 and mode.matmul_flops.get(name, 0) >= 0.5 * total
    edges = [(node.name, user.name) for node in gm.graph.nodes if node.name in records
             for user in node.users if user.name in records]
    return GraphEdges(records.items(), edges).feeding(LOSS_NODE)


def _rebind(graph_module: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A graph traced from one copy of a model, run against another copy's modules and parameters."""
    return fx.GraphModule(model, graph_module.graph)
