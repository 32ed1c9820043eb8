"""`autoplan explain` and `autoplan diff` in Python: a plan's cost table rebuilt from the plan file alone
(its model from its config, its cluster, micro-batch and precision), then its choices explained or
compared with another plan's (autoplan.plan.explain, autoplan.plan.diff)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autoplan.api.estimate import request_pipeline, request_table
from autoplan.api.prepare import load_plan_of, prepare
from autoplan.errors import PlanFileError
from autoplan.plan.diff import PlanDiff, diff_plans
from autoplan.plan.explain import Explanation, explain_plan
from autoplan.plan.pipeline_inspect import diff_pipelined, explain_pipelined, stage_changes
from autoplan.plan.schema import Plan, load_plan
from autoplan.settings import EstimateSettings
from autoplan.solve.request import PlanRequest
from cost_models.table import CostTable

__all__ = ["diff", "explain", "plan_table"]


def plan_table(plan: Plan | str | os.PathLike, model: Any = None) -> tuple[Plan, CostTable, list[int]]:
    """The plan (loaded if a path), the cost table of its own settings (its mesh, tensor parallelism
    included), and its decisions as option indices into it. `model` is needed only for a plan made from a
    factory or an nn.Module."""
    loaded, plan_file = load_plan_of(plan)
    table, choices = request_table(_request(loaded, plan_file, model), loaded)
    return loaded, table, choices


def _request(plan: Plan, plan_file: Path | None, model: Any) -> PlanRequest:
    """The request of the plan's own settings: its limit as it was made to (above the device's memory only where
    it was asked to be)."""
    settings = EstimateSettings.create(model=model, plan=plan, allow_over_device_mem=True)
    return prepare(settings, plan, plan_file)


def explain(plan: Plan | str | os.PathLike, model: Any = None) -> Explanation:
    """Per group of alike units, the plan's step time and peak with the group under each of its options,
    and where the limit binds.

    >>> import autoplan
    >>> from autoplan.api.inspect import explain
    >>> why = explain(autoplan.search("gpt2-tiny", "20MB", gpus=2, seq_len=64, fit_to="allocated"))
    >>> [group.pattern for group in why.groups]
    ['<root>', 'transformer.h.0', 'transformer.h.1']
    """
    loaded, plan_file = load_plan_of(plan)
    if loaded.pipeline is not None:
        priced, *moved = request_pipeline(_request(loaded, plan_file, model), loaded, moved=True)
        return explain_pipelined(loaded, priced, moved)
    return explain_plan(*plan_table(loaded, model))


def diff(a: Plan | str | os.PathLike, b: Plan | str | os.PathLike, model: Any = None) -> PlanDiff:
    """The units whose decisions differ between plans `a` and `b` of one model, each difference's step time
    and peak memory change (at A's settings), and the settings that differ."""
    a, a_file = load_plan_of(a)
    b_file = None
    if not isinstance(b, Plan):
        b_file, b = Path(b), load_plan(b)
    if b.model.fingerprint != a.model.fingerprint:
        raise PlanFileError(f"the plans are of different models ({a.model.name} and {b.model.name} {b_file or ''}); "
                            "diff compares two plans of one model")
    if a.pipeline is not None:
        [priced] = request_pipeline(_request(a, a_file, model), a)
        return diff_pipelined(a, b, priced)
    a, table, choices = plan_table(a, model)
    found = diff_plans(a, b, table, choices)
    return found.model_copy(update={"stages": stage_changes(a, b)})
