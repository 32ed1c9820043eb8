"""The device's link to host memory, for a measured profile's `host_link`: what offloading parameters,
gradients and optimizer states to the host (FSDP2's CPUOffloadPolicy) costs on this machine.

Why measured: the pinned copy bandwidth of a GPU depends on the PCIe generation and on the host (a
DGX A100 copies about 25 GB/s each way, a cloud VM behind a PCIe switch can get half that), whether a
copy on its own stream runs alongside a matmul depends on the copy engines, and the optimizer step of
offloaded parameters runs on the host's cores, as many as a rank gets. None of it is on a datasheet.

- CUDA: one large pinned host buffer copied to the device and back (torch.cuda.Event timing, median of
  repeats); a copy on a side stream timed alone, a matmul loop alone and both at once: the copy
  overlaps compute when most of the shorter one hides behind the longer; AdamW stepping fp32 tensors
  on the host with the threads a rank gets (cores / ranks per node); the host's memory.
- CPU: the "device" is the host, so a copy is a memcpy (payload bytes per second of one large copy),
  nothing runs beside compute, the optimizer rate is the device's own, and the host's memory is left
  to the search (it takes this machine's).
"""

from __future__ import annotations

import os

import torch

from autoplan.profiling import device as device_bench
from autoplan.profiling.timing import Repeats, median_time_s

__all__ = ["HOST_COPY_BYTES", "OVERLAP_HIDDEN_THRESHOLD", "measure_host_link", "copy_bytes_s", "copy_overlap"]

HOST_COPY_BYTES = 256 << 20  # one copy: large enough to run at the link's streaming rate
# the copy counts as overlapping compute when at least this fraction of the shorter of copy and matmul
# loop hides behind the longer (copy engines: close to 1; a device that serialises them: close to 0)
OVERLAP_HIDDEN_THRESHOLD = 0.5
MATMUL_SIZE, MATMUL_DTYPE = 4096, torch.bfloat16


def copy_bytes_s(source: torch.Tensor, target: torch.Tensor, device: torch.device, repeats: Repeats) -> float:
    """Payload bytes per second of `target.copy_(source)` (non-blocking where the source or target is
    pinned host memory)."""
    seconds = median_time_s(lambda: target.copy_(source, non_blocking=True), device, repeats)
    return source.numel() * source.element_size() / seconds


def copy_overlap(host: torch.Tensor, on_device: torch.Tensor, device: torch.device, repeats: Repeats) -> dict:
    """How much of a host-to-device copy on a side stream hides behind a matmul loop on the current one:
    {"copy_s", "compute_s", "together_s", "hidden_fraction"}. hidden_fraction = (copy + compute -
    together) / min(copy, compute): 1 when the shorter hides entirely, 0 when they run one after the other."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=MATMUL_DTYPE)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=MATMUL_DTYPE)
    out = torch.empty_like(a)
    side = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)

    def copy():
        side.wait_stream(current)  # starts after the timing event, as the matmuls do
        with torch.cuda.stream(side):
            on_device.copy_(host, non_blocking=True)
        current.wait_stream(side)

    copy_s = median_time_s(copy, device, repeats)
    one_matmul_s = median_time_s(lambda: torch.mm(a, b, out=out), device, repeats)
    count = max(1, round(copy_s / max(one_matmul_s, 1e-9)))

    def compute():
        for _ in range(count):
            torch.mm(a, b, out=out)

    def together():
        side.wait_stream(current)
        with torch.cuda.stream(side):
            on_device.copy_(host, non_blocking=True)
        compute()
        current.wait_stream(side)

    compute_s = median_time_s(compute, device, repeats)
    together_s = median_time_s(together, device, repeats)
    hidden = (copy_s + compute_s - together_s) / max(min(copy_s, compute_s), 1e-12)
    return {"copy_s": copy_s, "compute_s": compute_s, "together_s": together_s, "hidden_fraction": hidden}


def _host_adamw_bytes_s(threads: int, repeats: Repeats) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return device_bench.adamw_bytes_s(torch.device("cpu"), repeats)
    finally:
        torch.set_num_threads(previous)


def host_threads_per_rank(ranks_per_node: int) -> int:
    """The host threads one rank of a node gets for its optimizer step: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))


def measure_host_link(device: torch.device, repeats: Repeats, threads: int,
                      nbytes: int = HOST_COPY_BYTES, device_adamw_bytes_s: float | None = None) -> dict:
    """The fields of cost_models.profile.HostLink for `device`, plus the raw numbers behind them
    ("overlap": copy_overlap's record on CUDA). `threads`: host threads per rank for the optimizer step.
    On the CPU, `device_adamw_bytes_s` (the profile's own optimizer rate, measured with `threads`) is
    reused rather than measured twice."""
    numel = max(1, nbytes // 4)
    if device.type == "cuda":
        host = torch.randn(numel).pin_memory()
        on_device = torch.empty(numel, device=device)
        h2d = copy_bytes_s(host, on_device, device, repeats)
        d2h = copy_bytes_s(on_device, host, device, repeats)
        overlap = copy_overlap(host, on_device, device, repeats)
        del host, on_device
        return {
            "h2d_bytes_s": h2d, "d2h_bytes_s": d2h,
            "overlaps_compute": bool(overlap["hidden_fraction"] >= OVERLAP_HIDDEN_THRESHOLD),
            "cpu_optimizer_bytes_s": _host_adamw_bytes_s(threads, repeats), "cpu_threads": threads,
            "host_mem_bytes": device_bench.device_mem_bytes(torch.device("cpu")),
            "overlap": overlap, "copy_bytes": numel * 4,
        }
    source, target = torch.randn(numel), torch.empty(numel)
    memcpy = copy_bytes_s(source, target, device, repeats)
    rate = device_adamw_bytes_s if device_adamw_bytes_s is not None else _host_adamw_bytes_s(threads, repeats)
    return {
        "h2d_bytes_s": memcpy, "d2h_bytes_s": memcpy, "overlaps_compute": False,
        "cpu_optimizer_bytes_s": rate, "cpu_threads": threads, "host_mem_bytes": None, "copy_bytes": numel * 4,
    }
