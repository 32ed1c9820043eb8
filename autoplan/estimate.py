"""Fixed-strategy estimates: per-rank peak memory by category and step time of one given strategy.

The strategy is uniform (every unit sharded, kept gathered, replicated or hybrid, with or without
activation checkpointing) or a plan file's decisions. This is what accelerate's estimate-memory and
DeepSpeed's ZeRO estimators report, with what they leave out counted: activations saved for
backward, gathered parameters, FSDP's gradient and reduction buffers, and the largest temporaries,
on the same per-rank memory timeline the planner constrains (cost_models.memory).
"""

from __future__ import annotations

import os
from typing import Any

import torch.nn as nn

from cost_models.evaluate import evaluate, uniform_choices
from cost_models.table import CostTable

from .errors import PlanFileError, UsageError
from .fingerprint import model_fingerprint
from .plan import ClusterSpec, ModelRef, Plan, Prediction, TrainingSpec, UnitDecision, _Strict, load_plan
from .search import (
    DEFAULT_MODEL, DTYPES, OPTIMIZERS, TracedModel, _prediction, _unit_decisions, check_choice, compute_dtype_of,
    micro_batch_candidates,
    resolve_cluster, reuse_traced,
)
from .sizes import format_bytes, parse_mem_bytes

STRATEGIES = {
    "shard": "every unit sharded, resharded after its forward (ZeRO-3, FSDP FULL_SHARD)",
    "shard_keep": "every unit sharded, parameters kept gathered from forward to backward (ZeRO-2-like)",
    "replicate": "every unit replicated, gradients all-reduced (DDP-like)",
    "hybrid": "sharded within a node, replicated across nodes (HSDP)",
}
CATEGORY_LABELS = {
    "params_bytes": "parameters", "grads_bytes": "gradients", "optimizer_bytes": "optimizer states",
    "activations_bytes": "activations", "gathered_bytes": "gathered parameters", "temporaries_bytes": "temporaries",
}


class Estimate(_Strict):
    """Predictions for one fixed strategy; `predicted` has the peak, its breakdown, the timeline, step time."""

    model: ModelRef
    strategy: str  # "shard", "replicate+ckpt", ... or "plan <file>"
    description: str
    cluster: ClusterSpec  # mem_limit_bytes: the limit compared with (the device's memory unless given)
    training: TrainingSpec
    units: list[UnitDecision]
    predicted: Prediction

    @property
    def fits(self) -> bool:
        return self.predicted.peak_mem_bytes <= self.cluster.mem_limit_bytes

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer states per rank (what ZeRO estimators count)."""
        step = self.predicted.timeline[-1].breakdown
        return step.params_bytes + step.grads_bytes + step.optimizer_bytes

    def table(self, timeline: bool = False) -> str:
        return format_estimate(self, timeline=timeline)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython / Jupyter display
        printer.text(self.table())


def _plan_choices(table: CostTable, plan: Plan) -> list[int]:
    """The plan's option per unit, as option indices into `table`."""
    decisions = {unit.module: unit for unit in plan.units}
    missing = [u.path or "<root>" for u in table.units if u.path not in decisions]
    extra = sorted(set(decisions) - {u.path for u in table.units})
    if missing or extra:
        raise PlanFileError(f"the plan's units do not match the model's at granularity {plan.training.granularity}: "
                            f"missing {missing[:5]}, unknown {extra[:5]}")
    choices = []
    for unit, options in zip(table.units, table.options):
        decision = decisions[unit.path]
        match = [i for i, o in enumerate(options) if (o.sharding, o.checkpoint) == (decision.sharding, decision.checkpoint)]
        if not match:
            raise PlanFileError(f"unit {unit.path or '<root>'}: {decision.sharding}"
                                f"{' +ckpt' if decision.checkpoint else ''} is not an option on this cluster")
        choices.append(match[0])
    return choices


