"""Readable text for a plan: the decision table (consecutive identical units grouped), the memory
breakdown at the peak, the predicted step time, and the speedup over each baseline.

A schema.Plan prints itself with this module (`Plan.table()`), so this module reads plans and their units
(`Plan`, `UnitDecision` below) without importing the schema: the dependency runs one way.
"""

from __future__ import annotations

import re
from typing import Any

from autoplan.sizes import format_bytes

Plan = UnitDecision = Any  # autoplan.plan.schema's records, read by their fields

DEFAULT_CLUSTER_NOTE = "default cluster; set `gpus`, `nodes`, `gpus_per_node` or `profile` to change it"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _decision(unit: UnitDecision) -> str:
    return unit.label + (f" [{unit.tp}]" if unit.tp else "")  # the unit's tensor-parallel layout


def _same_row(a: UnitDecision, b: UnitDecision) -> bool:
    return (_decision(a) == _decision(b) and a.params == b.params
            and _indexless(a.module) == _indexless(b.module))


def _indexless(path: str) -> str:
    return re.sub(r"\.\d+(\.|$)", r".#\1", path)


def _group_label(first: str, last: str, count: int) -> str:
    if count == 1:
        return first or "<root>"
    match_first, match_last = re.search(r"\.(\d+)(\.|$)", first), re.search(r"\.(\d+)(\.|$)", last)
    if match_first and match_last:
        return f"{first[:match_first.start()]}.{match_first.group(1)}-{match_last.group(1)}{first[match_first.end(1):]}"
    return f"{first} .. {last}"


def unit_rows(plan: Plan) -> list[tuple[str, int, UnitDecision]]:
    """(label, count, first unit) for runs of consecutive units with the same decision and shape."""
    rows: list[list] = []
    for unit in plan.units:
        if rows and _same_row(rows[-1][2], unit):
            rows[-1][1] += 1
            rows[-1][3] = unit.module
        else:
            rows.append([unit.module, 1, unit, unit.module])
    return [(_group_label(first, last, count), count, unit) for first, count, unit, last in rows]


def format_plan(plan: Plan, cluster_is_default: bool = False) -> str:
    """The plan as the CLI prints it: the setting, the decisions, memory, time, baselines and the solver."""
    lines = _setting_lines(plan, cluster_is_default) + [""] + _unit_lines(plan) + [""] + _memory_lines(plan)
    return "\n".join(lines + _time_lines(plan) + _solver_lines(plan))


def _setting_lines(plan: Plan, cluster_is_default: bool) -> list[str]:
    """The model and cluster, the limit and the batch, the mesh."""
    c, t = plan.cluster, plan.training
    lines = [
        f"autoplan: {plan.model.name} ({_count(plan.model.n_params)} parameters, traced by {plan.model.tracer}) on "
        f"{c.nodes} node(s) x "
        f"{c.gpus_per_node} GPU(s), profile {c.profile}" + (f" ({DEFAULT_CLUSTER_NOTE})" if cluster_is_default else ""),
        f"memory limit {format_bytes(c.mem_limit_bytes)} per GPU"
        + (f" (above the device's {format_bytes(c.device_mem_bytes)}: `allow_over_device_mem`)"
           if c.mem_limit_bytes > c.device_mem_bytes else "") + f"; sequence length {t.seq_len}; micro-batch "
        f"{t.micro_batch_size} x {t.grad_accum_steps} accumulation x "
        + (f"{c.world_size} GPUs" if c.tp_degree == 1 else f"{c.world_size // c.tp_degree} data-parallel ranks")
        + f" = {t.global_batch_size} samples per step; {t.dtype}, {t.optimizer}",
    ]
    if c.tp_degree > 1:
        lines.append(f"mesh {c.world_size // c.tp_degree} data-parallel x {c.tp_degree} tensor-parallel: the Megatron "
                     "layout inside each group of GPUs of a node" + (" with sequence parallelism" if c.sequence_parallel
                                                                     else "") + ", FSDP over the data-parallel ranks")
    return lines


def _unit_lines(plan: Plan) -> list[str]:
    """The decision table, alike units grouped."""
    header = f"{'units':<34} {'params/unit':>11}  {'decision':<20} {'act/mb':>10} {'fwd ms':>8} {'bwd ms':>8} {'comm ms':>8}"
    lines = [header, "-" * len(header)]
    for label, _count_units, unit in unit_rows(plan):
        pred = unit.predicted
        lines.append(
            f"{label:<34} {_count(unit.params):>11}  {_decision(unit):<20} {format_bytes(pred.activation_bytes):>10} "
            f"{pred.fwd_s * 1e3:>8.2f} {pred.bwd_s * 1e3:>8.2f} {pred.comm_s * 1e3:>8.2f}"
        )
    return lines


