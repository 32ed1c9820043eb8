"""Re-run the traced graph's ops on real tensors, one distinct op at a time, forward and backward.

A model's fx graph is run once on the meta device to capture each node's arguments (shapes,
strides, dtypes, which tensors require grad, constant arguments). To time a node, those arguments
are rebuilt as random tensors on the device with the same strides (a transposed input makes
`flatten` copy, a contiguous one would not), the node's target (the submodule, the function, the
method) is called on them, and its backward is run from a random output gradient.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from autoplan.models.zoo import build_model, get_config
from autoplan.profiling.timing import Repeats, median_time_s
from autoplan.tracing.counting import DTYPES, default_inputs, summed_grad_params, training_loss
from autoplan.tracing.fx_tracer import param_uses, symbolic_trace, trace_model
from cost_models.records import LOSS_NODE, OpRecord

TRAINING_LOSS = training_loss  # the loss the tracer charges to the "loss" op; re-run as it is


@dataclass
class OpCase:
    """One distinct op (by OpRecord.key) and what it takes to re-run it."""

    record: OpRecord
    target: object  # an nn.Module on meta (call_module), a function, or a method name
    args: tuple
    kwargs: dict
    # tied parameters (meta) of the op whose gradient from a later use is summed with this op's in its
    # backward (tracing.counting.summed_grad_params): timed with such a gradient pending
    summed_params: tuple = ()

    @property
    def key(self) -> str:
        return self.record.key


@dataclass(frozen=True)
class Workload:
    """A model to trace at some micro-batch sizes; `make_inputs(batch, seq)` gives meta inputs."""

    name: str
    build: Callable[[], nn.Module]
    micro_batch_sizes: tuple[int, ...]
    seq_len: int
    make_inputs: Callable[[nn.Module, int, int], tuple[torch.Tensor, ...]] = default_inputs


def zoo_workload(name: str, micro_batch_sizes: tuple[int, ...], seq_len: int | None = None) -> Workload:
    """A zoo model at the planning sequence length (its context length unless given)."""
    from autoplan.models.resolve import parse_zoo_spec

    base, overrides = parse_zoo_spec(name)
    config = get_config(base, **overrides)
    return Workload(name, lambda: build_model(config), micro_batch_sizes, seq_len or config.max_seq_len)


class SweepMLP(nn.Module):
    """Pre-norm MLP block of a chosen width: Linear, LayerNorm, GELU and add at sizes the tiny zoo
    models do not reach, so the per-family fits see large problems too."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def sweep_workload(width: int, tokens: int) -> Workload:
    def hidden_states(model: nn.Module, batch: int, seq: int) -> tuple[torch.Tensor, ...]:
        dtype = next(model.parameters()).dtype
        # requires grad: in a network these ops sit after the embedding, so backward computes input grads
        return (torch.empty(batch, seq, width, dtype=dtype, device="meta", requires_grad=True),)

    return Workload(f"sweep-mlp-{width}x{tokens}", lambda: SweepMLP(width), (1,), tokens, hidden_states)


def collect_cases(workload: Workload, dtype: str) -> list[OpCase]:
    """Every op of the workload's graph at each of its micro-batch sizes, in graph order (duplicates kept)."""
    with torch.device("meta"):
        meta_model = workload.build()
    meta_model = meta_model.to(device="meta", dtype=DTYPES[dtype])
    graph_module = symbolic_trace(meta_model)
    by_id = {id(p): p for p in graph_module.parameters()}
    summed = {name: tuple(by_id[i] for i in params if i in by_id)
              for name, params in summed_grad_params(param_uses(graph_module)).items()}
    cases: list[OpCase] = []
    for batch in workload.micro_batch_sizes:
        inputs = workload.make_inputs(meta_model, batch, workload.seq_len)
        trace = trace_model(meta_model, batch, workload.seq_len, dtype, inputs=inputs, graph_module=graph_module)
        captured, output = _capture(graph_module, inputs)
        for record in trace.ops:
            if record.name == LOSS_NODE:
                cases.append(OpCase(record, TRAINING_LOSS, (output,), {}))
                continue
            node, args, kwargs = captured[record.name]
            if node.op == "call_module":
                target = graph_module.get_submodule(node.target)
            elif node.op == "call_method":
                target = str(node.target)
            else:
                target = node.target
            cases.append(OpCase(record, target, args, kwargs, summed.get(record.name, ())))
    return cases


def _capture(graph_module: fx.GraphModule, inputs: tuple[torch.Tensor, ...]):
    """Each call node's (node, args, kwargs) as meta values, and the graph's output."""
    captured: dict[str, tuple[fx.Node, tuple, dict]] = {}

    class Capture(fx.Interpreter):
        def run_node(self, node: fx.Node):
            if node.op in ("call_module", "call_function", "call_method"):
                args, kwargs = self.fetch_args_kwargs_from_env(node)
                captured[node.name] = (node, args, kwargs)
            return super().run_node(node)

    with torch.enable_grad():
        output = Capture(graph_module).run(*inputs)
    return captured, output


def has_work(record: OpRecord, direction: str) -> bool:
    if direction == "fwd":
        return record.fwd_flops > 0 or record.fwd_bytes > 0
    return record.bwd_flops > 0 or record.bwd_bytes > 0


def _real_tensor(meta: torch.Tensor, device: torch.device, int_high: int) -> torch.Tensor:
    """A random tensor with the meta tensor's shape, strides, offset, dtype and requires_grad."""
    span = meta.storage_offset() + sum((size - 1) * stride for size, stride in zip(meta.shape, meta.stride())) + 1
    span = span if meta.numel() else 0
    if meta.dtype.is_floating_point or meta.dtype.is_complex:
        base = torch.randn(span, dtype=meta.dtype, device=device)
    elif meta.dtype == torch.bool:
        base = torch.rand(span, device=device) > 0.5
    else:
        base = torch.randint(0, max(int_high, 1), (span,), dtype=meta.dtype, device=device)
    with torch.no_grad():
        real = base.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    if meta.requires_grad:
        real.requires_grad_()
    return real


