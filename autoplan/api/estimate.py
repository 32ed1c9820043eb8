"""Fixed-strategy estimates: per-rank peak memory by category and step time of one given strategy.

The strategy is uniform (every unit sharded, kept gathered, replicated or hybrid, with or without
activation checkpointing) or a plan file's decisions. This is what accelerate's estimate-memory and
DeepSpeed's ZeRO estimators report, with what they leave out counted: activations saved for
backward, gathered parameters, FSDP's gradient and reduction buffers, and the largest temporaries,
on the same per-rank memory timeline the planner constrains (cost_models.memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoplan.api.traced import reuse_traced
from autoplan.errors import PlanFileError, UsageError
from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.resolve import check_seq_len, model_from_plan
from autoplan.plan.assemble import prediction, unit_decisions
from autoplan.plan.estimate import Estimate
from autoplan.plan.schema import ClusterSpec, ModelRef, Plan, TrainingSpec, load_plan
from autoplan.settings import DEFAULT_MODEL, EstimateSettings, check_mem_limit
from autoplan.sizes import format_bytes, parse_mem_bytes
from autoplan.solve.cluster import resolve_cluster
from autoplan.solve.pins import resolve_pins
from autoplan.solve.tables import compute_dtype_of, micro_batch_candidates
from cost_models.evaluate import checkpoint_name, evaluate, uniform_choices
from cost_models.options import (
    CHECKPOINT_MODES,
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    DEFAULT_SHARDING,
    SHARDING_KINDS,
)
from cost_models.table import CostTable


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
        match = [i for i, o in enumerate(options)
                 if (o.sharding, o.checkpoint, o.offload) == (decision.sharding, decision.checkpoint, decision.offload)]
        if not match:
            why = " (offload needs a profile with a host link)" if decision.offload else ""
            raise PlanFileError(f"unit {unit.path or '<root>'}: {decision.label} is not an option on this cluster{why}")
        choices.append(match[0])
    return choices


def estimate(model: Any = None, strategy: str | None = None, *, settings: EstimateSettings | None = None,
             **fields: Any) -> Estimate:
    """Per-rank peak memory (by category), the memory timeline and the step time of a fixed strategy.

    `strategy`: a sharding kind ("shard", the default, "shard_keep", "replicate", "hybrid", ...) for
    every unit, with `checkpoint` a checkpoint mode ("selective", "full"; True is full) wherever it applies
    (every unit but the root) and `offload=True` putting every unit's state in host memory; or `plan=` (a Plan or a plan file) for its decisions, its model and, unless
    given, its settings (the plan's model is rebuilt from the plan's data only: its zoo config, or its
    "hf:" config relative to the plan file's folder; a plan made from a factory needs `model`).
    `batch_size` is the micro-batch per GPU (default 1); `global_batch` adds gradient accumulation;
    `mem` is a limit to compare with (default: the device's memory; above it only with
    `allow_over_device_mem`). `pins` / `pin` override the units they name (the rest keep the strategy's or
    the plan's options). The fields are `autoplan.settings.EstimateSettings`'s (the same as
    `autoplan estimate`'s flags).

    >>> import autoplan
    >>> est = autoplan.estimate("gpt2-tiny", "shard", checkpoint=True, gpus=2, batch_size=8, seq_len=64)
    >>> est.fits, est.predicted.peak_mem_bytes > est.model_state_bytes
    (True, True)
    """
    s = EstimateSettings.create(settings, model=model, strategy=strategy, **fields)
    model, plan, mem = s.model, s.plan, s.mem
    gpus, nodes, gpus_per_node, profile = s.gpus, s.nodes, s.gpus_per_node, s.profile
    batch_size, global_batch, seq_len = s.batch_size, s.global_batch, s.seq_len
    dtype, optimizer, granularity = s.dtype, s.optimizer, s.granularity
    plan_file, mem_source = None, "`mem`"
    if plan is not None:
        if not isinstance(plan, Plan):
            plan_file, plan = Path(plan), load_plan(plan)
        if plan.cluster.tp_degree > 1:
            raise UsageError(f"the plan is tensor-parallel (degree {plan.cluster.tp_degree}), which estimate does not "
                             "cost yet; the plan's own predictions are its estimate (`autoplan search --tp` makes "
                             "them again)")
        cluster_given = any(v is not None for v in (gpus, nodes, gpus_per_node))
        if not cluster_given:
            gpus, nodes, gpus_per_node = plan.cluster.world_size, plan.cluster.nodes, plan.cluster.gpus_per_node
        t = plan.training
        profile = profile or plan.cluster.profile
        if mem is None:
            mem, mem_source = plan.cluster.mem_limit_bytes, "the plan's memory limit"
        batch_size = batch_size or t.micro_batch_size
        if global_batch is None and not cluster_given:
            global_batch = t.global_batch_size
        seq_len, dtype = seq_len or t.seq_len, dtype or t.dtype
        optimizer, granularity = optimizer or t.optimizer, granularity or t.granularity
        if model is None:  # from the plan's data: never code the plan names
            model = model_from_plan(plan.model.name, plan.model.config, plan_file)
    strategy = s.strategy or DEFAULT_SHARDING
    checkpoint = checkpoint_name(s.checkpoint)
    dtype, optimizer, granularity = dtype or DEFAULT_PRECISION, optimizer or DEFAULT_OPTIMIZER, granularity or "block"

    session = reuse_traced(model if model is not None else DEFAULT_MODEL, seq_len, s.example_inputs)
    check_seq_len(session.resolved, session.seq_len)
    if plan is not None and model_fingerprint(session.module) != plan.model.fingerprint:
        raise PlanFileError(f"the plan was made for a different model than {session.name} (module tree or "
                            "parameter shapes differ); search again for this model")
    cluster = resolve_cluster(gpus, nodes, gpus_per_node, profile, s.host_mem)
    if SHARDING_KINDS[strategy].multi_node_only and cluster.shape.nodes < 2:
        raise UsageError(f"`strategy` {strategy} needs more than one node (`nodes`)")
    mem_limit_bytes = parse_mem_bytes(mem) if mem is not None else cluster.profile.mem_bytes
    check_mem_limit(mem_limit_bytes, cluster.profile.mem_bytes, cluster.profile_name, s.allow_over_device_mem,
                    mem_source)
    [(micro_batch_size, accum)] = micro_batch_candidates(cluster.shape.world_size, batch_size or 1, global_batch)

    # the plan's units (some may be modules its pins made units), and the modules these pins make units
    extra = tuple(unit.module for unit in plan.units) if plan is not None else ()
    pins = None
    if s.pin_set is not None:
        base = session.cache(compute_dtype_of(dtype), granularity, extra)
        pins = resolve_pins(s.pin_set, [unit.path for unit in base.units], session.module, session.name)
        if plan is not None and pins.extra_units:
            raise UsageError(f"pins that make modules units ({', '.join(pins.extra_units[:3])}) cannot change a "
                             "`plan`: it has no decision for them; search again with the pins")
        extra += pins.extra_units
    traced = session.cache(compute_dtype_of(dtype), granularity, extra)
    offloads = s.offload or (plan is not None and any(unit.offload for unit in plan.units))
    table = traced.table(micro_batch_size, accum, cluster, session.seq_len, dtype, optimizer, offload=offloads or None)
    if plan is not None:
        choices, label = _plan_choices(table, plan), "plan"
        description = f"the plan's decisions ({session.name}, limit {format_bytes(plan.cluster.mem_limit_bytes)})"
    else:
        choices = uniform_choices(table, strategy, checkpoint, offload=s.offload, exact=s.offload)
        if choices is None:
            raise UsageError(f"`offload` needs a profile that prices the host link; {cluster.profile_name} has none "
                             "(see `autoplan profiles`)")
        mode = CHECKPOINT_MODES[checkpoint]
        label = strategy + mode.label + ("+offload" if s.offload else "")
        description = (SHARDING_KINDS[strategy].description + "; " + mode.description
                       + (" on every unit but the root" if mode.checkpoints else "")
                       + ("; parameters, gradients and optimizer states offloaded to the host" if s.offload else ""))
    if pins is not None:  # the pinned units take their pins; the rest keep the strategy's or the plan's option
        choices = pins.overlay(table, choices)
        label += f" + {len(pins.pins)} pin{'s' if len(pins.pins) > 1 else ''}"
        description += "; pinned: " + ", ".join(f"{p}: {d}" for p, d in pins.records())
    result = evaluate(table, choices)

    return Estimate(
        model=ModelRef(name=session.name, config=session.resolved.config, n_params=session.n_params,
                       fingerprint=model_fingerprint(session.module), tracer=traced.tracer),
        strategy=label, description=description,
        cluster=ClusterSpec(world_size=cluster.shape.world_size, nodes=cluster.shape.nodes,
                            gpus_per_node=cluster.shape.gpus_per_node, profile=cluster.profile_name,
                            device_mem_bytes=cluster.profile.mem_bytes, mem_limit_bytes=mem_limit_bytes,
                            host_mem_bytes=cluster.host_mem_bytes if cluster.offload_allowed else None),
        training=TrainingSpec(micro_batch_size=micro_batch_size, grad_accum_steps=accum,
                              global_batch_size=table.samples_per_step, seq_len=session.seq_len, dtype=dtype,
                              optimizer=optimizer, granularity=granularity),
        units=unit_decisions(table, choices),
        predicted=prediction(table, result, cluster.profile.device_type),
    )


__all__ = ["estimate"]