def estimate(
    model: str | nn.Module | TracedModel | None = None,
    strategy: str | None = None,
    *,
    checkpoint: bool = False,
    plan: Plan | str | os.PathLike | None = None,
    mem: str | int | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    profile: str | None = None,
    batch_size: int | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    dtype: str | None = None,
    optimizer: str | None = None,
    granularity: str | None = None,
    example_inputs: Any = None,
) -> Estimate:
    """Per-rank peak memory (by category), the memory timeline and the step time of a fixed strategy.

    `strategy`: "shard" (default), "shard_keep", "replicate" or "hybrid" for every unit, with
    `checkpoint` turning on activation checkpointing wherever it applies (every unit but the root);
    or `plan` (a Plan or a plan file) for its decisions, its model and, unless given, its settings.
    `batch_size` is the micro-batch per GPU (default 1); `global_batch` adds gradient accumulation.
    `mem` is a limit to compare with (default: the device's memory). Other settings as `search`.

    >>> import autoplan
    >>> est = autoplan.estimate("gpt2-tiny", "shard", checkpoint=True, gpus=2, batch_size=8, seq_len=64)
    >>> est.fits, est.predicted.peak_mem_bytes > est.model_state_bytes
    (True, True)
    """
    if plan is not None:
        if strategy is not None or checkpoint:
            raise UsageError("give either a strategy (with or without checkpointing) or a plan, not both")
        plan = plan if isinstance(plan, Plan) else load_plan(plan)
        cluster_given = any(v is not None for v in (gpus, nodes, gpus_per_node))
        if not cluster_given:
            gpus, nodes, gpus_per_node = plan.cluster.world_size, plan.cluster.nodes, plan.cluster.gpus_per_node
        t = plan.training
        profile = profile or plan.cluster.profile
        mem = mem if mem is not None else plan.cluster.mem_limit_bytes
        batch_size = batch_size or t.micro_batch_size
        if global_batch is None and not cluster_given:
            global_batch = t.global_batch_size
        seq_len, dtype = seq_len or t.seq_len, dtype or t.dtype
        optimizer, granularity = optimizer or t.optimizer, granularity or t.granularity
        if model is None:
            if plan.model.config is None and ":" not in plan.model.name:
                raise UsageError(f"the plan was made for a model object ({plan.model.name}); pass that model too")
            model = plan.model.name
    strategy = strategy or "shard"
    dtype, optimizer, granularity = dtype or "bf16-mixed", optimizer or "adamw", granularity or "block"
    check_choice("strategy", strategy, STRATEGIES)
    check_choice("--dtype", dtype, DTYPES)
    check_choice("--optimizer", optimizer, OPTIMIZERS)

    session = reuse_traced(model if model is not None else DEFAULT_MODEL, seq_len, example_inputs)
    if plan is not None and model_fingerprint(session.module) != plan.model.fingerprint:
        raise PlanFileError(f"the plan was made for a different model than {session.name} (module tree or "
                            "parameter shapes differ); re-run `autoplan search` for this model")
    cluster = resolve_cluster(gpus, nodes, gpus_per_node, profile)
    if strategy == "hybrid" and cluster.shape.nodes < 2:
        raise UsageError("hybrid sharding needs more than one node (--nodes)")
    mem_limit_bytes = parse_mem_bytes(mem) if mem is not None else cluster.profile.mem_bytes
    [(micro_batch_size, accum)] = micro_batch_candidates(cluster.shape.world_size, batch_size or 1, global_batch)

    traced = session.cache(compute_dtype_of(dtype), granularity)
    table = traced.table(micro_batch_size, accum, cluster, session.seq_len, dtype, optimizer)
    if plan is not None:
        choices, label = _plan_choices(table, plan), "plan"
        description = f"the plan's decisions ({plan.model.name}, limit {format_bytes(plan.cluster.mem_limit_bytes)})"
    else:
        choices = uniform_choices(table, strategy, checkpoint)
        label = strategy + ("+ckpt" if checkpoint else "")
        description = STRATEGIES[strategy] + ("; activation checkpointing on every unit but the root"
                                              if checkpoint else "; no activation checkpointing")
    result = evaluate(table, choices)

    return Estimate(
        model=ModelRef(name=session.name, config=session.resolved.config, n_params=session.n_params,
                       fingerprint=model_fingerprint(session.module), tracer=traced.tracer),
        strategy=label, description=description,
        cluster=ClusterSpec(world_size=cluster.shape.world_size, nodes=cluster.shape.nodes,
                            gpus_per_node=cluster.shape.gpus_per_node, profile=cluster.profile_name,
                            device_mem_bytes=cluster.profile.mem_bytes, mem_limit_bytes=mem_limit_bytes),
        training=TrainingSpec(micro_batch_size=micro_batch_size, grad_accum_steps=accum,
                              global_batch_size=table.samples_per_step, seq_len=session.seq_len, dtype=dtype,
                              optimizer=optimizer, granularity=granularity),
        units=_unit_decisions(table, choices),
        predicted=_prediction(table, result),
    )


def format_estimate(est: Estimate, timeline: bool = False) -> str:
    c, t, p = est.cluster, est.training, est.predicted
    limit_name = "device memory" if c.mem_limit_bytes == c.device_mem_bytes else "limit"
    verdict = "fits" if est.fits else f"does not fit (over by {format_bytes(p.peak_mem_bytes - c.mem_limit_bytes)})"
    lines = [
        f"autoplan estimate: {est.model.name} ({est.model.n_params:,} parameters, traced by {est.model.tracer})",
        f"strategy {est.strategy}: {est.description}",
        f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s), profile {c.profile}; micro-batch {t.micro_batch_size} x "
        f"{t.grad_accum_steps} accumulation x {c.world_size} GPUs = {t.global_batch_size} samples per step; "
        f"sequence length {t.seq_len}; {t.dtype}, {t.optimizer}",
        "",
        f"per-GPU memory at the peak ({p.peak_point}):",
    ]
    breakdown = p.breakdown.model_dump()
    lines += [f"  {CATEGORY_LABELS[key]:<20} {format_bytes(breakdown[key]):>12}" for key in CATEGORY_LABELS]
    lines += [
        f"  {'total':<20} {format_bytes(p.peak_mem_bytes):>12}  of {format_bytes(c.mem_limit_bytes)} {limit_name}: "
        f"{verdict}",
        f"model states (parameters + gradients + optimizer states) {format_bytes(est.model_state_bytes)} per GPU",
        f"step time {p.step_time_s * 1e3:.1f} ms; throughput {p.throughput_samples_s:.1f} samples/s "
        f"({p.throughput_tokens_s:,.0f} tokens/s)",
    ]
    if timeline:
        header = f"{'time point':<36} {'total':>11}" + "".join(f" {k.removesuffix('_bytes'):>11}" for k in CATEGORY_LABELS)
        lines += ["", header, "-" * len(header)]
        for point in p.timeline:
            parts = point.breakdown.model_dump()
            lines.append(f"{point.point[:36]:<36} {format_bytes(point.total_bytes):>11}"
                         + "".join(f" {format_bytes(parts[k]):>11}" for k in CATEGORY_LABELS))
    return "\n".join(lines)


__all__ = ["Estimate", "STRATEGIES", "estimate", "format_estimate"]
