"""Why a plan chose what it chose: per group of alike units, the step time and peak memory of the plan
with that group under each of its other options, and which time point of the memory timeline the
limit binds at (where a faster option would go over).

Units are grouped as pins group them (same decision, paths that differ only in a block index:
`transformer.h.0-11`); a group is changed as a whole, the rest of the plan kept. A faster option that
fits when changed alone should not exist in a plan the solver proved optimal (up to its 0.1% gap);
the explanation says so where it does.
"""

from __future__ import annotations

from pydantic import BaseModel

from autoplan.pins import Pattern, path_groups
from autoplan.plan.report import expert_line
from autoplan.plan.schema import Plan
from autoplan.sizes import format_bytes
from cost_models.evaluate import evaluate
from cost_models.table import CostTable

__all__ = ["Explanation", "GroupExplanation", "OptionOutcome", "explain_plan", "option_index"]

FIELDS = ("sharding", "checkpoint", "offload")
SAME_TIME = 1e-3  # within the solver's relative gap: as fast


class OptionOutcome(BaseModel):
    option: str  # the option's label, e.g. "shard+ckpt"
    chosen: bool
    step_time_s: float  # of the whole plan with the group under this option
    step_change_s: float  # against the plan
    peak_mem_bytes: int
    fits: bool  # peak within the planned limit (the limit less the headroom), host memory within its limit
    peak_point: str  # where the peak is: the point the limit binds at when it does not fit
    over_bytes: int  # peak beyond the planned limit (0 when it fits)
    allocator_bytes: int = 0  # fitted per time point to the native allocator's need: what its margin adds there


class GroupExplanation(BaseModel):
    pattern: str  # the group as a pins pattern, e.g. "transformer.h.0-11"
    units: list[str]
    decision: str
    pinned_by: list[str]  # the plan's pins that name these units ("pattern: decision")
    why: str
    options: list[OptionOutcome]  # fastest first


