"""A CPU rank keeps the memory it frees mapped, as CUDA's caching allocator keeps its blocks.

Why: with glibc's default malloc a CPU training step does not run at a rate its ops can be timed at.
Tensors above the dynamic mmap threshold (up to 32 MiB) are mapped fresh at every allocation, and the
heap is trimmed back to the system whenever its free top grows past twice that threshold, so the next
step maps it again; each fresh 4 KiB page costs a page fault on first write. How much of a step pays it
depends on the order in which tensors happened to be freed: on this project's 2-core machine a TP 2 step
of a 4-block Llama with a 32k vocabulary took 6,000-20,000 faults per phase, 0 to 50 ms, step to step,
and gpt2 124M's step 3.3 s where the same step with freed memory kept mapped takes 2.55 s. A GPU run
does not pay this after its first step (the caching allocator keeps its segments), and the cost model
prices a step as a GPU's: ops at their timed rate, no faults. So `autoplan apply`'s CPU ranks and `autoplan
profile`'s CPU measurements ask malloc to keep what it frees (mallopt: no mmap
for large blocks, no trimming of the heap). Memory the process holds (its RSS) then stays at its
high-water mark, as CUDA's reserved memory does; the tensors alive, which the memory model predicts, are
unchanged. The heap reaches what a step needs only after a few steps, and now and then grows a block
again (torch allocates with posix_memalign, whose padding can leave a freed block a little short of
the next request of the same size), so the first steps still fault: apply's warm-up steps take them.

Only glibc has these knobs; elsewhere (musl, macOS) nothing is changed and `keep_freed_memory` says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["FIRST_TOUCH_KEPT", "keep_freed_memory"]

# what a profile measured with freed memory kept says of its first-touch figure (DeviceProfile.first_touch_*)
FIRST_TOUCH_KEPT = ("0: measured with freed memory kept mapped, as apply's CPU ranks run (autoplan/run/host_memory.py); "
                    "after a rank's first steps its large buffers reuse the heap's pages (no fault), where glibc's "
                    "default maps them fresh at every allocation (0.16-0.28 ms per MB on this project's machine)")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before a trim, in effect never
_TOP_PAD = 64 << 20  # grow the heap 64 MiB at a time beyond the request


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from the heap and never give the heap's top back, for
    the rest of this process. True where it took effect; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM), (_M_TOP_PAD, _TOP_PAD)))
