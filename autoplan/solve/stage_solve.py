"""One pipeline rank's units solved by the per-unit CP-SAT solver with what the rank holds all step.

The solver's memory rows are one micro-batch's timeline (cost_models.memory); a pipelined rank holds more
at every forward and backward point (cost_models.pipeline.HeldAllStep: other micro-batches' activations,
the unsharded parameters and gradients FSDP keeps through the step), each a constant of the unit's option.
They are added to the solver's model's rows (`AffineModel.rows`) and to the evaluation's points, the
optimizer step's points excepted (the reductions reshard and free them), so the solver and the
evaluation price one memory timeline.

No backward reduces under a pipeline: torch's PipelineStage turns FSDP's gradient sync off for every
micro-batch's backward, then runs each FSDP group's post-backward (its reduction) once the stage's last
backward is done (`perform_reduce_grad`). So the backward points are the table's timeline with no reduction
input left alive (`_accumulating`), with the micro-batches in flight; the reduction points keep their place
in the timeline as a bound on that phase (one micro-batch's activations still counted, where the phase holds
none), without the other micro-batches in flight where the rank runs one stage (`HeldAllStep.drained`: its
reductions run after all its backwards), with them where stages are looped on it (another stage may still
have micro-batches in flight then). Measured on the fake process group (llama 8 x 256, 1F1B, pp 2, stage 0):
the backwards peak at 68.37 MB where the reductions, priced in every backward with two micro-batches in
flight, had said 72.06.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np

from autoplan.solve.request import PlanRequest
from autoplan.solve.rows import MemoryRows, table_rows
from autoplan.solve.solver import AffineModel, SolveResult, SolveStatus, solve_min_time
from cost_models.choices import searched_options
from cost_models.evaluate import Evaluation, evaluate, uniform_choices
from cost_models.memory import MemCategory, MemoryPoint, phase_of, total
from cost_models.pipeline import HeldAllStep
from cost_models.table import CostTable

__all__ = ["RankSolve", "held_evaluation", "held_model", "leanest", "rank_evaluation", "rank_memory", "rank_rows",
           "searched_table", "solve_rank"]


@dataclass(frozen=True)
class RankSolve:
    """A rank's solve: its choices (None: nothing fits), the solver's status, and the least any plan of its
    units can peak at (a bound: each point's smallest bytes, unit by unit)."""

    choices: list[int] | None
    status: SolveStatus
    floor_bytes: int


@dataclass
class _Rows:
    """A rank's table cut to the options searched (`keep`: their indices), its memory rows and their labels
    (`rows.table_rows`), and, made when first asked, its variants' rows and its solver model: what the rank's floors
    and solves at every flight share (a pipelined table does not depend on the flight, what it holds does)."""

    table: CostTable
    keep: list[list[int]]
    algebra: object
    rows: MemoryRows
    labels: list[str]
    variants: dict[str, MemoryRows] = field(default_factory=dict)
    affine: AffineModel | None = None
    layouts: dict[tuple, _Placed] = field(default_factory=dict)  # `_layout`'s placed, per what of `held` it reads
    flats: dict[tuple, np.ndarray] = field(default_factory=dict)  # `_held_rows`' literals kept, per uncut options

    def layout(self, held: HeldAllStep) -> _Placed:
        key = (held.drained, held.first is not None, tuple(s is not None for s in held.split) if held.split else None)
        if key not in self.layouts:
            self.layouts[key] = _Placed.of(_layout(self.labels, held))
        return self.layouts[key]

    def flat(self, held: HeldAllStep) -> np.ndarray:
        """The options searched (`keep`) as places among the uncut table's literals (`held`'s fields')."""
        counts = tuple(len(v) for v in held.gathered)
        if counts not in self.flats:
            self.flats[counts] = np.concatenate([np.asarray(k, dtype=np.int64) + start for k, start in
                                                 zip(self.keep, np.cumsum((0,) + counts[:-1]).tolist())])
        return self.flats[counts]

    def variant(self, name: str) -> MemoryRows:
        if name not in self.variants:
            self.variants[name] = self.rows if name == "base" else table_rows(_VARIANTS[name](self.table))[1]
        return self.variants[name]


def rank_rows(table: CostTable) -> _Rows:
    """What `solve_rank` and `rank_memory` build from the rank's table before its held bytes: made once, handed to
    each (a caller's cache, per kind of stage and micro-batch)."""
    searched, keep = searched_table(table)
    return _Rows(searched, keep, *table_rows(searched))


def searched_table(table: CostTable) -> tuple[CostTable, list[list[int]]]:
    """The rank's table cut to the options the search offers (cost_models.choices.searched_options), and per unit
    the indices kept."""
    keep = [searched_options(options) for options in table.options]
    return replace(table, options=[[o[i] for i in k] for o, k in zip(table.options, keep)],
                   costs=[[c[i] for i in k] for c, k in zip(table.costs, keep)]), keep


def solve_rank(request: PlanRequest, table: CostTable, held: HeldAllStep, rows: _Rows | None = None,
               memory: tuple[MemoryRows, int] | None = None) -> RankSolve:
    """The rank's fastest choices within the request's planned bytes (or its uniform strategy's, where they fit).
    A rank whose floor is over the limit is not handed to CP-SAT (its proof of infeasibility can take long).
    `rows`: the table's `rank_rows`, where the caller keeps them; `memory`: their `rank_memory` with `held`, alike."""
    limit = request.limits.planned_bytes
    if request.uniform is not None:
        u = request.uniform
        choices = uniform_choices(table, u.strategy, u.checkpoint, offload=u.offload)
        if choices is not None and request.pins is not None:  # pinned units take their pins (as sweep's)
            choices = request.pins.overlay(table, choices)
        peak = held_evaluation(table, held, choices).peak_mem_bytes if choices is not None else limit + 1
        return RankSolve(choices if peak <= limit else None, SolveStatus.FIXED, peak)
    rows = rows or rank_rows(table)
    memory, floor = memory or rank_memory(rows, held)
    if floor > limit:
        return RankSolve(None, SolveStatus.INFEASIBLE, floor)
    if rows.affine is None:
        rows.affine = AffineModel.of(rows.table, (rows.algebra, rows.rows, rows.labels))
    affine = replace(rows.affine, rows=memory)  # its rows with the held bytes
    result: SolveResult = solve_min_time(rows.table, limit, request.limits.time_limit_s, affine=affine)
    if result.choices is None:
        return RankSolve(None, result.status, floor)
    return RankSolve([k[c] for k, c in zip(rows.keep, result.choices)], result.status, floor)


def held_model(table: CostTable, held: HeldAllStep):
    """A function of a table whose options are some of `table`'s (the options searched, or fewer: pins'): its
    solver model with what the rank holds all step (the held bytes are `table`'s options')."""
    def model(cut: CostTable) -> AffineModel:
        keep = [[options.index(option) for option in kept] for options, kept in zip(table.options, cut.options)]
        rows = _Rows(cut, keep, *table_rows(cut))
        return AffineModel.of(cut, (rows.algebra, rank_memory(rows, held)[0], rows.labels))
    return model


def rank_memory(rows: _Rows, held: HeldAllStep) -> tuple[MemoryRows, int]:
    """The rank's memory rows with its held bytes (cut to the options searched), and its floor (`rank_rows`: the
    rows before the held bytes)."""
    memory = _held_rows(rows, held)
    return memory, memory.floor(rows.algebra.offsets)


# a point of the rank's timeline: (its point in the one-micro-batch timeline, the table whose timeline it is taken
# from, which micro-batches in flight it holds (None: none beside its own), whether it holds the parameters gathered
# for the step, whether the gradients accumulated for the step, its label's suffix, the segment whose backward it is
# where the split backward holds more there (HeldAllStep.split), else None)
_Point = tuple[int, str, str | None, bool, bool, str, int | None]
_FIRST = ", before the first backward is done"


def _layout(labels: list[str], held: HeldAllStep) -> list[_Point]:
    """The rank's points in order (`labels`: the one-micro-batch timeline's). Forward points hold the micro-batches
    in flight; backward points are taken from `_accumulating`'s timeline; reductions hold the micro-batches in flight
    only where the rank's stages are looped (not `drained`); the optimizer step holds neither the gathered parameters
    nor the unsharded gradients (the reductions reshard and free them). Where more micro-batches are in flight until
    the first backward is done (`held.first`), each forward and backward point has a twin for then: from
    `_first_pass`' timeline (no gradient accumulated before the first backward, those of the units it has finished
    during it) with the first's flight. Backward points are one per segment, the last segment's first."""
    points: list[_Point] = []
    backwards = sum(label.startswith("bwd ") for label in labels)
    for i, label in enumerate(labels):
        kind, phase = label.split(" ", 1)[0], phase_of(label)
        if phase == "optimizer":
            points.append((i, "base", None, False, False, "", None))
        elif kind == "reduce":
            points.append((i, "base", None if held.drained else "later", True, True, "", None))
        else:
            backwards -= kind == "bwd"
            split = backwards if kind == "bwd" and held.split and held.split[backwards] is not None else None
            if held.first is not None:
                points.append((i, "first", "first", True, kind == "bwd", _FIRST, split))
            points.append((i, "backward" if kind == "bwd" else "base", "later", True, True, "", split))
    return points


def _accumulating(table: CostTable) -> CostTable:
    """The table as a pipelined backward runs it: no unit reduces there, so none leaves a reduction input alive."""
    return replace(table, costs=[[c.changed(pending_reduce_bytes=0) for c in costs] for costs in table.costs])


def _first_pass(table: CostTable) -> CostTable:
    """`_accumulating`'s table as the rank's first micro-batch runs it: no gradient before its backward."""
    return replace(_accumulating(table), grad_accum_steps=1)


_VARIANTS = {"base": lambda table: table, "backward": lambda table: _accumulating(table),
             "first": lambda table: _first_pass(table)}


def _sources(table: CostTable, layout: list[_Point]) -> dict[str, CostTable]:
    return {name: _VARIANTS[name](table) for name in {point[1] for point in layout}}


def _outputs(held: HeldAllStep, flight: str | None) -> int:
    """The stage outputs a point holds: those of the micro-batches in flight it holds."""
    return {"later": held.outputs[0], "first": held.outputs[1]}.get(flight, 0)


def _held_rows(base: _Rows, held: HeldAllStep) -> MemoryRows:
    """The table's memory rows as the rank runs its units (`_layout`), its held bytes (per unit and option of the
    uncut table) taken at the options searched (`base.keep`): each source's rows taken at once, the held bytes
    added to every point holding them (integers: the sums are exact in any order)."""
    placed, flat = base.layout(held), base.flat(held)

    def vector(values):  # a held field over the literals of the options searched
        return np.fromiter(chain.from_iterable(values), dtype=np.int64)[flat]

    points = np.empty((placed.points, base.rows.size), dtype=np.int64)
    const = np.empty(placed.points, dtype=np.int64)
    for name, (at, timeline) in placed.sources.items():
        rows = base.variant(name)
        points[at] = rows.rows_at(timeline)
        const[at] = rows.const[timeline]
    added = {("flight", "later"): held.activations, ("gathered", True): held.gathered, ("grads", True): held.grads}
    if held.first:
        added[("flight", "first")] = held.first
    for split in placed.splits:
        added[("split", split)] = held.split[split]
    for key, values in added.items():
        if key in placed.fields:
            points[placed.fields[key]] += vector(values)
    outputs = np.zeros(placed.points, dtype=np.int64)
    for flight, at in placed.outputs.items():
        outputs[at] = _outputs(held, flight)
    const += held.buffers + outputs
    return MemoryRows(base.rows.size, const, dense=points)


_FIELD = {"flight": 2, "gathered": 3, "grads": 4, "split": 6}  # a held field's place in a `_Point`


@dataclass(frozen=True)
class _Placed:
    """A rank's points (`_layout`) as `_held_rows` fills them: per source table, the places of the points taken from
    it and their points in its timeline; per held field and value (`_FIELD`), the places holding it; per flight
    whose outputs some hold, their places; the segments whose split backward some hold."""

    points: int
    sources: dict[str, tuple[list[int], list[int]]]
    fields: dict[tuple, list[int]]
    outputs: dict[str, list[int]]
    splits: list[int]

    @classmethod
    def of(cls, layout: list[_Point]) -> _Placed:
        def places(test) -> list[int]:
            return [k for k, point in enumerate(layout) if test(point)]

        names = {point[1] for point in layout}
        sources = {name: (places(lambda p: p[1] == name), [p[0] for p in layout if p[1] == name]) for name in names}
        values = {(name, point[i]) for point in layout for name, i in _FIELD.items()}
        fields = {(name, value): places(lambda p: p[_FIELD[name]] == value) for name, value in values}
        outputs = {flight: places(lambda p: p[2] == flight) for flight in ("later", "first")}
        return cls(len(layout), sources, fields, {f: at for f, at in outputs.items() if at},
                   sorted({point[6] for point in layout if point[6] is not None}))


def held_evaluation(table: CostTable, held: HeldAllStep, choices: list[int]) -> Evaluation:
    """The rank's evaluation as it runs its units (`_layout`)."""
    e = evaluate(table, choices)
    layout = _layout([p.label for p in e.points], held)
    timelines = {name: e.points if name == "base" else evaluate(t, choices).points
                 for name, t in _sources(table, layout).items()}
    flights = {"later": sum(held.activations[u][c] for u, c in enumerate(choices)),
               "first": sum(held.first[u][c] for u, c in enumerate(choices)) if held.first else 0}
    gathered = sum(held.gathered[u][c] for u, c in enumerate(choices))
    grads = sum(held.grads[u][c] for u, c in enumerate(choices))
    points = []
    for i, source, flight, with_gathered, with_grads, suffix, split in layout:
        p = timelines[source][i]
        parts = dict(p.parts)
        parts[MemCategory.ACTIVATIONS] += held.buffers + (flights[flight] if flight else 0) + _outputs(held, flight)
        if split is not None:
            parts[MemCategory.ACTIVATIONS] += sum(held.split[split][u][c] for u, c in enumerate(choices))
        parts[MemCategory.GATHERED] += gathered if with_gathered else 0
        parts[MemCategory.GRADS] += grads if with_grads else 0
        points.append(MemoryPoint(p.label + suffix, parts))
    peak = max(range(len(points)), key=lambda i: total(points[i]))
    return replace(e, points=points, peak_index=peak)


def rank_evaluation(cache: dict, key: tuple, table: CostTable, held: HeldAllStep, choices: list[int]) -> Evaluation:
    """`held_evaluation`, once per `key` and `choices` in `cache` (a caller's, per search): the key holds what else the
    evaluation reads but the units' paths (the kind of stage, micro-batch, m, what the rank holds), so ranks of one
    kind share it, each with its own units' labels: relabelled from the first rank's units by position (a label names
    a unit by its path); computed afresh where a path could be read as a label's other word or the units differ in
    number."""
    key = (*key, tuple(choices))
    found = cache.get(key)
    if found is None:
        found = cache[key] = (table.units, held_evaluation(table, held, choices))
    units, evaluation = found  # a copy each time, as each rank had its own
    paths = {a.path or "<root>": b.path or "<root>" for a, b in zip(units, table.units)}
    alike = len(units) == len(table.units) == len(paths) and _relabels(paths)
    labels = [_relabel(p.label, paths) for p in evaluation.points] if alike else [None]
    if None in labels:
        return held_evaluation(table, held, choices)
    return replace(evaluation, choices=list(evaluation.choices),
                   points=[MemoryPoint(label, dict(p.parts)) for label, p in zip(labels, evaluation.points)])


_UNNAMED = ("loss", "step")  # what follows a label's first word where it names no unit ("bwd loss", "optimizer step")


def _relabels(paths: dict[str, str]) -> bool:
    """Whether labels can be relabelled by these paths: none is a word a label holds in place of a unit's path, or
    holds a space or a comma."""
    names = set(paths) | set(paths.values())
    return not names & set(_UNNAMED) and not any(" " in name or "," in name for name in names)


def _relabel(label: str, paths: dict[str, str]) -> str | None:
    """A time point's label ("fwd layers.3", "optimizer step layers.3", "bwd loss", each maybe with `_FIRST`) with its
    unit's path replaced (`paths`: old -> new); a label naming no unit as it is; None for a label of another form."""
    prefix = "optimizer step " if label.startswith("optimizer step ") else label.partition(" ")[0] + " "
    rest, suffix = label[len(prefix):], _FIRST if label.endswith(_FIRST) else ""
    path = rest[:len(rest) - len(suffix)]
    if path in paths:
        return prefix + paths[path] + suffix
    return label if path in _UNNAMED else None


def leanest(table: CostTable, held: HeldAllStep) -> list[int]:
    """Per unit, the option holding least (a rough leanest plan, for the message where nothing fits)."""
    return [min(range(len(costs)), key=lambda o: (costs[o].activation_bytes + held.total(u, o) + costs[o].param_bytes
                                                   + costs[o].optimizer_bytes, o))
            for u, costs in enumerate(table.costs)]
