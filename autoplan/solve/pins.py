"""Pins at solve time: which units each pin names, the options it leaves them, and why pins that fit
nothing fail.

A pin's pattern is matched against the granularity's units; a pattern that names no unit but names
modules makes those modules units (what torchprime's config and the FSDP guide call wrapping a
module). A pinned unit keeps only the options its merged decision allows: the cost table is
restricted, so the solver sees a smaller problem (and its symmetry breaking sees pinned units as
what they are, different from their free neighbours). Every mistake is a UsageError naming the pin:
a pattern that matches nothing (with the nearest module paths), a decision that is not an option for
a unit (with the options there and why), two pins that disagree on a unit (both named).

When nothing fits with the pins, the pins are the cause only if a plan fits without them; then the
pins that cannot all hold are found with CP-SAT assumptions (one literal per pin, and
`SufficientAssumptionsForInfeasibility`), reduced to a minimal set by dropping one at a time.
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, replace

import numpy as np
import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.pins import Decision, Pin, PinSet, PinsInfeasibleError
from autoplan.sizes import format_bytes
from autoplan.solve.solver import AffineModel, solve_min_memory
from autoplan.tracing.units import unit_refusal
from cost_models.choices import Option
from cost_models.table import CostTable

__all__ = ["PinResolution", "resolve_pins"]

MAX_CORES = 4  # sets of pins that cannot all hold, reported at most
POINTS_PER_ROUND = 8


def _nearest(pattern: str, paths: list[str]) -> str:
    names = ["<root>"] + [p for p in paths if p]
    near = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
    if not near:
        stem = pattern.split(".")[0]
        near = [p for p in names if p.split(".")[0] == stem][:5] or names[1:6]
    return ", ".join(near)


@dataclass
class PinResolution:
    """The pins, the units each names, and per pinned unit the merged decision and the pins behind it."""

    pins: list[Pin]
    matched: list[list[str]]  # per pin, the unit paths it names
    by_unit: dict[str, tuple[Decision, list[Pin]]]
    extra_units: tuple[str, ...]  # modules the pins make units

    def records(self) -> list[tuple[str, str]]:
        """(pattern, decision) per pin, as the plan file records them."""
        return [(pin.pattern.text, pin.decision.text()) for pin in self.pins]

    def allowed(self, table: CostTable) -> list[list[int] | None]:
        """Per unit of `table`, the option indices its pins leave (None: not pinned); UsageError where none."""
        out: list[list[int] | None] = []
        for unit, options in zip(table.units, table.options):
            pinned = self.by_unit.get(unit.path)
            if pinned is None:
                out.append(None)
                continue
            decision, pins = pinned
            keep = [i for i, option in enumerate(options) if decision.allows(option)]
            if not keep:
                raise UsageError(_not_an_option(unit, options, decision, pins, table))
            out.append(keep)
        return out

    def decisions(self, units) -> tuple[str | None, ...]:
        """Per unit, its pinned decision (None: not pinned): what tells a pinned block from its free twins."""
        return tuple(self.by_unit[u.path][0].text() if u.path in self.by_unit else None for u in units)

    def restrict(self, table: CostTable) -> CostTable:
        """`table` with each pinned unit's options cut to those its pins allow."""
        allowed = self.allowed(table)
        options = [opts if keep is None else [opts[i] for i in keep] for opts, keep in zip(table.options, allowed)]
        costs = [cost if keep is None else [cost[i] for i in keep] for cost, keep in zip(table.costs, allowed)]
        return replace(table, options=options, costs=costs)

    def overlay(self, table: CostTable, choices: list[int]) -> list[int]:
        """`choices` (into `table`) with each pinned unit moved to the allowed option closest to its own."""
        out = list(choices)
        for u, keep in enumerate(self.allowed(table)):
            if keep is None or out[u] in keep:
                continue
            base = table.options[u][out[u]]
            out[u] = max(keep, key=lambda i: (sum(getattr(table.options[u][i], f) == getattr(base, f)
                                                  for f in ("sharding", "checkpoint", "offload")), -i))
        return out

    def explain_infeasible(self, table: CostTable, limit_bytes: int, model_name: str, mem_limit_bytes: int,
                           headroom: float, time_limit_s: float, model=None) -> PinsInfeasibleError | None:
        """The error for pins that no plan under `limit_bytes` can keep at `table` (unrestricted), or
        None when no plan fits without them either (the pins are not the cause). `model(t)`: the solver's model
        of `table` or a restriction of it (default `AffineModel.of`; a pipeline rank's holds more: stage_solve)."""
        model = model or AffineModel.of
        full = model(table)
        without = solve_min_memory(table, time_limit_s=time_limit_s, affine=full)
        if without.objective is None or without.objective > limit_bytes:
            return None
        restricted = self.restrict(table)
        pinned = solve_min_memory(restricted, time_limit_s=time_limit_s, affine=model(restricted))
        peak_with = int(pinned.objective) if pinned.objective is not None else None
        peak_without = int(without.objective)
        cores = _cores(self, table, limit_bytes, time_limit_s, full)
        blamed = [pin for core in cores for pin in core]
        if not cores:
            loosen = "the solver could not tell which pins within `time_limit_s`; loosen some of them"
        else:
            loosen = "; and ".join(
                f"the pin {core[0]} cannot hold by itself; loosen it" if len(core) == 1 else
                "the pins " + ", ".join(str(p) for p in core[:-1]) + f" and {core[-1]} cannot all hold; loosen one "
                "of them" for core in cores)
        return PinsInfeasibleError(
            f"no plan for {model_name} fits in {format_bytes(mem_limit_bytes)} per GPU less {headroom:.0%} "
            f"headroom with these pins, and one does without them: the smallest peak with the pins is "
            f"{format_bytes(peak_with) if peak_with is not None else 'unknown'}, without them "
            f"{format_bytes(peak_without)} (micro-batch {table.micro_batch_size}). {loosen[0].upper() + loosen[1:]}.",
            pins=blamed, peak_with=peak_with, peak_without=peak_without,
            min_mem_bytes=int(np.ceil(peak_with / (1 - headroom))) if peak_with is not None else None,
        )


