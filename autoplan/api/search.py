"""`autoplan.search`: the fastest plan whose predicted per-rank peak fits a memory limit.

The stages in order: resolve and trace the model (or reuse a TracedModel), build cost tables per
micro-batch, sweep the micro-batch with one CP-SAT solve each, assemble the plan.
"""

from __future__ import annotations

from typing import Any

from autoplan.api.traced import reuse_traced
from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.resolve import check_seq_len
from autoplan.models.zoo import count_params
from autoplan.plan.assemble import assemble_plan
from autoplan.plan.schema import ModelRef, PinRecord, Plan
from autoplan.plan.tp_plan import search_mesh
from autoplan.settings import SearchSettings, check_mem_limit
from autoplan.solve.cluster import resolve_cluster
from autoplan.solve.pins import resolve_pins
from autoplan.solve.sweep import sweep
from autoplan.solve.tables import compute_dtype_of, micro_batch_candidates
from autoplan.solve.tp_search import degrees_to_search

__all__ = ["search"]


def search(model: Any = None, mem: str | int | None = None, *, settings: SearchSettings | None = None,
           **fields: Any) -> Plan:
    """The fastest plan whose predicted per-rank peak memory is at most `mem` less a `headroom` fraction.
    Raises InfeasibleError (with the smallest limit that would fit) when none does, UsageError for bad input.

    `model`: a zoo name, "hf:path/to/config.json", "package.module:factory", an nn.Module, or a
    TracedModel (from `autoplan.trace`) to reuse its traces. `mem`: bytes or a size such as "8GB"
    (default: the profile's device memory). `fields` are `autoplan.settings.SearchSettings`'s (the
    same as `autoplan search`'s flags): the cluster is `gpus` in `nodes` x `gpus_per_node` with a
    device `profile`; without `batch_size` the micro-batch is swept; `global_batch` fixes the samples
    per step (gradient accumulation fills it). `tp` fixes the tensor-parallel degree (default: searched with
    the rest). `strategy` (a sharding kind), with `checkpoint` and `offload`, skips the solver: every unit
    takes that option, and only the micro-batch is searched. `pins` (a pins file or a
    mapping) and `pin` (["PATTERN=DECISION", ...]) fix the units they name; the solver completes the rest. A `settings`
    record gives all of them at once; `model`, `mem` and `fields` override it. A `mem` above the device's
    memory (without `allow_over_device_mem`) and a `seq_len` longer than the model's positions are refused.

    >>> import autoplan
    >>> plan = autoplan.search("gpt2-tiny", "60MB", gpus=2, seq_len=64)
    >>> plan.predicted.peak_mem_bytes <= 60e6
    True
    """
    s = SearchSettings.create(settings, model=model, mem=mem, **fields)
    session = reuse_traced(s.model_or_default, s.seq_len, s.example_inputs)
    resolved, seq_len = session.resolved, session.seq_len
    check_seq_len(resolved, seq_len)
    cluster = resolve_cluster(s.gpus, s.nodes, s.gpus_per_node, s.profile, s.host_mem)
    degrees = degrees_to_search(s.tp, cluster.shape.gpus_per_node)  # tensor-parallel degrees, checked before tracing
    mem_limit_bytes = s.mem if s.mem is not None else cluster.profile.mem_bytes
    check_mem_limit(mem_limit_bytes, cluster.profile.mem_bytes, cluster.profile_name, s.allow_over_device_mem)
    # the headroom keeps plans under the limit when they run (see DEFAULT_HEADROOM)
    planned_bytes = int(mem_limit_bytes * (1 - s.headroom))
    candidates = micro_batch_candidates(cluster.shape.world_size, s.batch_size, s.global_batch)
    dtype, optimizer, granularity = s.dtype_or_default, s.optimizer_or_default, s.granularity_or_default
    tables = session.cache(compute_dtype_of(dtype), granularity)
    pins = None
    if s.pin_set is not None:  # matched once against the granularity's units; modules they name become units
        pins = resolve_pins(s.pin_set, [unit.path for unit in tables.units], session.module, resolved.name)
        tables = session.cache(compute_dtype_of(dtype), granularity, pins.extra_units)
    sweep_args = dict(seq_len=seq_len, dtype=dtype, optimizer=optimizer, planned_bytes=planned_bytes,
                      mem_limit_bytes=mem_limit_bytes, headroom=s.headroom, time_limit_s=s.time_limit_s,
                      checkpoint=s.checkpoint, pins=pins, model_name=resolved.name,
                      fixed_batch=s.batch_size is not None)
    model_ref = ModelRef(name=resolved.name, config=resolved.config, n_params=count_params(resolved.module),
                         fingerprint=model_fingerprint(resolved.module), tracer=tables.tracer)
    assemble_args = dict(model=model_ref, mem_limit_bytes=mem_limit_bytes, headroom=s.headroom, seq_len=seq_len,
                         dtype=dtype, optimizer=optimizer, granularity=granularity, planned_bytes=planned_bytes)
    if degrees == [1]:  # FSDP alone
        outcome = sweep(tables, cluster, candidates, strategy=s.strategy, offload=s.offload, **sweep_args)
        plan = assemble_plan(outcome, cluster=cluster, **assemble_args)
    else:  # the mesh too: every tensor-parallel degree (autoplan.solve.tp_search)
        plan = search_mesh(session.module, tables, cluster, degrees,
                           lambda world: micro_batch_candidates(world, s.batch_size, s.global_batch),
                           strategy=s.strategy, offload=s.offload, sweep_args=sweep_args, assemble_args=assemble_args,
                           sequence_parallel=None if s.sequence_parallel is None else s.sequence_parallel == "on")
    if pins is None:
        return plan
    return plan.model_copy(update={"pins": [PinRecord(pattern=p, decision=d) for p, d in pins.records()]})
