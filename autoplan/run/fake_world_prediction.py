"""What a fake-world run (autoplan.run.fake_world) is compared with: the plan's prediction, costed again where a
fake process group holds less than the plan's backend, and its compute-only step time.

Why a module of its own: the run measures, this says what the measurement should have been, and both need the
plan's cost table only here. The compute-only step is what a rank on a fake group runs: every unit's forward and
backward (recompute included) and FSDP2's fixed per-unit overhead (hooks, copy-in and copy-out, which run whether
or not the collectives move data), times the accumulation steps, plus the optimizer step. The units' predictions
in a plan file carry no overhead; it is read from the plan's cost table where its profile is here. Left out, an
H200's fake-world steps had read 46% (median) slower than predicted, 16% with it (benchmarks/RESULTS.md
section 9, fourth run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.api.inspect import plan_table
from autoplan.errors import AutoplanError
from autoplan.plan.assemble import prediction
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile
from autoplan.run.stage_report import stage_prediction
from cost_models.evaluate import evaluate
from cost_models.options import PRECISIONS, SHARDING_KINDS, Dtype
from cost_models.table import CostTable, without_gloo_copy

__all__ = ["Headline", "headline", "predicted_compute_s", "predicted_phase_s"]


@dataclass(frozen=True)
class Headline:
    """The prediction a fake-world run is compared with, and how it was made (see autoplan.run.fake_world)."""

    plan: Plan  # the plan, its prediction costed again with every reduction in place where that changes it
    basis: str  # what the prediction is, in words
    gloo_copy_bytes: int  # the largest unit's gloo copy (0 on a CUDA profile)
    recosted: bool  # whether the plan was costed again without gloo's copy
    compute_s: float  # the compute-only step (predicted_compute_s)
    overhead_priced: bool  # whether compute_s counts FSDP2's per-unit overhead (the plan's profile was here)
    phase_s: dict[str, float] | None = None  # compute_s by phase (predicted_phase_s); None for a pipelined plan


def headline(plan: Plan, resolved, profile_device: str, rank: int) -> Headline:
    """On a CPU profile: the plan's decisions costed again with every reduction in place (no gloo on a fake
    group), where the profile is here; else the plan's own prediction. A pipelined plan: the stage's (its compute
    the units' predictions alone)."""
    if plan.pipeline is not None:
        return Headline(plan.model_copy(update={"predicted": stage_prediction(plan, rank)}),
                        "the plan's prediction for the stage(s) this rank runs", 0, False, predicted_compute_s(plan),
                        False)
    costed = _costed(plan, resolved)
    phase_s = predicted_phase_s(plan, *costed) if costed else predicted_phase_s(plan)
    compute_s = sum(phase_s.values())
    gloo_copy = _gloo_copy_bytes(plan) if profile_device != "cuda" else 0
    if not gloo_copy or costed is None:
        return Headline(plan, f"the plan's own ({plan.cluster.profile})", gloo_copy, False, compute_s, bool(costed),
                        phase_s)
    in_place = without_gloo_copy(costed[0])  # as a backend that reduces in place holds the plan, nothing else changed
    predicted = prediction(in_place, evaluate(in_place, costed[1]), plan.cluster.allocator_conf)
    return Headline(plan.model_copy(update={"predicted": predicted}),
                    f"the plan's decisions on {plan.cluster.profile}, every reduction in place (no gloo on a fake "
                    "group)", gloo_copy, True, compute_s, True, phase_s)


def predicted_compute_s(plan: Plan, table: CostTable | None = None, choices: list[int] | None = None) -> float:
    """The plan's predicted step time without collectives: per micro-batch every unit's forward and backward
    (recompute included) and, from its cost `table` and `choices` where given, FSDP2's fixed per-unit overhead,
    times the accumulation steps, plus every unit's optimizer step."""
    return sum(predicted_phase_s(plan, table, choices).values())


def predicted_phase_s(plan: Plan, table: CostTable | None = None, choices: list[int] | None = None) -> dict[str, float]:
    """predicted_compute_s by phase, as a run times them (autoplan.run.phase_clock): the forward, the backward
    (recompute included) and the optimizer step."""
    if table is None:
        units, accum = [unit.predicted for unit in plan.units], plan.training.grad_accum_steps
        return {"forward": accum * sum(u.fwd_s for u in units), "backward": accum * sum(u.bwd_s for u in units),
                "optimizer": sum(u.optimizer_s for u in units)}
    costs, accum = [table.costs[unit][option] for unit, option in enumerate(choices)], table.grad_accum_steps
    return {"forward": accum * sum(c.fwd_s + c.overhead_fwd_s for c in costs),
            "backward": accum * sum(c.bwd_s + c.overhead_bwd_s for c in costs),
            "optimizer": sum(c.optimizer_s for c in costs)}


def _costed(plan: Plan, resolved) -> tuple[CostTable, list[int]] | None:
    """The plan's cost table on its own profile and its decisions as options of it (a tensor-parallel plan's the
    per-rank view its degree's search used: autoplan.api.inspect.plan_table); None where the profile is not
    here."""
    try:
        load_profile(plan.cluster.profile)
    except AutoplanError:
        return None
    _, table, choices = plan_table(plan, resolved)
    return table, choices


def _gloo_copy_bytes(plan: Plan) -> int:
    """The largest reduce-scatter input of a sharded unit (padded to the shard group, reduce dtype): the
    most that gloo's copy of it adds to a CPU prediction at any one time."""
    mesh = plan.cluster.mesh
    reduce_bytes = Dtype(PRECISIONS[plan.training.dtype].reduce_dtype).bytes
    largest = 0
    for unit in plan.units:
        shard = mesh.shard_size(SHARDING_KINDS[unit.sharding].shard_group)
        if shard > 1:
            numel = sum(math.ceil(math.prod(s) / shard) * shard if s else shard for s in unit.param_shapes.values())
            largest = max(largest, numel * reduce_bytes)
    return largest
