"""Readable text for a plan: the decision table (alike units grouped, as pins group them), the memory
breakdown at the peak, the predicted step time, and the speedup over each baseline.

A schema.Plan prints itself with this module (`Plan.table()`), so this module reads plans and their units
(`Plan`, `UnitDecision` below) without importing the schema: the dependency runs one way.
"""

from __future__ import annotations

import re
from typing import Any

from autoplan.pins import path_groups
from autoplan.plan.pipeline_report import pipeline_lines
from autoplan.plan.replay_obstacle import ReplayObstacle, replay_obstacle
from autoplan.sizes import format_bytes
from cost_models.allocator_conf import unmodelled_options

Plan = UnitDecision = ModelRef = Any  # autoplan.plan.schema's records, read by their fields

DEFAULT_CLUSTER_NOTE = "default cluster; set `gpus`, `nodes`, `gpus_per_node` or `profile` to change it"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _decision(unit: UnitDecision) -> str:
    return unit.label + (f" [{unit.tp}]" if unit.tp else "")  # the unit's tensor-parallel layout


def unit_rows(plan: Plan) -> list[tuple[str, int, UnitDecision]]:
    """(label, count, first unit) for the units with the same decision and size whose paths differ only in a block
    index, wherever they stand (alternating decisions make two rows, `layers.0-94/2` and `layers.1-95/2`), in the
    order of each group's first unit; the label is the group as a pins pattern."""
    first_of = {}
    keyed = []
    for unit in plan.units:
        key = (_decision(unit), unit.params)
        keyed.append((unit.module, key))
        first_of.setdefault((unit.module, key), unit)
    return [(label, len(paths), first_of[(paths[0], key)]) for label, paths, key in path_groups(keyed)]


def _flops(count: int) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} FLOP"


def has_sequence(model: ModelRef) -> bool:
    """Whether the model's inputs have a sequence (token ids do; named inputs where one names `seq`)."""
    return model.inputs is None or any("seq" in re.split(r"[\[\],]", item) for item in model.inputs.split())


def sequence_text(model: ModelRef, seq_len: int) -> str:
    return f"sequence length {seq_len}" if has_sequence(model) else "no sequence"


def throughput_text(model: ModelRef, samples_s: float, tokens_s: float) -> str:
    return f"throughput {samples_s:.1f} samples/s" + (f" ({tokens_s:,.0f} tokens/s)" if has_sequence(model) else "")


def pricing_lines(model: ModelRef) -> list[str]:
    """How the model was priced: its inputs, each run of attention calls with its kernel, the ops no formula
    prices."""
    lines = [f"inputs: {model.inputs}"] if model.inputs else []
    asked = f"{model.attention_request}, asked" if model.attention_request else "torch's pick on the profile's device"
    if model.attention:
        where = (lambda row: f" in {row.modules}") if len(model.attention) > 1 else (lambda row: f", {row.count} calls")
        lines.append(f"attention ({asked}): " + "; ".join(f"{row.kernel} ({row.detail})" + where(row)
                                                          for row in model.attention))
    if model.capacity_factor != 1.0:
        lines.append(f"mixture-of-experts expert matmuls priced at capacity factor {model.capacity_factor:g}")
    for row in model.unpriced:
        lines.append(f"unpriced: {row.op} in {row.modules} ({row.count} calls; about {_flops(row.flops_guess)} per "
                     "sample by a guess) is not timed" + (" (`allow_unpriced`)" if model.allow_unpriced else ""))
    return lines


def format_plan(plan: Plan, cluster_is_default: bool = False) -> str:
    """The plan as the CLI prints it: the setting, the decisions, memory, time, baselines and the solver."""
    lines = _setting_lines(plan, cluster_is_default) + [""] + _unit_lines(plan) + [""] + _memory_lines(plan)
    return "\n".join(lines + _time_lines(plan) + pipeline_lines(plan) + _solver_lines(plan))


