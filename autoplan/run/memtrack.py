"""Peak bytes of live tensors on the CPU, where no allocator keeps statistics.

On CUDA `torch.cuda.max_memory_allocated()` answers the question; on the CPU nothing does, and the
process RSS counts the interpreter, libraries and freed-but-cached pages. This tracker counts what
the cost model counts: bytes of tensor storages that are alive, at every moment, and their peak.

How: a TorchDispatchMode sees every tensor an aten op makes or touches (parameters made by
`to_empty`, gradients, optimizer states, activations, collective buffers; tensor subclasses such as
DTensor are unwrapped to their local tensors). An op on a wrapper subclass is handed on to the subclass
(the mode returns NotImplemented) so that the tracker also sees the ops the subclass runs on its local
tensors: their temporaries are real allocations (loss_parallel's backward holds three fp32 logits shards
inside one DTensor op, which a tracker seeing only the op's output would miss). DTensor also runs ops on
fake tensors of the global shape to learn an output's shape (its sharding propagation): those allocate
nothing, and the tracker looks away while they run. Each storage is counted once, with a weakref finalizer
that subtracts it when the storage is freed. FSDP2 frees and re-allocates gathered parameters by
resizing storages in place, which does not pass through the dispatcher, so `UntypedStorage.resize_`
is wrapped while the tracker is active. Not seen: scratch memory that C++ code allocates without
making a tensor (e.g. inside a gloo collective), and tensors made on other threads outside autograd.

With `limit_bytes`, an allocation that takes the live bytes over the limit raises
MemoryLimitExceeded, the CPU's stand-in for a CUDA out-of-memory error.

`RankMemory` is what a rank of `autoplan apply` measures with: the CUDA allocator's statistics, or this
tracker on the CPU; `allocation_failure` tells an allocator refusing memory (CUDA's OutOfMemoryError, the
CPU allocator's RuntimeError, the tracker's limit) from other errors and says what could not be allocated.
"""

from __future__ import annotations

import re
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from autoplan.sizes import format_bytes

__all__ = ["LiveTensorTracker", "MemoryLimitExceeded", "RankMemory", "allocation_failure"]


class MemoryLimitExceeded(RuntimeError):
    def __init__(self, live_bytes: int, limit_bytes: int):
        super().__init__(f"live tensors reached {live_bytes} bytes, over the limit of {limit_bytes} bytes")
        self.live_bytes = live_bytes
        self.limit_bytes = limit_bytes


