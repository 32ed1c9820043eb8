"""What differs between two plans of one model, and what each difference is worth.

Each group of units whose decisions differ (grouped as pins group them) is changed from plan A's
decision to plan B's alone, on A's cost table (A's cluster, micro-batch and limit), and the plan's
predicted step time and peak memory are compared with A's; then all differences together. Where the
two plans' settings differ too (micro-batch, cluster, limit), those are listed: the per-unit figures
are at A's settings, and B's own prediction is beside them.
"""

from __future__ import annotations

from pydantic import BaseModel

from autoplan.pins import path_groups
from autoplan.plan.explain import option_index
from autoplan.plan.schema import Plan
from autoplan.sizes import format_bytes
from cost_models.evaluate import evaluate
from cost_models.table import CostTable

__all__ = ["PlanDiff", "UnitChange", "diff_plans"]


class UnitChange(BaseModel):
    pattern: str  # the units as a pins pattern
    units: list[str]
    a: str  # plan A's decision
    b: str  # plan B's decision
    step_change_s: float | None  # A's plan with these units as in B, against A (None: not an option under A)
    peak_change_bytes: int | None
    fits: bool | None  # that plan within A's planned limit


class PlanDiff(BaseModel):
    model: str
    settings: list[str]  # settings that differ, "micro-batch 8 -> 4"
    stages: list[str] = []  # pipelined plans: the stages whose modules differ, "stage 1: layers.10-19 -> layers.11-19"
    changes: list[UnitChange]
    only_in_a: list[str]  # units of one plan only (pins can make modules units)
    only_in_b: list[str]
    a_step_time_s: float
    b_step_time_s: float
    a_peak_mem_bytes: int
    b_peak_mem_bytes: int
    all_step_change_s: float | None  # every difference together, at A's settings
    all_peak_change_bytes: int | None

    def table(self) -> str:
        lines = [f"{self.model}: A step {self.a_step_time_s * 1e3:.2f} ms, peak {format_bytes(self.a_peak_mem_bytes)}; "
                 f"B step {self.b_step_time_s * 1e3:.2f} ms, peak {format_bytes(self.b_peak_mem_bytes)}"]
        if self.settings:
            lines.append("settings that differ (the changes below are at A's): " + "; ".join(self.settings))
        lines += self.stages
        for name, paths in (("only in A", self.only_in_a), ("only in B", self.only_in_b)):
            if paths:
                lines.append(f"units {name}: {', '.join(paths)}")
        if not self.changes:
            lines.append("no unit's decision differs")
            return "\n".join(lines)
        lines += ["", f"{'units':<30} {'A':<20} {'B':<20} {'step ms':>9} {'peak':>12}  fits"]
        for c in self.changes:
            if c.step_change_s is None:
                lines.append(f"{c.pattern:<30} {c.a:<20} {c.b:<20} {'-':>9} {'-':>12}  not an option under A's settings")
                continue
            lines.append(f"{c.pattern:<30} {c.a:<20} {c.b:<20} {c.step_change_s * 1e3:>+9.2f} "
                         f"{_signed_bytes(c.peak_change_bytes):>12}  {'yes' if c.fits else 'no'}")
        if self.all_step_change_s is not None and len(self.changes) > 1:
            lines.append(f"{'all of them together':<72} {self.all_step_change_s * 1e3:>+9.2f} "
                         f"{_signed_bytes(self.all_peak_change_bytes):>12}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _signed_bytes(n: int | None) -> str:
    return "-" if n is None else ("+" if n >= 0 else "-") + format_bytes(abs(n))


def _settings(a: Plan, b: Plan) -> list[str]:
    pairs = [("GPUs", a.cluster.world_size, b.cluster.world_size), ("nodes", a.cluster.nodes, b.cluster.nodes),
             ("profile", a.cluster.profile, b.cluster.profile),
             ("limit", format_bytes(a.cluster.mem_limit_bytes), format_bytes(b.cluster.mem_limit_bytes)),
             ("micro-batch", a.training.micro_batch_size, b.training.micro_batch_size),
             ("accumulation", a.training.grad_accum_steps, b.training.grad_accum_steps),
             ("sequence length", a.training.seq_len, b.training.seq_len), ("dtype", a.training.dtype, b.training.dtype),
             ("optimizer", a.training.optimizer, b.training.optimizer),
             ("granularity", a.training.granularity, b.training.granularity),
             ("pins", len(a.pins), len(b.pins)),
             ("expert-parallel degree", a.cluster.ep_degree, b.cluster.ep_degree),
             ("tensor-parallel degree", a.cluster.tp_degree, b.cluster.tp_degree),
             ("context-parallel degree", a.cluster.cp_degree, b.cluster.cp_degree),
             ("pipeline degree", a.cluster.pp_degree, b.cluster.pp_degree),
             ("schedule", _pipe(a, "schedule"), _pipe(b, "schedule")),
             ("micro-batches per step", _pipe(a, "microbatches"), _pipe(b, "microbatches"))]
    return [f"{name} {x} -> {y}" for name, x, y in pairs if x != y]


def _pipe(plan: Plan, field: str):
    return getattr(plan.pipeline, field) if plan.pipeline is not None else None


def diff_plans(a: Plan, b: Plan, table: CostTable, choices: list[int], evaluate=evaluate) -> PlanDiff:
    """The differences of `b` from `a`, whose decisions are `choices` into `table` (A's own settings' table);
    `evaluate(table, choices)` prices a trial (a pipeline rank's adds what the rank holds all step)."""
    planned = a.cluster.planned_for(table)  # what the table's fit figures are made to (the allocator's margin in them)
    base = evaluate(table, choices)
    index = {unit.path: u for u, unit in enumerate(table.units)}
    theirs = {unit.module: unit for unit in b.units}
    differing = [(unit.module, (unit.label.replace(" ", ""), theirs[unit.module].label.replace(" ", "")))
                 for unit in a.units if unit.module in theirs
                 and (unit.sharding, unit.checkpoint, unit.offload) != (theirs[unit.module].sharding,
                                                                        theirs[unit.module].checkpoint,
                                                                        theirs[unit.module].offload)]
    changes, together, all_open = [], list(choices), True
    for pattern, paths, (label_a, label_b) in path_groups(differing):
        picks = [option_index(table.options[index[p]], theirs[p].sharding, theirs[p].checkpoint, theirs[p].offload)
                 for p in paths]
        if any(pick is None for pick in picks):
            all_open = False
            changes.append(UnitChange(pattern=pattern, units=paths, a=label_a, b=label_b, step_change_s=None,
                                      peak_change_bytes=None, fits=None))
            continue
        trial = list(choices)
        for path, pick in zip(paths, picks):
            trial[index[path]] = together[index[path]] = pick
        result = evaluate(table, trial)
        changes.append(UnitChange(pattern=pattern, units=paths, a=label_a, b=label_b,
                                  step_change_s=result.step_time_s - base.step_time_s,
                                  peak_change_bytes=result.peak_mem_bytes - base.peak_mem_bytes,
                                  fits=result.fits(planned, table.host_limit_bytes)))
    combined = evaluate(table, together) if changes and all_open else None
    return PlanDiff(
        model=a.model.name, settings=_settings(a, b), changes=changes,
        only_in_a=[u.module or "<root>" for u in a.units if u.module not in theirs],
        only_in_b=[u.module or "<root>" for u in b.units if u.module not in {v.module for v in a.units}],
        a_step_time_s=a.predicted.step_time_s, b_step_time_s=b.predicted.step_time_s,
        a_peak_mem_bytes=a.predicted.peak_mem_bytes, b_peak_mem_bytes=b.predicted.peak_mem_bytes,
        all_step_change_s=combined.step_time_s - base.step_time_s if combined else None,
        all_peak_change_bytes=combined.peak_mem_bytes - base.peak_mem_bytes if combined else None,
    )