def _setting_lines(plan: Plan, cluster_is_default: bool) -> list[str]:
    """The model and cluster, the limit and the batch, the mesh."""
    c, t = plan.cluster, plan.training
    lines = [
        f"autoplan: {plan.model.name} ({_count(plan.model.n_params)} parameters, traced by {plan.model.tracer}) on "
        f"{c.nodes} node(s) x "
        f"{c.gpus_per_node} GPU(s), profile {c.profile}" + (f" ({DEFAULT_CLUSTER_NOTE})" if cluster_is_default else ""),
        f"memory limit {format_bytes(c.mem_limit_bytes)} per GPU"
        + (f" (above the device's {format_bytes(c.device_mem_bytes)}: `allow_over_device_mem`)"
           if c.mem_limit_bytes > c.device_mem_bytes else "")
        + f"; {sequence_text(plan.model, t.seq_len)}; micro-batch "
        f"{t.micro_batch_size} x {t.grad_accum_steps} accumulation x "
        + (f"{c.world_size} GPUs" if c.tp_degree == c.cp_degree == c.pp_degree == 1
           else f"{c.world_size // (c.tp_degree * c.cp_degree * c.pp_degree)} data-parallel ranks")
        + f" = {t.global_batch_size} samples per step; {t.dtype}, {t.optimizer}",
        *pricing_lines(plan.model),
    ]
    if c.pp_degree > 1:
        lines.append(f"mesh {c.pp_degree} pipeline x {c.world_size // c.pp_degree // c.tp_degree} data-parallel"
                     + (f" x {c.tp_degree} tensor-parallel" if c.tp_degree > 1 else "") + ": stages of "
                     + ("whole nodes" if c.world_size // c.pp_degree >= c.gpus_per_node else "parts of a node")
                     + ", FSDP over each stage's data-parallel ranks, gathered once per step")
    elif c.tp_degree > 1:
        lines.append(f"mesh {c.world_size // c.tp_degree} data-parallel x {c.tp_degree} tensor-parallel: the Megatron "
                     "layout inside each group of GPUs of a node" + (" with sequence parallelism" if c.sequence_parallel
                                                                     else "") + ", FSDP over the data-parallel ranks")
    if plan.experts is not None:
        lines.append(expert_line(plan.experts))
    return lines + context_lines(plan)


def expert_line(e) -> str:
    """What the plan's expert parallelism costs and saves (autoplan.plan.expert_spec)."""
    where = "inside a node" if e.scope == "intra_node" else "across nodes"
    return (f"experts split {e.degree}-way ({e.experts_per_rank} per rank of each of {e.stacks} stacks, FSDP over the "
            f"{e.expert_shard} rank(s) holding the same): all-to-alls of {format_bytes(e.all_to_all_bytes)} {where}, "
            f"{e.all_to_all_s * 1e3:.1f} ms per step; a gathered stack {format_bytes(e.gathered_stack_bytes)} "
            f"instead of {format_bytes(e.gathered_stack_bytes_fsdp_only)}")


def _unit_lines(plan: Plan) -> list[str]:
    """The decision table, alike units grouped."""
    header = (f"{'units':<34} {'params/unit':>11}  {'decision':<20} {'act/mb':>10} {'fwd ms':>8} {'bwd ms':>8} "
              f"{'comm ms':>8}")
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
    lines += _allocator_lines(plan)
    if p.host_mem_bytes:
        of = f" of {format_bytes(c.host_mem_bytes)}" if c.host_mem_bytes else ""
        lines.append(f"host memory (offloaded state, pinned) {format_bytes(p.host_mem_bytes)} per GPU, "
                     f"{format_bytes(p.host_mem_per_node_bytes)} per node{of}")
    return lines


def _allocator_lines(plan: Plan) -> list[str]:
    """On CUDA: what torch's caching allocator needs to run the step and reserves, and which figure the plan fits
    its limit with (older plans carry a reserved bound only)."""
    c, p = plan.cluster, plan.predicted
    lines = []
    if p.needed_bytes is not None:
        alone = "the plan is fitted to the live bytes alone (--fit-to allocated)"
        fitted = ("the plan is fitted to this" if c.mem_fitted_to == "needed" else
                  f"{alone}: it may run out on the GPU" if p.needed_bytes > c.mem_limit_bytes else alone)
        lines.append(f"needed (CUDA caching allocator, {c.allocator_conf}): {format_bytes(p.needed_bytes)}, the live "
                     f"peak with the allocator's rounding, per-stream pages and kernel workspaces (a bound); {fitted}")
        if caveat := unmodelled_text(c.allocator_conf):
            lines.append(f"  {caveat}")
        device = ", the device's memory" if reserved_is_device(plan) else ""
        lines.append(f"reserved: up to {format_bytes(p.reserved_bytes)}{device} (torch.cuda.max_memory_reserved with "
                     "memory to spare: freed blocks stay cached until the allocator runs short, then it frees them)")
    elif p.reserved_bytes is not None and p.allocator_needed_bytes is None:  # a plan of autoplan 0.1
        lines.append(f"reserved (CUDA caching allocator): at most about {format_bytes(p.reserved_bytes)} (the plan is "
                     "made to the peak; search again to fit what the allocator needs)")
    if p.allocator_needed_bytes is not None:
        lines.append("caching allocator, replayed: the step runs in a limit of "
                     f"{format_bytes(p.allocator_needed_bytes)} (its allocations on fake tensors, kernel workspaces "
                     "allowed for)")
    elif p.needed_bytes is not None and c.mem_fitted_to == "needed" and not c.expandable_segments:
        obstacle = replay_obstacle(plan)
        check = ("--fit-allocator checks the plan's own step and plans to it (natively up to 7% more of the limit "
                 "used on the cases of benchmarks/RESULTS.md 11b, 30-90 s for a 7B model)" if obstacle is None else
                 f"--fit-allocator cannot check it: a replay on fake tensors cannot run {_UNREPLAYABLE[obstacle]}")
        lines.append(f"  not checked by replay: {_native_bound_record(c.max_split_size)}; {check}")
    return lines


_UNREPLAYABLE = {  # what the report names, for each reason a replay cannot run the plan
    ReplayObstacle.NODE_MESH: "its units sharded within a node and replicated across nodes (a 2-D mesh)",
    ReplayObstacle.PIPELINE: "its pipeline's schedule",
    ReplayObstacle.EXPERTS: "its split experts, which get tokens by the router's choices on real data",
}


def _native_bound_record(max_split_size: int | None) -> str:
    """How far the native bound has held, under the configuration's max_split_size_mb (benchmarks/RESULTS.md 11b)."""
    if max_split_size == 256 << 20:
        return ("natively with max_split_size_mb:256 the bound held the three steps' replays of all 16 plans of an "
                "earlier round of benchmarks/RESULTS.md 11b (five models; on an H200 those steps needed at most 1% "
                "more than their replays), not checked once the cache has settled")
    return ("natively the bound is fitted on replays of the settled cache of five models' plans (gpt2-1.5b, "
            "llama2-7b, llama3-8b, llama-1b, gpt2; benchmarks/RESULTS.md 11b) and holds each default plan it makes "
            "for them; a model whose tensor sizes strand otherwise may need more")


def unmodelled_text(conf: str | None) -> str | None:
    """A line naming the allocator options of `conf` that the needed figure does not follow (None: there are none)."""
    try:
        unmodelled = unmodelled_options(conf or "")
    except ValueError:  # a configuration torch would refuse: `apply` says so
        return None
    return (f"not modelled: {'; '.join(unmodelled)}. The needed figure and a replay take torch's default for "
            f"{'them' if len(unmodelled) > 1 else 'it'}" if unmodelled else None)


def reserved_is_device(plan) -> bool:
    """Whether a plan's (or an estimate's) reserved figure is its device's memory, where the cache stops growing,
    rather than what the allocator keeps with memory to spare."""
    c, p = plan.cluster, plan.predicted
    return p.reserved_bytes is not None and p.reserved_bytes >= c.device_mem_bytes > (p.needed_bytes or 0)


def mfu_text(p) -> str:
    """"; MFU 41%" for a prediction that has one (model FLOPs over the step time and the profile's peak)."""
    return f"; MFU {p.mfu:.0%}" if getattr(p, "mfu", None) is not None else ""


def _time_lines(plan: Plan) -> list[str]:
    """The predicted step time and throughput, and the speed-up over each baseline."""
    p = plan.predicted
    lines = [
        f"predicted step time {p.step_time_s * 1e3:.1f} ms; "
        + throughput_text(plan.model, p.throughput_samples_s, p.throughput_tokens_s) + mfu_text(p),
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
        lines.append("meshes (the fastest plan that fits of each):")
        for e, wall in zip(s.tp_degrees, plan.tp_degree_wall_times_s(), strict=True):
            name = (f"pp {e.pp_degree} " if e.pp_degree > 1 else "") + f"tp {e.degree}" + \
                (" +sp" if e.sequence_parallel else "") + (f" ep {e.ep_degree}" if e.ep_degree > 1 else "") + \
                (f" cp {e.cp_degree}" if e.cp_degree > 1 else "") + (f" {e.schedule}" if e.schedule else "")
            found = (f"micro-batch {e.micro_batch_size} x {e.grad_accum_steps}: {e.step_time_s * 1e3:.1f} ms, "
                     f"{e.throughput_samples_s:.1f} samples/s, peak {format_bytes(e.peak_mem_bytes)}" if e.fits
                     else e.note)
            lines.append(f"  {name:<14} {found}" + (f" ({wall:.1f} s)" if wall is not None else ""))
    return lines


def context_lines(plan: Plan) -> list[str]:
    """A context-parallel plan's mesh, and what context parallelism costs and saves: the plan beside the best
    of the same tensor-parallel mesh without it (from the meshes searched)."""
    c = plan.cluster
    if c.cp_degree == 1:
        return []
    dp = c.world_size // (c.tp_degree * c.cp_degree)
    lines = [f"mesh {dp} data-parallel x {c.cp_degree} context-parallel"
             + (f" x {c.tp_degree} tensor-parallel" if c.tp_degree > 1 else "")
             + f": each sequence split over {c.cp_degree} ranks (ring attention on load-balanced causal chunks), "
             f"FSDP over the {dp * c.cp_degree} data x context ranks"]
    same = [e for e in plan.solver.tp_degrees if (e.degree, e.sequence_parallel) == (c.tp_degree, c.sequence_parallel)]
    chosen = next((e for e in same if e.cp_degree == c.cp_degree and e.fits), None)
    without = next((e for e in same if e.cp_degree == 1), None)
    if chosen is None or without is None:
        return lines
    if not without.fits:
        return lines + [f"  without context parallelism on this mesh: {without.note}"]
    lines.append(f"  against none: {chosen.throughput_samples_s / without.throughput_samples_s:.2f}x the throughput "
                 f"({without.throughput_samples_s:,.2f} samples/s at micro-batch {without.micro_batch_size}), peak "
                 f"{format_bytes(chosen.peak_mem_bytes)} against {format_bytes(without.peak_mem_bytes)}")
    return lines
