"""Counting what each op costs while a model runs on the meta device.

`CostMode` is a TorchDispatchMode that charges every aten op's FLOPs (torch's FlopCounter formulas, with
the ones autoplan registers: see flops) and bytes moved to the op of the model that is running (an fx
node, or a module call seen by the dispatch tracer), notes the aten ops no formula prices (unpriced,
never silently free), and follows the storages the backward allocates and frees;
`saved_tensor_recorder` catches what autograd saves for backward, once per storage. Both tracers
(`fx_tracer`, `dispatch_tracer`) run the model under these and differ only in how they name the
running op.

Attention runs as the kernel that is priced (autoplan.tracing.attention), not as the math path a meta
tensor would take; an attention kernel that visits only part of the score matrix (a sliding window)
scales its FLOPs through `CostMode.scale_next`. Mixture-of-experts expert matmuls (aten._grouped_mm)
take `expert_flop_scale`, the capacity factor.
"""

from __future__ import annotations

import copy
import hashlib
import traceback
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoplan.models.loss import logits_of, training_loss
from autoplan.tracing.flops import FLASH_CPU, FLASH_CPU_BWD, GROUPED_MM, MATMUL_OPS, aten_flops, unpriced_guess
from cost_models.records import LOSS_NODE, OpRecord

__all__ = [
    "DTYPES", "CostMode", "saved_tensor_recorder", "op_variant", "summed_grad_params", "default_inputs",
    "logits_of", "training_loss", "fill_forward_transients", "fill_backward_liveness", "clear_grads", "needs_copy",
    "storage_key", "tensor_bytes", "BackwardAttribution", "to_meta",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_aten = torch.ops.aten


def storage_key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CostMode(TorchDispatchMode):
    """Charges each aten op's FLOPs and bytes to the current fx node (forward or backward bucket)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless told otherwise: nothing
        # here is compiled, and the wrapper costs a frame-callback swap on every aten op
        return False

    def __init__(self, records: dict[str, OpRecord], progress: Callable[[OpRecord, bool], None] | None = None):
        super().__init__()
        self.records = records
        self.progress = progress  # told of each op that starts running, forward and backward
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
        self.expert_flop_scale = 1.0  # the capacity factor: expert matmuls priced for that many more rows
        self._next_scale = 1.0  # for the next attention kernel (scale_next), and its backward by its output
        self._attention_scales: dict[int, float] = {}

    def scale_next(self, scale: float) -> None:
        """The next flash-attention kernel (and its backward) does `scale` of torch's FLOP count."""
        self._next_scale = scale

    def _scaled(self, func, args, out, flops: int) -> int:
        if func is FLASH_CPU:
            scale, self._next_scale = self._next_scale, 1.0
            if scale != 1.0:
                self._attention_scales[storage_key(out[0])] = scale
            return int(flops * scale)
        if func is FLASH_CPU_BWD:
            return int(flops * self._attention_scales.get(storage_key(args[4]), 1.0))
        if func._overloadpacket is GROUPED_MM and self.expert_flop_scale != 1.0:
            return int(flops * self.expert_flop_scale)
        return flops

    def _note_unpriced(self, record: OpRecord, func, args, kwargs, outputs) -> None:
        guess = unpriced_guess(func, args, kwargs, outputs)
        if guess is None:
            return
        name = f"{func._overloadpacket._qualified_op_name.replace('::', '.')}"
        if name not in record.unpriced.split(","):
            record.unpriced = ",".join(filter(None, (record.unpriced, name)))
        record.unpriced_flops += guess

    @property
    def current(self) -> str:
        return self._current

    @current.setter
    def current(self, name: str) -> None:
        self._current = name
        if self.backward:
            self.bwd_events.append(("enter", name))
        if self.progress is not None and name in self.records:
            self.progress(self.records[name], self.backward)

    def read(self, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        """(storage key, bytes) of an op's tensor inputs. Their storages are kept alive: an input that no
        op produced (a constant, an empty cache tensor) could otherwise be freed and its key taken by a
        later op's output, which would then seem to have produced it."""
        storages = [tensor.untyped_storage() for tensor in tensors]
        self.keep_alive.extend(storages)
        return [(StorageWeakRef(storage).cdata, storage.nbytes()) for storage in storages]

    def _track_backward_alloc(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
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
        flops = self._scaled(func, args, out, aten_flops(func, args, kwargs, out))
        moved = 0
        if not func.is_view and func._overloadpacket not in (_aten.detach, _aten.lift_fresh):
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            moved = sum(map(tensor_bytes, inputs)) + sum(map(tensor_bytes, outputs))
            if flops == 0:
                self._note_unpriced(record, func, args, kwargs, outputs)
            if self.backward:
                for tensor in outputs:
                    self._track_backward_alloc(tensor)
            else:
                largest = max(map(tensor_bytes, outputs), default=0)
                record.fwd_max_alloc_bytes = max(record.fwd_max_alloc_bytes, largest)
                for tensor in outputs:
                    self.keep_alive.append(tensor.untyped_storage())
                    key = storage_key(tensor)
                    self.storage_producer.setdefault(key, self.current)
                    self.storage_bytes.setdefault(key, tensor.untyped_storage().nbytes())
                    self.fwd_allocs.setdefault(self.current, []).append(key)
        if self.backward:
            record.bwd_flops += flops
            record.bwd_bytes += moved
        else:
            record.fwd_flops += flops
            record.fwd_bytes += moved
        if func._overloadpacket in MATMUL_OPS:
            self.matmul_flops[self.current] = self.matmul_flops.get(self.current, 0) + flops
        return out


class BackwardAttribution:
    """Attributes backward work to ops: a pre-hook on the grad_fn of each op's outputs makes that op the
    current one when its backward starts.

    It also frees the autograd graph safely. A graph whose nodes carry Python hooks is freed recursively,
    node after node, when its last tensor goes: for a model of 2000 layers (some 60,000 hooked nodes)
    that overflowed the C stack and segfaulted. So every hooked node is held here, and `release`, called
    once the graph's tensors are gone, lets go of them newest first: each then frees only the unhooked
    nodes between it and the next older hooked one, which is still held.
    """

    def __init__(self, mode: CostMode):
        self.mode = mode
        self.nodes: list = []

    def attach(self, name: str, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.grad_fn is not None:
                node = tensor.grad_fn
                node.register_prehook(self._prehook(name))
                self.nodes.append(node)

    def _prehook(self, name: str):
        def prehook(grad_outputs):
            self.mode.current = name
        return prehook

    def release(self, error: BaseException | None = None) -> None:
        """Free the graph, newest node first. With `error`, the frames in its traceback (the model's
        forward, holding its tensors) are cleared first, so that the graph is not freed later at once."""
        if error is not None:
            traceback.clear_frames(error.__traceback__)
        while self.nodes:
            self.nodes.pop()


def to_meta(model: nn.Module, dtype: str) -> nn.Module:
    """The model on the meta device in `dtype`: a copy, or the model itself when it is that already."""
    return copy.deepcopy(model).to(device="meta", dtype=DTYPES[dtype]) if needs_copy(model, dtype) else model


def saved_tensor_recorder(model: nn.Module, mode: CostMode):
    """A saved_tensors_hooks pack function that records each storage saved for backward, once, for
    the op that saved it first (mode.current); parameters are not activations. Returns (saved, pack):
    saved maps storage key -> (bytes, op name)."""
    param_storages = {storage_key(p) for p in model.parameters()}
    saved: dict[int, tuple[int, str]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not mode.backward:
            storage = storage_key(tensor)
            if storage not in param_storages and storage not in saved:
                saved[storage] = (tensor.untyped_storage().nbytes(), mode.current)
        return tensor

    return saved, pack


_MAX_VARIANT_CHARS = 160


def op_variant(module: nn.Module | None, args=(), kwargs=None, summed_grads: int = 0) -> str:
    """Two ops with the same kind and input shapes can differ in work: Linear(64, 64) and Linear(64, 512)
    both read [B, S, 64]. The module's extra_repr, or the function's non-tensor arguments, tell them apart;
    `summed_grads` (see summed_grad_params) marks an op whose backward also sums a tied parameter's
    gradients, which the same op on an untied parameter does not."""
    if module is not None:
        detail = module.extra_repr() or ",".join(
            f"{name}={'x'.join(map(str, p.shape))}" for name, p in module.named_parameters())
    else:
        def constants(value) -> list[str]:
            return [repr(leaf) for leaf in tree_flatten(value)[0] if not isinstance(leaf, torch.Tensor)]

        detail = ",".join(constants(args) + [f"{k}={','.join(constants(v))}" for k, v in (kwargs or {}).items()])
    if len(detail) > _MAX_VARIANT_CHARS:
        detail = hashlib.sha1(detail.encode()).hexdigest()[:16]
    return (f"({detail})" if detail else "") + (f"[grads summed: {summed_grads}]" if summed_grads else "")


def summed_grad_params(uses: list[tuple[str, list[int]]]) -> dict[str, set[int]]:
    """Per op, the parameters it uses that an op later in the forward uses too (a tied weight: gpt2's
    embedding and LM head); `uses`: (op name, ids of the parameters it uses) in forward order. The
    backward runs them in reverse, so the later user's gradient comes first and autograd adds the
    earlier user's to it, out of place, into a fresh buffer of the parameter's size, within the earlier
    user's backward (CostMode charges the add to it). Timed alone (autoplan profile) an op pays that
    only with the gradient pending: the count is part of its key (op_variant); profiling.ops times it so."""
    later: set[int] = set()
    summed: dict[str, set[int]] = {}
    for name, params in reversed(uses):
        summed[name] = set(params) & later
        later.update(params)
    return summed


def default_inputs(model: nn.Module, micro_batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Token ids [micro_batch, seq_len], the input of every zoo model (and most language models)."""
    return (torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta"),)


def fill_forward_transients(records: dict[str, OpRecord], mode: CostMode, saved: dict[int, tuple[int, str]],
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


def fill_backward_liveness(records: dict[str, OpRecord], mode: CostMode, model: nn.Module) -> None:
    """Replays the backward's allocations and frees (mode.bwd_events): each op's bwd_in_bytes and
    bwd_live_bytes count the backward's storages alive when its backward starts and at most while it
    runs (the gradient it receives, those it produces, its temporaries, the gradients of other ops
    not consumed yet); the parameter gradients (the storages left in .grad) count apart, for the op
    that computed them, in param_grad_bytes. Saved activations are not here: the cost model frees
    them op by op from saved_bytes."""
    param_grads = {mode.bwd_live.get(storage_key(p.grad)) for p in model.parameters() if p.grad is not None}
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


def clear_grads(model: nn.Module) -> None:
    """A model traced again (one already on meta) must not accumulate into the last trace's gradients."""
    for param in model.parameters():
        param.grad = None


def needs_copy(model: nn.Module, dtype: str) -> bool:
    return any(p.device.type != "meta" or p.dtype != DTYPES[dtype] for p in model.parameters())
