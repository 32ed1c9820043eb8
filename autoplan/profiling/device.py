"""Device facts (name, memory) and the micro-benchmarks behind a profile's scalar numbers:
copy bandwidth, per-op dispatch overhead, AdamW step throughput, and (CPU) the first-touch cost of
freshly mapped memory.

Sizes matter on the CPU: the rates of real training steps are those of tensors far larger than the
caches. AdamW timed on 2 MB tensors ran at 10.9 GB/s of state; gpt2 124M's step ran at 2.8 GB/s on
two ranks. Two effects: the ranks share the memory bus (so the rate is timed with one optimizer per
rank stepping at once), and with glibc's default malloc, allocations above its largest mmap threshold
(32 MiB) are mapped fresh each time and pay a page fault per 4 KiB page when first written (0.4-0.7 ms
per MB here), which a heap-recycled small buffer never does (`first_touch_s_per_byte`). `autoplan
profile` measures with freed memory kept mapped, as apply's CPU ranks run (autoplan.run.host_memory):
there a fresh allocation reuses the heap, and the first touch measures about 0."""

from __future__ import annotations

import os
import platform
from concurrent.futures import ThreadPoolExecutor

import torch

from autoplan.profiling.timing import Repeats, median_time_s
from cost_models.options import OPTIMIZERS

FP32_BYTES = 4
# the optimizer whose step the profile times (its rate, `optimizer_bytes_s`, prices every optimizer's
# `touches`); its row in the registry gives the torch class and the elements one step touches
BENCH_OPTIMIZER = "adamw"
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts: larger allocations are always mapped fresh (its
# dynamic threshold rises to the largest freed mapping up to this)
FRESH_MAP_BYTES = 32 << 20
# the CPU optimizer's tensors: larger than the caches, below FRESH_MAP_BYTES (their first touch is priced apart)
CPU_OPTIMIZER_TENSOR_BYTES, CPU_OPTIMIZER_TENSORS = 16 << 20, 4


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_mem_bytes(device: torch.device) -> int:
    """The accelerator's memory, or the host's RAM for the CPU (shared by all ranks on the host)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _large_bytes(device: torch.device) -> int:
    """Big enough to stream from memory rather than from cache."""
    return (1 << 30) if device.type == "cuda" else (256 << 20)


def copy_bandwidth_bytes_s(device: torch.device, repeats: Repeats) -> float:
    """Bytes read + written per second by a large tensor copy."""
    numel = _large_bytes(device) // FP32_BYTES
    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    seconds = median_time_s(lambda: target.copy_(source), device, repeats)
    return 2 * numel * FP32_BYTES / seconds


def op_overhead_s(device: torch.device, repeats: Repeats) -> float:
    """Time of an op with no work to speak of: the dispatch / launch cost every op pays."""
    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    return median_time_s(lambda: torch.add(a, b), device, Repeats(repeats.warmup, 50, 500, 0.01))


def adamw_bytes_s(device: torch.device, repeats: Repeats, concurrent: int = 1) -> float:
    """AdamW (BENCH_OPTIMIZER; torch's default implementation for the device) bytes touched per second:
    its row's `touches` fp32 words per parameter element per step. The cost model times every optimizer
    at this rate (cost_models.table: touches * master bytes / optimizer_bytes_s).

    On the CPU: tensors of 16 MB, out of cache as a model's are, and `concurrent` optimizers (one per rank
    of the host) stepping at once on threads (torch's kernels release the GIL), sharing the memory bus
    as the ranks of a run do; the rate is one optimizer's (a rank's). The first touch of temporaries above
    FRESH_MAP_BYTES is not in it (see first_touch_s_per_byte)."""
    row = OPTIMIZERS[BENCH_OPTIMIZER]
    if device.type == "cpu":
        numel, count = CPU_OPTIMIZER_TENSOR_BYTES // FP32_BYTES, CPU_OPTIMIZER_TENSORS
    else:
        numel, count, concurrent = _large_bytes(device) // FP32_BYTES // 16 // 8, 8, 1
    optimizers = []
    for _ in range(max(1, concurrent)):
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer = getattr(torch.optim, row.torch_class)(params, lr=1e-4, **row.kwargs)
        optimizer.step()  # allocates the states: not part of a steady-state step
        optimizers.append(optimizer)
    if len(optimizers) == 1:
        seconds = median_time_s(optimizers[0].step, device, repeats)
    else:
        with ThreadPoolExecutor(max_workers=len(optimizers)) as pool:
            seconds = median_time_s(lambda: list(pool.map(lambda o: o.step(), optimizers)), device, repeats)
    return row.touches * FP32_BYTES * numel * count / seconds


def first_touch_s_per_byte(device: torch.device, repeats: Repeats) -> float:
    """Seconds per byte that writing a freshly mapped allocation (above FRESH_MAP_BYTES) costs beyond
    writing the same bytes into memory already mapped: the page faults, and the kernel zeroing each
    page. 0 on CUDA (the caching allocator reuses its blocks). The cost model charges it for the CPU's
    large buffers: FSDP2's gathered parameters and reduction buffers, AdamW's temporaries."""
    if device.type != "cpu":
        return 0.0
    numel = 4 * FRESH_MAP_BYTES // FP32_BYTES
    # FSDP2's large buffers are written by casting copies (bf16 parameters in, fp32 gradients out)
    source, warm = torch.randn(numel, dtype=torch.bfloat16), torch.empty(numel)
    warm_s = median_time_s(lambda: warm.copy_(source), device, repeats)
    fresh_s = median_time_s(lambda: torch.empty(numel).copy_(source), device, repeats)
    return max(0.0, fresh_s - warm_s) / (numel * FP32_BYTES)


def device_numbers(device: torch.device, repeats: Repeats, cached, concurrent: int = 1) -> dict[str, float]:
    """The device's own figures for a profile. `cached(key, measure)` returns the measurement cache's value
    for `key`, measuring and storing it when missing; `concurrent`: ranks on this host stepping their
    optimizers at once (CPU)."""
    return {
        "copy_bandwidth_bytes_s": cached("device:copy_bandwidth_bytes_s",
                                         lambda: copy_bandwidth_bytes_s(device, repeats)),
        "dispatch_overhead_s": cached("device:dispatch_overhead_s", lambda: op_overhead_s(device, repeats)),
        "adamw_bytes_s": cached(f"device:adamw_bytes_s:x{concurrent}:large",
                                lambda: adamw_bytes_s(device, repeats, concurrent)),
        "first_touch_s_per_byte": cached("device:first_touch_s_per_byte",
                                         lambda: first_touch_s_per_byte(device, repeats)),
    }