class Explanation(BaseModel):
    model: str
    step_time_s: float
    peak_mem_bytes: int
    peak_point: str
    mem_limit_bytes: int
    planned_bytes: int  # the limit less the headroom (and the caching allocator's margin): what the live peak may reach
    margin_bytes: int = 0  # of the limit less the headroom, what is kept for the caching allocator (CUDA plans)
    micro_batch_size: int
    groups: list[GroupExplanation]
    experts: str = ""  # what the plan's expert parallelism costs and saves (report.expert_line); "" without
    mesh: str = ""  # the plan's tensor- and context-parallel mesh ("2 data-parallel x 2 context-parallel"), or ""
    stages: list[str] = []  # a pipelined plan: each stage, and its boundaries moved a unit either way

    def table(self) -> str:
        on = f" on {self.mesh}" if self.mesh else ""
        lines = [f"{self.model}{on}: step {self.step_time_s * 1e3:.2f} ms, peak {format_bytes(self.peak_mem_bytes)} at "
                 f"{self.peak_point}, of {format_bytes(self.planned_bytes)} planned ({format_bytes(self.mem_limit_bytes)}"
                 " less headroom" + (f" and {format_bytes(self.margin_bytes)} for the CUDA caching allocator"
                                     if self.margin_bytes else "")
                 + f"); micro-batch {self.micro_batch_size}. Each group below is changed alone, the rest of the plan "
                 "kept."] + ([self.experts] if self.experts else []) + self.stages
        for group in self.groups:
            lines += ["", f"{group.pattern} ({len(group.units)} unit{'s' * (len(group.units) > 1)}): {group.decision}"
                      f" - {group.why}",
                      f"  {'option':<24} {'step ms':>10} {'change ms':>10} {'peak':>11}  fits"]
            for o in group.options:
                fits = "yes" if o.fits else f"no, {format_bytes(o.over_bytes)} over at {o.peak_point}"
                change = "-" if o.chosen else f"{o.step_change_s * 1e3:+.2f}"
                lines.append(f"  {o.option + (' (chosen)' if o.chosen else ''):<24} {o.step_time_s * 1e3:>10.2f} "
                             f"{change:>10} {format_bytes(o.peak_mem_bytes):>11}  {fits}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def option_index(options, sharding: str, checkpoint: str, offload: bool) -> int | None:
    """The index of the option with these fields among a unit's `options` (None: not offered)."""
    return next((i for i, o in enumerate(options) if (o.sharding, o.checkpoint, o.offload)
                 == (sharding, checkpoint, offload)), None)


def _why(chosen: OptionOutcome, outcomes: list[OptionOutcome], pinned_by: list[str], margin_bytes: int) -> str:
    faster = [o for o in outcomes if not o.chosen and o.step_time_s < chosen.step_time_s * (1 - SAME_TIME)]
    if pinned_by:
        cost = f"; the fastest option that fits would save {-min(o.step_change_s for o in faster if o.fits) * 1e3:.2f} ms" \
            if any(o.fits for o in faster) else ""
        return "pinned by " + ", ".join(pinned_by) + cost
    if not faster:
        return "the fastest of its options"
    if all(not o.fits for o in faster):
        best = min(faster, key=lambda o: o.step_time_s)
        why = (f"faster options do not fit: the limit binds at {best.peak_point} (with {best.option} the peak is "
               f"{format_bytes(best.peak_mem_bytes)}, {format_bytes(best.over_bytes)} over)")
        if best.over_bytes <= margin_bytes + best.allocator_bytes:
            why += (f"; the live bytes would fit, it is the {format_bytes(margin_bytes + best.allocator_bytes)} kept "
                    "for the CUDA caching allocator that binds")
        return why
    return "a faster option fits when this group changes alone (the solver stopped within its gap, or its time limit)"


def explain_plan(plan: Plan, table: CostTable, choices: list[int], evaluate=evaluate) -> Explanation:
    """The explanation of `plan`, whose decisions are `choices` into `table` (its own settings' table);
    `evaluate(table, choices)` prices a trial (a pipeline rank's adds what the rank holds all step)."""
    kept, planned = int(plan.cluster.mem_limit_bytes * (1 - plan.cluster.mem_headroom)), plan.cluster.planned_for(table)
    base = evaluate(table, choices)
    index = {unit.path: u for u, unit in enumerate(table.units)}
    pins = [(Pattern(p.pattern), f"{p.pattern}: {p.decision}") for p in plan.pins]
    # grouped by decision and by the pins that name them: pinned units apart from those the solver chose alike
    decided = [(unit.module, (unit.label.replace(" ", ""), tuple(text for pin, text in pins if pin.matches(unit.module))))
               for unit in plan.units]
    groups = []
    for pattern, paths, (label, pinned_by) in path_groups(decided):
        units = [index[p] for p in paths]
        first = table.options[units[0]]
        outcomes = []
        for option in first:
            picks = [option_index(table.options[u], option.sharding, option.checkpoint, option.offload) for u in units]
            if any(pick is None for pick in picks):
                continue  # not open to every unit of the group
            trial = list(choices)
            for u, pick in zip(units, picks):
                trial[u] = pick
            result = base if trial == choices else evaluate(table, trial)
            peak = result.peak_mem_bytes
            outcomes.append(OptionOutcome(
                option=option.label, chosen=trial == choices, step_time_s=result.step_time_s,
                step_change_s=result.step_time_s - base.step_time_s, peak_mem_bytes=peak,
                fits=result.fits(planned, table.host_limit_bytes), peak_point=result.peak_point.label,
                over_bytes=max(0, (peak if result.fit_bytes is None else result.fit_bytes) - planned),
                allocator_bytes=0 if result.fit_bytes is None else result.fit_bytes - peak))
        outcomes.sort(key=lambda o: (o.step_time_s, o.peak_mem_bytes))
        chosen = next(o for o in outcomes if o.chosen)
        groups.append(GroupExplanation(pattern=pattern, units=paths, decision=label, pinned_by=list(pinned_by),
                                       why=_why(chosen, outcomes, list(pinned_by), kept - planned), options=outcomes))
    return Explanation(model=plan.model.name, step_time_s=base.step_time_s, peak_mem_bytes=base.peak_mem_bytes,
                       peak_point=base.peak_point.label, mem_limit_bytes=plan.cluster.mem_limit_bytes,
                       planned_bytes=planned, margin_bytes=kept - planned,
                       micro_batch_size=plan.training.micro_batch_size, groups=groups,
                       experts=expert_line(plan.experts) if plan.experts is not None else "", mesh=_mesh_text(plan))


def _mesh_text(plan: Plan) -> str:
    dims = plan.cluster.mesh.dims
    names = {"dp": "data-parallel", "cp": "context-parallel", "tp": "tensor-parallel"}
    return " x ".join(f"{size} {names.get(name, name)}" for name, size in dims) if len(dims) > 1 else ""
