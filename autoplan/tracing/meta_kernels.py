"""Tracing without importing torch._dynamo: a third of a cold search's start-up.

Many aten ops run on the meta device through torch's Python reference kernels (torch._refs: `add`, `mul`,
`true_divide`, ...). torch wraps each in `torch._disable_dynamo` (torch/_compile.py), which on the kernel's
first call imports torch._dynamo (0.8 s here; under load 2.5 s) to wrap it in `torch._dynamo.disable`, and
from then on runs every call through that wrapper's frame-evaluation switch. A trace compiles nothing, so
neither is needed: the wrapper takes a kernel's `__dynamo_disable` attribute as its disabled form when it is
set, and `plain_meta_kernels` sets it to the kernel itself while a trace runs, on every wrapped kernel that has
none yet, and takes it away afterwards (a torch.compile later in the same process wraps them as torch
would). When torch._dynamo is already imported (something in the process compiles), nothing is changed.

The kernels are found as the wrapper's closures among the objects the garbage collector tracks (torch
makes a few hundred of them at import: every reference kernel and decomposition); a kernel made after the
search is wrapped as torch does it, on its first call.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["plain_meta_kernels"]

_ATTRIBUTE = "__dynamo_disable"  # what torch._compile._disable_dynamo's wrapper reads (the pinned torch 2.13)


def _wrapped_kernels() -> list:
    """The functions torch._disable_dynamo has wrapped, each wrapper's `fn`."""
    import torch._compile

    probe = torch._compile._disable_dynamo(lambda: None)
    code = probe.__code__
    if "fn" not in code.co_freevars:  # another torch: leave it as it is
        return []
    cell = code.co_freevars.index("fn")
    kernels = []
    for obj in gc.get_objects():
        if type(obj) is type(probe) and obj.__code__ is code and obj is not probe:
            kernels.append(obj.__closure__[cell].cell_contents)
    return kernels


@contextmanager
def plain_meta_kernels() -> Iterator[None]:
    """While the block runs, torch's reference kernels run as themselves, with torch._dynamo not imported."""
    if "torch._dynamo" in sys.modules:
        yield
        return
    marked = []
    for kernel in _wrapped_kernels():
        if getattr(kernel, _ATTRIBUTE, None) is None:
            setattr(kernel, _ATTRIBUTE, kernel)
            marked.append(kernel)
    try:
        yield
    finally:
        for kernel in marked:
            if getattr(kernel, _ATTRIBUTE, None) is kernel:
                delattr(kernel, _ATTRIBUTE)
