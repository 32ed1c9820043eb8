"""Offloaded state in a recorded step on fake tensors: which storages live in host memory, so that a replay of the
caching allocator (autoplan.run.allocator_fit) counts only the device's.

Why: the recording runs rank 0 on the CPU, so the host and the device are one memory. FSDP2's CPUOffloadPolicy keeps
an offloaded unit's sharded parameters, its reduced gradients and (the optimizer stepping them where they are) its
optimizer states and the step's temporaries on the host, and copies a shard to the device at each all-gather and a
reduced gradient to the host after each reduce-scatter; with one device those copies are `.to` calls that change
nothing, and every byte lands in the one memory. A replay of that sequence counted the host's bytes as the device's
(a llama2-70b plan that offloads 44 units replayed at twice its device peak).

How: storages are tagged host from three sources, and the rest are the device's.
- The sharded parameters of offloaded units (torch.distributed.fsdp's FSDPParam `_sharded_param_data`), once
  materialised.
- FSDP2's two copies, done for real while recording: in `FSDPParam.all_gather_inputs` a host shard's `.to(device)`
  becomes a copy on the device (the staged shard an offloaded gather holds), and in `foreach_reduce` a reduced
  gradient's `.to("cpu")` becomes a copy on the host (the device's reduction output is freed as on the GPU).
- Whatever an op makes from host tensors alone (0-dimensional tensors aside: the optimizer's step counts are CPU
  scalars beside device tensors on CUDA too): the optimizer's states (`zeros_like` of a host parameter) and
  its temporaries; for foreach ops, element by element, from the first list of tensors.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn as nn

from autoplan.run.fsdp import offloaded_params

__all__ = ["HostStorage"]

_GATHER_COPY = "all_gather_inputs"  # FSDPParam: the shard copied to the device before the all-gather
_REDUCE_COPY = "foreach_reduce"  # _fsdp_collectives: the reduced gradient copied to the host


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


class HostStorage:
    """The host's storages of a recording, by the recorder's event keys (`keys`); `key_of(storage)` gives a live
    storage's current key (None: not recorded)."""

    def __init__(self, key_of):
        self.key_of = key_of
        self.keys: set = set()
        self.active = False

    def is_host(self, tensor: torch.Tensor) -> bool:
        tensor = _plain(tensor)
        if tensor.device.type == "meta" or tensor.layout != torch.strided:
            return False
        return self.key_of(tensor.untyped_storage()) in self.keys

    def tag(self, tensor: torch.Tensor, host: bool = True) -> None:
        key = self.key_of(_plain(tensor).untyped_storage())
        if key is not None:
            (self.keys.add if host else self.keys.discard)(key)

    def tag_offloaded(self, module: nn.Module) -> None:
        """The sharded parameters of `module`'s offloaded units (after materialisation) are the host's; from here
        on ops on them are followed."""
        for param in offloaded_params(module):
            self.tag(param)
        self.active = bool(self.keys)

    def outputs(self, func, args, kwargs, out) -> None:
        """Tag `out` (what `func` made of `args`) host where it is made from host tensors alone."""
        if not self.active or out is None:
            return
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach") and isinstance(out, (list, tuple)):
            first = next((a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)),
                         None)
            if first is not None and len(first) == len(out):
                for made, source in zip(out, first):
                    if isinstance(made, torch.Tensor) and self.is_host(source):
                        self.tag(made)
            return
        inputs = [t for t in _tensors((args, kwargs)) if t.dim() > 0]
        if inputs and all(self.is_host(t) for t in inputs):
            for made in _tensors(out):
                self.tag(made)

    @contextmanager
    def copies(self):
        """FSDP2's copies between host and device, made real (see the module docstring) while the step runs."""
        original = torch.Tensor.to
        tags = self

        def to(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_name
            if tags.active and caller == _GATHER_COPY and tags.is_host(tensor):
                copy = tensor.clone()
                tags.tag(copy, host=False)
                return copy
            if tags.active and caller == _REDUCE_COPY and not tags.is_host(tensor) and _to_cpu(args, kwargs):
                copy = tensor.clone()
                tags.tag(copy)
                return copy
            return original(tensor, *args, **kwargs)

        torch.Tensor.to = to
        try:
            yield
        finally:
            torch.Tensor.to = original


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (torch.device, str)) and torch.device(target).type == "cpu"


def _tensors(tree):
    from torch.utils._pytree import tree_flatten

    return [value for value in tree_flatten(tree)[0] if isinstance(value, torch.Tensor)]
