"""`autoplan.search`: the fastest plan whose predicted per-rank peak fits a memory limit.

The stages in order: resolve and trace the model (or reuse a TracedModel), build cost tables per
micro-batch, sweep the micro-batch with one CP-SAT solve each, assemble the plan.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from autoplan.api.traced import TracedModel, reuse_traced
from autoplan.errors import UsageError
from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.zoo import count_params
from autoplan.plan.assemble import assemble_plan
from autoplan.plan.schema import ModelRef, Plan
from autoplan.settings import DEFAULT_HEADROOM, DEFAULT_MODEL, DTYPES, MAX_HEADROOM, OPTIMIZERS, check_choice
from autoplan.sizes import parse_mem_bytes
from autoplan.solve.cluster import resolve_cluster
from autoplan.solve.solver import DEFAULT_TIME_LIMIT_S
from autoplan.solve.sweep import sweep
from autoplan.solve.tables import compute_dtype_of, micro_batch_candidates
from cost_models.options import SHARDING_KINDS

__all__ = ["search"]


def search(
    model: str | nn.Module | TracedModel = DEFAULT_MODEL,
    mem: str | int = "8GB",
    *,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    profile: str | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    global_batch: int | None = None,
    dtype: str = "bf16-mixed",
    optimizer: str = "adamw",
    granularity: str = "block",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    example_inputs: Any = None,
    strategy: str | None = None,
    checkpoint: bool = False,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """The fastest plan whose predicted per-rank peak memory is at most `mem` less a `headroom` fraction. Raises InfeasibleError
    (with the smallest limit that would fit) when none does, UsageError for bad input.

    `model`: a zoo name, "hf:path/to/config.json", "package.module:factory", an nn.Module, or a
    TracedModel (from `autoplan.trace`) to reuse its traces. `mem`: bytes or a size such as "8GB".
    The cluster is `gpus` in `nodes` x `gpus_per_node` with a device `profile`; without `batch_size`
    the micro-batch is swept; `global_batch` fixes the samples per step (gradient accumulation fills
    it). `example_inputs`: see TracedModel. `strategy` ("shard", "shard_keep", "replicate",
    "hybrid"), with `checkpoint`, skips the solver: every unit takes that option (the plan to run a
    uniform baseline), and only the micro-batch is searched.

    >>> import autoplan
    >>> plan = autoplan.search("gpt2-tiny", "60MB", gpus=2, seq_len=64)
    >>> plan.predicted.peak_mem_bytes <= 60e6
    True
    """
    mem_limit_bytes = parse_mem_bytes(mem)
    if not 0 <= headroom < MAX_HEADROOM:
        raise UsageError(f"--headroom must be a fraction of the limit in [0, {MAX_HEADROOM}), got {headroom:g} "
                         f"(e.g. 0.02 plans to 98% of --mem)")
    # the headroom keeps plans under the limit when they run (see DEFAULT_HEADROOM)
    planned_bytes = int(mem_limit_bytes * (1 - headroom))
    check_choice("--dtype", dtype, DTYPES)
    check_choice("--optimizer", optimizer, OPTIMIZERS)
    if time_limit_s <= 0:
        raise UsageError(f"--time-limit must be positive, got {time_limit_s}")
    if strategy is not None:
        check_choice("--strategy", strategy, SHARDING_KINDS)
    session = reuse_traced(model, seq_len, example_inputs)
    resolved, seq_len = session.resolved, session.seq_len
    cluster = resolve_cluster(gpus, nodes, gpus_per_node, profile)
    candidates = micro_batch_candidates(cluster.shape.world_size, batch_size, global_batch)
    tables = session.cache(compute_dtype_of(dtype), granularity)
    outcome = sweep(tables, cluster, candidates, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                    planned_bytes=planned_bytes, mem_limit_bytes=mem_limit_bytes, headroom=headroom,
                    time_limit_s=time_limit_s, strategy=strategy, checkpoint=checkpoint, model_name=resolved.name,
                    fixed_batch=batch_size is not None)
    model_ref = ModelRef(name=resolved.name, config=resolved.config, n_params=count_params(resolved.module),
                         fingerprint=model_fingerprint(resolved.module), tracer=tables.tracer)
    return assemble_plan(outcome, model=model_ref, cluster=cluster, mem_limit_bytes=mem_limit_bytes,
                         headroom=headroom, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                         granularity=granularity, planned_bytes=planned_bytes)
