"""`autoplan explain` and `autoplan diff` in Python: a plan's cost table rebuilt from the plan file alone
(its model from its config, its cluster, micro-batch and precision), then its choices explained or
compared with another plan's (autoplan.plan.explain, autoplan.plan.diff)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autoplan.api.estimate import _plan_choices
from autoplan.api.traced import reuse_traced
from autoplan.errors import PlanFileError
from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.resolve import model_from_plan
from autoplan.plan.diff import PlanDiff, diff_plans
from autoplan.plan.explain import Explanation, explain_plan
from autoplan.plan.schema import Plan, load_plan
from autoplan.solve.cluster import resolve_cluster
from autoplan.solve.tables import compute_dtype_of
from cost_models.table import CostTable

__all__ = ["diff", "explain", "plan_table"]


def plan_table(plan: Plan | str | os.PathLike, model: Any = None) -> tuple[Plan, CostTable, list[int]]:
    """The plan (loaded if a path), the cost table of its own settings, and its decisions as option
    indices into it. `model` is needed only for a plan made from a factory or an nn.Module."""
    plan_file = None
    if not isinstance(plan, Plan):
        plan_file, plan = Path(plan), load_plan(plan)
    if model is None:
        model = model_from_plan(plan.model.name, plan.model.config, plan_file)
    t, c = plan.training, plan.cluster
    session = reuse_traced(model, t.seq_len, None)
    if model_fingerprint(session.module) != plan.model.fingerprint:
        raise PlanFileError(f"the plan {plan_file or ''} was made for a different model than {session.name} (module "
                            "tree or parameter shapes differ)")
    cluster = resolve_cluster(c.world_size, c.nodes, c.gpus_per_node, c.profile, c.host_mem_bytes)
    traced = session.cache(compute_dtype_of(t.dtype), t.granularity, tuple(unit.module for unit in plan.units))
    table = traced.table(t.micro_batch_size, t.grad_accum_steps, cluster, session.seq_len, t.dtype, t.optimizer,
                         offload=any(unit.offload for unit in plan.units) or None)
    return plan, table, _plan_choices(table, plan)


def explain(plan: Plan | str | os.PathLike, model: Any = None) -> Explanation:
    """Per group of alike units, the plan's step time and peak with the group under each of its options,
    and where the limit binds.

    >>> import autoplan
    >>> from autoplan.api.inspect import explain
    >>> why = explain(autoplan.search("gpt2-tiny", "20MB", gpus=2, seq_len=64))
    >>> [group.pattern for group in why.groups]
    ['<root>', 'transformer.h.0', 'transformer.h.1']
    """
    return explain_plan(*plan_table(plan, model))


def diff(a: Plan | str | os.PathLike, b: Plan | str | os.PathLike, model: Any = None) -> PlanDiff:
    """The units whose decisions differ between plans `a` and `b` of one model, each difference's step time
    and peak memory change (at A's settings), and the settings that differ."""
    a, table, choices = plan_table(a, model)
    b_file = None
    if not isinstance(b, Plan):
        b_file, b = Path(b), load_plan(b)
    if b.model.fingerprint != a.model.fingerprint:
        raise PlanFileError(f"the plans are of different models ({a.model.name} and {b.model.name} {b_file or ''}); "
                            "diff compares two plans of one model")
    return diff_plans(a, b, table, choices)