def resolve_pins(pins: PinSet, unit_paths: list[str], model: nn.Module, model_name: str = "the model") -> PinResolution:
    """Match every pin against the units (else the modules) of `model`; UsageError naming the pin for a
    pattern that matches nothing, a module that cannot be a unit, or two pins that disagree on a unit."""
    modules = [name for name, _ in model.named_modules()]
    units = set(unit_paths)
    matched: list[list[str]] = []
    extra: list[str] = []
    for pin in pins:
        paths = [p for p in unit_paths if pin.pattern.matches(p)]
        if not paths:
            paths = [p for p in modules if p and p not in units and pin.pattern.matches(p)]
            if not paths:
                raise UsageError(f"pin {pin} matches no module of {model_name}; nearest module paths: "
                                 f"{_nearest(pin.pattern.text, modules)}")
            for path in paths:
                why = unit_refusal(model, path)
                if why:
                    raise UsageError(f"pin {pin} names {path}, which cannot be a unit: {why}")
            extra += [p for p in paths if p not in extra]
        matched.append(paths)
    by_unit: dict[str, tuple[Decision, list[Pin]]] = {}
    for pin, paths in zip(pins, matched):
        for path in paths:
            if path not in by_unit:
                by_unit[path] = (pin.decision, [pin])
                continue
            decision, behind = by_unit[path]
            merged = decision.merged(pin.decision)
            if merged is None:
                other = next(p for p in behind if p.decision.merged(pin.decision) is None)
                fields = [f for f in other.decision.fixed if f in pin.decision.fixed
                          and other.decision.fixed[f] != pin.decision.fixed[f]]
                raise UsageError(
                    f"pins {other} and {pin} disagree on unit {path or '<root>'} ("
                    + ", ".join(f"{f} {other.decision.fixed[f]} against {pin.decision.fixed[f]}" for f in fields)
                    + "); remove one, or narrow its pattern (e.g. a range such as 0-5)")
            by_unit[path] = (merged, behind + [pin])
    return PinResolution(list(pins), matched, by_unit, tuple(extra))


