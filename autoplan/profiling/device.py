"""Device facts (name, memory) and the micro-benchmarks behind a profile's scalar numbers:
copy bandwidth, per-op dispatch overhead, AdamW step throughput."""

from __future__ import annotations

import os
import platform

import torch

from autoplan.profiling.timing import Repeats, median_time_s
from cost_models.options import OPTIMIZERS

FP32_BYTES = 4
# the optimizer whose step the profile times (its rate, `optimizer_bytes_s`, prices every optimizer's
# `touches`); its row in the registry gives the torch class and the elements one step touches
BENCH_OPTIMIZER = "adamw"


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


def adamw_bytes_s(device: torch.device, repeats: Repeats) -> float:
    """AdamW (BENCH_OPTIMIZER; torch's default implementation for the device) bytes touched per second:
    its row's `touches` fp32 words per parameter element per step. The cost model times every optimizer
    at this rate (cost_models.table: touches * master bytes / optimizer_bytes_s)."""
    row = OPTIMIZERS[BENCH_OPTIMIZER]
    numel = _large_bytes(device) // FP32_BYTES // 16
    params = [torch.nn.Parameter(torch.randn(numel // 8, device=device)) for _ in range(8)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = getattr(torch.optim, row.torch_class)(params, lr=1e-4, **row.kwargs)
    optimizer.step()  # allocates the states: not part of a steady-state step
    seconds = median_time_s(optimizer.step, device, repeats)
    return row.touches * FP32_BYTES * numel / seconds
