"""FSDP2's own costs, measured on the ranks of the collective benchmark: what a unit costs beyond its
ops and its collectives, what the optimizer step costs per parameter tensor, and whether FSDP2 hides
its collectives behind compute on this device. The per-unit numbers measured here on tiny units are
kept for the record; the profile's per-unit cost is fitted on whole training steps (calibration.py),
which also catch what tiny units cannot (on CPU + gloo, compute slowing while ranks communicate).

A stack of K identical units (one Linear each, `fully_shard` per unit and on the root, bf16-mixed as
`autoplan apply` runs it) is timed forward, backward and through an AdamW step, at two depths; the
slope over K is one unit's cost. The same stack without FSDP gives the ops' share, and the unit's
collectives timed on their own (one all-gather, one reduce-scatter of its gathered size) give theirs:

    fsdp_unit_fwd_s = slope_fwd(FSDP) - slope_fwd(plain) - all_gather
    fsdp_unit_bwd_s = slope_bwd(FSDP) - slope_bwd(plain) - all_gather - reduce_scatter
    optimizer_tensor_s = slope_step(FSDP) / tensors per unit   (the bytes' share is negligible here)

Tiny units (width TINY_WIDTH) make those overheads stand out. Overlap is then read off wide units,
whose compute and all-gather are of similar length: where FSDP2 overlaps them (CUDA streams) a wide
unit's forward costs less than ops + collectives + overhead; where it does not (CPU: no streams, the
gloo all-gather is waited on before the unit runs) it costs the sum. The fraction hidden,
(ops + comm + overhead - measured) / min(ops, comm), is reported; overlap counts as enabled above 1/2.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.profiling.timing import Repeats, synchronize

__all__ = ["DEPTHS", "FSDP_CALLS", "OVERLAP_THRESHOLD", "measure_fsdp"]

DEPTHS = (2, 8)
TINY_WIDTH, TINY_TOKENS = 32, 8
WIDE = {"cpu": (512, 256), "cuda": (4096, 4096)}  # (width, tokens): compute ~ all-gather time
OVERLAP_THRESHOLD = 0.5
FSDP_CALLS = 10  # timed calls per phase and stack (every rank makes the same number: they hold collectives)


class _Unit(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _Stack(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(_Unit(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _build(depth: int, width: int, device: torch.device, fsdp: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _Stack(depth, width).to(device)
    if fsdp:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        model.to(torch.bfloat16)
    return model


def _median_s(fn, device: torch.device, repeats: Repeats, calls: int, before_each=None) -> float:
    """Median seconds per call over `calls` timed calls after the warm-up. Every rank makes the same
    number of calls (they hold collectives), so the count is fixed, not a time budget."""
    times = []
    for index in range(repeats.warmup + calls):
        if before_each:
            before_each()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if index >= repeats.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _group_max(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _phase_times(depth: int, width: int, tokens: int, device: torch.device, fsdp: bool,
                 repeats: Repeats, calls: int) -> dict[str, float]:
    """Median seconds of forward, backward and optimizer step of one stack, the slowest rank's."""
    model = _build(depth, width, device, fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(tokens, width, device=device, dtype=torch.float32 if fsdp else torch.bfloat16)
    state = {}

    def forward():
        state["loss"] = model(x).float().square().mean()

    def backward():
        state["loss"].backward()

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward(), backward(), step()  # optimizer states exist from here on
    out = {
        "fwd": _median_s(forward, device, repeats, calls),
        "bwd": _median_s(backward, device, repeats, calls, before_each=forward),
        "step": _median_s(step, device, repeats, calls, before_each=lambda: (forward(), backward())),
    }
    dist.barrier()
    return {phase: _group_max(seconds, device) for phase, seconds in out.items()}


def _collective_times(width: int, device: torch.device, repeats: Repeats, calls: int) -> dict[str, float]:
    """One unit's all-gather (bf16 parameters) and reduce-scatter (fp32 gradients), timed alone."""
    world = dist.get_world_size()
    numel = -(-(width * width + width) // world) * world
    full16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
    shard16 = torch.randn(numel // world, device=device).to(torch.bfloat16)
    full32, shard32 = torch.randn(numel, device=device), torch.empty(numel // world, device=device)
    times = {
        "all_gather": _median_s(lambda: dist.all_gather_into_tensor(full16, shard16), device, repeats, calls),
        "reduce_scatter": _median_s(lambda: dist.reduce_scatter_tensor(shard32, full32), device, repeats, calls),
    }
    return {name: _group_max(seconds, device) for name, seconds in times.items()}


def _slopes(width: int, tokens: int, device: torch.device, fsdp: bool, repeats: Repeats,
            calls: int) -> dict[str, float]:
    low, high = (_phase_times(d, width, tokens, device, fsdp, repeats, calls) for d in DEPTHS)
    return {phase: (high[phase] - low[phase]) / (DEPTHS[1] - DEPTHS[0]) for phase in low}


def measure_fsdp(device: torch.device, repeats: Repeats, calls: int = FSDP_CALLS) -> dict[str, float | bool]:
    """Per-unit FSDP2 overheads, per-tensor optimizer overhead and the overlap verdict (see the module
    docstring), each phase timed `calls` times; every rank of the default group calls it."""
    tiny_fsdp = _slopes(TINY_WIDTH, TINY_TOKENS, device, True, repeats, calls)
    tiny_plain = _slopes(TINY_WIDTH, TINY_TOKENS, device, False, repeats, calls)
    tiny_comm = _collective_times(TINY_WIDTH, device, repeats, calls)
    unit_fwd = max(0.0, tiny_fsdp["fwd"] - tiny_plain["fwd"] - tiny_comm["all_gather"])
    unit_bwd = max(0.0, tiny_fsdp["bwd"] - tiny_plain["bwd"] - tiny_comm["all_gather"] - tiny_comm["reduce_scatter"])
    tensor_s = max(0.0, tiny_fsdp["step"] / 2)  # weight and bias

    width, tokens = WIDE[device.type]
    wide_fsdp = _slopes(width, tokens, device, True, repeats, calls)
    wide_plain = _slopes(width, tokens, device, False, repeats, calls)
    wide_comm = _collective_times(width, device, repeats, calls)
    serial = wide_plain["fwd"] + wide_comm["all_gather"] + unit_fwd
    hidden = (serial - wide_fsdp["fwd"]) / max(min(wide_plain["fwd"], wide_comm["all_gather"]), 1e-9)
    return {
        "unit_fwd_s": unit_fwd,
        "unit_bwd_s": unit_bwd,
        "optimizer_tensor_s": tensor_s,
        "overlap_hidden_fraction": hidden,
        "overlap_enabled": bool(hidden > OVERLAP_THRESHOLD),
        # the raw numbers, for the record
        "tiny_fsdp": tiny_fsdp, "tiny_plain": tiny_plain, "tiny_comm": tiny_comm,
        "wide_fsdp": wide_fsdp, "wide_plain": wide_plain, "wide_comm": wide_comm,
    }