def _not_an_option(unit, options: list[Option], decision: Decision, pins: list[Pin], table: CostTable) -> str:
    name = unit.path or "<root>"
    fixed = decision.fixed
    why = ""
    if fixed.get("checkpoint", "none") != "none" and not any(o.checkpoint == fixed["checkpoint"] for o in options):
        why = ("the root is never checkpointed (its forward is the whole step)" if unit.is_root else
               f"checkpointing applies to units with no units inside them, and {name} holds {', '.join(unit.children[:3])}")
    elif fixed.get("offload") and not any(o.offload for o in options):
        why = ("offload needs a profile that prices the host link (its host_link)" if table.host_limit_bytes is None
               else f"{name} owns no parameters to offload")
    elif "sharding" in fixed and not any(o.sharding == fixed["sharding"] for o in options):
        kind = Option(fixed["sharding"]).kind
        why = (f"{kind.name} needs two or more nodes" if kind.multi_node_only and table.mesh.nodes < 2 else
               f"the root is not offered kinds that keep parameters gathered ({kind.name})"
               if unit.is_root and not kind.reshard_after_forward else f"{kind.name} is not offered there")
    pinned_by = pins[0] if len(pins) == 1 else "pins " + " and ".join(str(p) for p in pins)
    return (f"pin {pinned_by}: {decision.text()} is not an option for unit {name}"
            + (f": {why}" if why else "") + f"; its options: {', '.join(o.label for o in options)}")


def _cores(resolution: PinResolution, table: CostTable, limit_bytes: int, time_limit_s: float,
           affine: AffineModel) -> list[list[Pin]]:
    """Sets of pins that cannot all hold under `limit_bytes` (each minimal), until the rest can (`affine`: the
    table's solver model)."""
    deadline = time.perf_counter() + time_limit_s
    index = {unit.path: u for u, unit in enumerate(table.units)}
    active = list(range(len(resolution.pins)))
    cores: list[list[Pin]] = []
    while len(cores) < MAX_CORES:
        core = _core(affine, table, resolution, index, active, limit_bytes, deadline)
        if not core:
            break
        for pin in list(core):  # drop what the rest still fails without
            if len(core) > 1 and _core(affine, table, resolution, index, [p for p in core if p != pin],
                                       limit_bytes, deadline):
                core.remove(pin)
        cores.append([resolution.pins[i] for i in core])
        active = [i for i in active if i not in core]
    return cores


def _core(affine: AffineModel, table: CostTable, resolution: PinResolution, index: dict[str, int],
          active: list[int], limit_bytes: int, deadline: float) -> list[int] | None:
    """Pins among `active` that CP-SAT finds cannot all hold (None: they can, or no verdict in time)."""
    offsets = affine.algebra.offsets
    points = set(np.argsort(-affine.memory(affine.leanest_each()), kind="stable")[:2].tolist())
    while time.perf_counter() < deadline:
        from ortools.sat.python import cp_model  # only where pins make a search infeasible

        model = cp_model.CpModel()
        x = [model.new_bool_var(f"x_{l}") for l in range(affine.algebra.size)]
        for u in range(len(offsets) - 1):
            model.add_exactly_one(x[offsets[u]:offsets[u + 1]])
        if affine.host_coef is not None:
            model.add(sum(int(c) * x[l] for l, c in enumerate(affine.host_coef) if c) <= affine.host_limit_bytes)
        for point in sorted(points):
            coef = affine.mem_row(point)
            nonzero = np.flatnonzero(coef)
            model.add(cp_model.LinearExpr.weighted_sum([x[l] for l in nonzero], [int(coef[l]) for l in nonzero])
                      + int(affine.mem_const[point]) <= limit_bytes)
        holds = {}
        for i in active:
            literal = model.new_bool_var(f"pin_{i}")
            holds[literal.index] = i
            pin = resolution.pins[i]
            for path in resolution.matched[i]:
                u = index.get(path)
                for o, option in enumerate(table.options[u] if u is not None else []):
                    if not pin.decision.allows(option):
                        model.add_implication(literal, x[offsets[u] + o].Not())
            model.add_assumption(literal)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
        status = solver.solve(model)
        if status == cp_model.INFEASIBLE:
            return sorted(holds[v] for v in solver.sufficient_assumptions_for_infeasibility() if v in holds)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        choices = [int(np.argmax([solver.value(v) for v in x[offsets[u]:offsets[u + 1]]])) for u in range(len(offsets) - 1)]
        memory = affine.memory(choices)
        violated = [int(p) for p in np.argsort(-memory, kind="stable") if memory[p] > limit_bytes and p not in points]
        if not violated:
            return None
        points.update(violated[:POINTS_PER_ROUND])
    return None