def _memory_lines(plan: Plan) -> list[str]:
    """The peak by category, what the caching allocator takes beyond it, and the offloaded state."""
    c, p = plan.cluster, plan.predicted
    b = p.breakdown
    lines = [
        f"peak memory per GPU {format_bytes(p.peak_mem_bytes)} of {format_bytes(c.mem_limit_bytes)}"
        + (f" ({c.mem_headroom:.0%} kept free)" if c.mem_headroom else "") + f", at {p.peak_point}:",
        f"  params {format_bytes(b.params_bytes)} | grads {format_bytes(b.grads_bytes)} | optimizer "
        f"{format_bytes(b.optimizer_bytes)} | activations {format_bytes(b.activations_bytes)} | gathered params "
        f"{format_bytes(b.gathered_bytes)} | temporaries {format_bytes(b.temporaries_bytes)}",
    ]
    if p.reserved_bytes is not None and p.allocator_needed_bytes is None:
        over = p.reserved_bytes > c.mem_limit_bytes
        lines.append(f"reserved (CUDA caching allocator): at most about {format_bytes(p.reserved_bytes)} with its "
                     "rounding, per-stream caches and fragmentation (a bound, 1-19% above the peak in replays; the "
                     "plan is made to the peak" + (", so keep headroom, check a first step or search with --fit-allocator)"
                                                        if over else ")"))
    if p.allocator_needed_bytes is not None:
        lines.append(f"caching allocator, replayed: the step runs in a limit of {format_bytes(p.allocator_needed_bytes)} "
                     "(its allocations on fake tensors, kernel workspaces allowed for)")
    if p.host_mem_bytes:
        of = f" of {format_bytes(c.host_mem_bytes)}" if c.host_mem_bytes else ""
        lines.append(f"host memory (offloaded state, pinned) {format_bytes(p.host_mem_bytes)} per GPU, "
                     f"{format_bytes(p.host_mem_per_node_bytes)} per node{of}")
    return lines


def _time_lines(plan: Plan) -> list[str]:
    """The predicted step time and throughput, and the speed-up over each baseline."""
    p = plan.predicted
    lines = [
        f"predicted step time {p.step_time_s * 1e3:.1f} ms; throughput {p.throughput_samples_s:.1f} samples/s "
        f"({p.throughput_tokens_s:,.0f} tokens/s)",
    ]
    for base in plan.baselines:
        if base.fits:
            lines.append(f"  vs {base.name:<15} (micro-batch {base.micro_batch_size}): "
                         f"{p.throughput_samples_s / base.throughput_samples_s:.2f}x")
        else:
            lines.append(f"  vs {base.name:<15} does not fit (needs {format_bytes(base.peak_mem_bytes)} "
                         f"at micro-batch {base.micro_batch_size})")
    return lines


def _solver_lines(plan: Plan) -> list[str]:
    """The solver's verdict, the micro-batches tried, and each tensor-parallel degree's best."""
    s = plan.solver
    tried = ", ".join(f"{e.micro_batch_size}:{e.status.lower()}" for e in s.micro_batch_sweep)
    gap_pct = 100 * (s.objective_s - s.bound_s) / s.objective_s if s.objective_s else 0.0
    gap = f", optimality gap {gap_pct:.3f}%" if gap_pct > 0 else ""
    wall = plan.solver_wall_time_s
    took = f" in {wall:.2f} s" if wall is not None else ""
    lines = [f"solver: {s.status}{gap}{took} ({s.num_variables} variables); micro-batches tried {tried}"]
    if s.tp_degrees:
        lines.append("tensor-parallel degrees (the fastest plan that fits of each):")
        for e, wall in zip(s.tp_degrees, plan.tp_degree_wall_times_s(), strict=True):
            name = f"tp {e.degree}" + (" +sp" if e.sequence_parallel else "")
            found = (f"micro-batch {e.micro_batch_size} x {e.grad_accum_steps}: {e.step_time_s * 1e3:.1f} ms, "
                     f"{e.throughput_samples_s:.1f} samples/s, peak {format_bytes(e.peak_mem_bytes)}" if e.fits
                     else e.note)
            lines.append(f"  {name:<10} {found}" + (f" ({wall:.1f} s)" if wall is not None else ""))
    return lines