def _real_module(meta_module: nn.Module, device: torch.device) -> nn.Module:
    module = copy.deepcopy(meta_module).to_empty(device=device)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.dtype.is_floating_point:
                tensor.normal_(0.0, 0.02)
            else:
                tensor.zero_()
    return module


def materialize(case: OpCase, device: torch.device) -> tuple[Callable[[], object], list[torch.Tensor]]:
    """A zero-argument forward call on real tensors, and the leaves (inputs, parameters) it differentiates."""
    forward, leaves, _ = _materialize(case, device)
    return forward, leaves


def _materialize(case: OpCase, device: torch.device):
    """As materialize, and the real counterparts of the case's summed_params."""
    target = case.target
    int_high = target.num_embeddings if isinstance(target, nn.Embedding) else 1
    made: dict[int, torch.Tensor] = {}  # meta tensor -> its real copy (a tensor passed twice stays one)

    def real(value):
        if isinstance(value, torch.Tensor):
            if id(value) not in made:
                made[id(value)] = _real_tensor(value, device, int_high)
            return made[id(value)]
        if isinstance(value, torch.device) and value.type == "meta":
            return device  # e.g. torch.arange(n, device=x.device), captured on meta
        return value

    args, kwargs = tree_map(real, (case.args, case.kwargs))
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(target, nn.Module):
        module = _real_module(target, device)
        leaves += [p for p in module.parameters() if p.requires_grad]
        names = {id(p): name for name, p in target.named_parameters()}
        summed = [module.get_parameter(names[id(p)]) for p in case.summed_params if id(p) in names]
        return (lambda: module(*args, **kwargs)), leaves, summed
    summed = [made[id(p)] for p in case.summed_params if id(p) in made]
    if isinstance(target, str):
        return (lambda: getattr(args[0], target)(*args[1:], **kwargs)), leaves, summed
    return (lambda: target(*args, **kwargs)), leaves, summed


@dataclass
class OpMeasurement:
    """Median seconds per direction; None where the op has no work (or its backward cannot be reached)."""

    fwd_s: float | None
    bwd_s: float | None


# the shortest a backward kernel is taken to run on a GPU once the backward call's own floor is taken off
MIN_KERNEL_S = 2e-6
_BACKWARD_FLOORS: dict[tuple[str, int | None], float] = {}


def backward_floor_s(device: torch.device, repeats: Repeats) -> float:
    """What timing one backward call costs on a GPU whatever the op: `torch.autograd.backward` of a one-element
    product. The engine's setup and its hand-over to the device's autograd thread (60-130 us on an H200
    with torch 2.11) keep the GPU idle between the timing events; inside a training step the engine issues
    the kernels of one backward while earlier ones run, so a unit's backward is not that per op (the
    launch floor is `op_overhead_s`, cost_models.compute). 0 on the CPU, whose op times are wall times and
    whose calibration fits what the step adds to them."""
    if device.type != "cuda":
        return 0.0
    key = (device.type, device.index)
    if key not in _BACKWARD_FLOORS:
        leaf = torch.ones(1, device=device, requires_grad=True)
        output, grad = leaf * 2.0, torch.ones(1, device=device)
        _BACKWARD_FLOORS[key] = median_time_s(lambda: torch.autograd.backward([output], [grad], retain_graph=True),
                                              device, Repeats(repeats.warmup, 50, 500, 0.01))
    return _BACKWARD_FLOORS[key]


def measure_case(case: OpCase, device: torch.device, repeats: Repeats) -> OpMeasurement:
    """A tied parameter's op (case.summed_params) is timed as its backward runs in the model: the
    gradient of the parameter's later use is pending (here through a view of the parameter, whose
    backward passes it on without a copy), and autograd adds the op's own gradient to it. On a GPU the
    backward's time is its kernels': the backward call's floor (backward_floor_s) taken off, at least
    MIN_KERNEL_S."""
    forward, leaves, summed = _materialize(case, device)
    fwd_s = median_time_s(forward, device, repeats) if has_work(case.record, "fwd") else None
    bwd_s = None
    if has_work(case.record, "bwd"):
        outputs = [t for t in tree_flatten(forward())[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if outputs:
            outputs += [param.view_as(param) for param in summed]
            grads = [torch.randn_like(t) for t in outputs]

            def clear_grads():
                for leaf in leaves:
                    leaf.grad = None  # the first micro-batch's backward assigns grads, no accumulation

            bwd_s = median_time_s(
                lambda: torch.autograd.backward(outputs, grads, retain_graph=True), device, repeats, clear_grads)
            if device.type == "cuda":
                bwd_s = max(MIN_KERNEL_S, bwd_s - backward_floor_s(device, repeats))
    return OpMeasurement(fwd_s, bwd_s)


def work(record: OpRecord, direction: str, unit: str) -> int:
    """The op's FLOPs or bytes moved in one direction."""
    if unit == "flops":
        return record.fwd_flops if direction == "fwd" else record.bwd_flops
    return record.fwd_bytes if direction == "fwd" else record.bwd_bytes


def unique_cases(cases: list[OpCase]) -> list[OpCase]:
    """First case per key, skipping ops with no work in either direction (the cost model charges 0)."""
    seen: dict[str, OpCase] = {}
    for case in cases:
        if case.key not in seen and (has_work(case.record, "fwd") or has_work(case.record, "bwd")):
            seen[case.key] = case
    return list(seen.values())