def _plain_tensors(tensor: torch.Tensor):
    """The tensors that own memory: a wrapper subclass (DTensor) owns none, its inner tensors do."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        for name in inner_names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh here
                yield from _plain_tensors(inner)
    else:
        yield tensor


def _sharding_propagator() -> type:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    return ShardingPropagator


def _is_wrapper(kind: type) -> bool:
    """A wrapper subclass (DTensor): its __torch_dispatch__ runs the op on inner tensors that own memory."""
    return kind is not torch.Tensor and hasattr(kind, "__tensor_flatten__")


class LiveTensorTracker(TorchDispatchMode):
    """Context manager: `live_bytes` now, `peak_bytes` since entry (or since `reset_peak()`)."""

    def __init__(self, limit_bytes: int | None = None):
        super().__init__()
        self.limit_bytes = limit_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._bytes_by_storage: dict[int, int] = {}  # StorageImpl address -> bytes counted
        # Finalizers can run on another thread (a gloo work object dropping its tensors).
        self._lock = threading.RLock()
        self._original_resize = None
        self._original_propagation = None
        self._looking_away = 0  # > 0 while DTensor derives an output's metadata on fake tensors

    # -- public -------------------------------------------------------------------------------

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made before the tracker was entered (parameters of a built model, ...)."""
        for tensor in tensors:
            self._track_tensor(tensor)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    # -- context ------------------------------------------------------------------------------

    def __enter__(self):
        self._wrap_resize()
        self._wrap_propagation()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unwrap_resize()
            self._unwrap_propagation()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._looking_away:
            return func(*args, **(kwargs or {}))
        if any(_is_wrapper(kind) for kind in types):
            return NotImplemented  # the subclass runs it on its inner tensors, with this mode still active
        out = func(*args, **(kwargs or {}))
        # Outputs are the new allocations; inputs catch tensors made before the tracker started
        # and storages an in-place op (aten.resize_) has grown.
        for value in tree_flatten((out, args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                self._track_tensor(value)
        return out

    # -- bookkeeping --------------------------------------------------------------------------

    def _track_tensor(self, tensor: torch.Tensor) -> None:
        for plain in _plain_tensors(tensor):
            if plain.device.type == "meta" or plain.layout != torch.strided:
                continue
            self._track_storage(plain.untyped_storage())

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        with self._lock:
            if key not in self._bytes_by_storage:
                self._bytes_by_storage[key] = 0
                weakref.finalize(storage, self._forget, key)
            if storage.nbytes() != self._bytes_by_storage[key]:
                self._set_size(key, storage.nbytes())

    def _forget(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._bytes_by_storage.pop(key, 0)

    def _set_size(self, key: int, nbytes: int) -> None:
        grown = nbytes - self._bytes_by_storage[key]
        self._bytes_by_storage[key] = nbytes
        self.live_bytes += grown
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.limit_bytes is not None and grown > 0 and self.live_bytes > self.limit_bytes:
            raise MemoryLimitExceeded(self.live_bytes, self.limit_bytes)

    def _wrap_resize(self) -> None:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            if storage.device.type != "meta":
                tracker._track_storage(storage)
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_

    def _wrap_propagation(self) -> None:
        """DTensor's sharding propagation runs the op on fake tensors of the global shape (to learn the output's
        shape and strides): the tracker looks away while it runs. Where torch has no such method, nothing."""
        propagator = _sharding_propagator()
        original = getattr(propagator, "_propagate_tensor_meta_non_cached", None)
        if original is None:
            return
        tracker = self

        def propagate(self, *args, **kwargs):
            tracker._looking_away += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                tracker._looking_away -= 1

        self._original_propagation = original
        propagator._propagate_tensor_meta_non_cached = propagate

    def _unwrap_propagation(self) -> None:
        if self._original_propagation is not None:
            _sharding_propagator()._propagate_tensor_meta_non_cached = self._original_propagation
            self._original_propagation = None

    def _unwrap_resize(self) -> None:
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize
            self._original_resize = None


class RankMemory:
    """Peak memory per rank: the CUDA allocator's statistics, or live tensors on the CPU."""

    def __init__(self, device: torch.device, limit_bytes: int | None):
        self.device = device
        self.tracker = None
        self._cuda_peaks = (0, 0)  # CUDA's max allocated and reserved before the last reset of its statistics
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            if limit_bytes is not None:  # a real out-of-memory error at the limit
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), device)
            self.source = "torch.cuda.max_memory_allocated"
        else:
            self.tracker = LiveTensorTracker(limit_bytes=limit_bytes)
            self.source = "live tensor storages (autoplan.memtrack)"

    def __enter__(self):
        if self.tracker is not None:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.tracker is not None:
            return self.tracker.__exit__(*exc)
        return False

    def peak_and_reset(self) -> int:
        if self.tracker is not None:
            peak = self.tracker.peak_bytes
            self.tracker.reset_peak()
        else:
            self._cuda_peaks = self.cuda_peaks()
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def cuda_peaks(self) -> tuple[int, int]:
        """CUDA's max_memory_allocated and max_memory_reserved over the whole run: each `peak_and_reset` resets
        torch's statistics, so torch's own figures after it hold only the time since."""
        return (max(self._cuda_peaks[0], torch.cuda.max_memory_allocated(self.device)),
                max(self._cuda_peaks[1], torch.cuda.max_memory_reserved(self.device)))


_CPU_ALLOCATOR = re.compile(r"(?:can't allocate memory|not enough memory): you tried to allocate (\d+) bytes")


def allocation_failure(exc: BaseException) -> str | None:
    """What the allocator could not give, when `exc` is an allocator refusing memory; None otherwise."""
    if isinstance(exc, MemoryLimitExceeded):
        return str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError):  # "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ..."
        return ". ".join(str(exc).split(". ")[:3]).strip()
    if isinstance(exc, MemoryError):
        return "Python could not allocate memory (MemoryError)"
    match = _CPU_ALLOCATOR.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if match:
        return f"could not allocate {format_bytes(int(match.group(1)))} (the CPU allocator: not enough memory)"
    return None
