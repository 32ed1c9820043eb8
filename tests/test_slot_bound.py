"""The memory-aware bound on a pipeline rank's micro-batch (autoplan.solve.slot_bound): below every plan that fits,
checked against every plan of small problems, and a pipelined search pruned by it keeps its plan."""

from __future__ import annotations

import itertools
import json

import numpy as np

import autoplan
from autoplan.solve.slot_bound import slot_lower_bound

TOY = dict(seq_len=128, profile="h100-sxm-80gb", fit_to="allocated")


def _problem(rng: np.random.Generator):
    units, options, points = rng.integers(2, 6), rng.integers(2, 5), rng.integers(1, 7)
    times = rng.uniform(0.1, 1.0, units * options)
    rows = rng.integers(0, 1000, (points, units * options))
    # the limit between the leanest and the fastest plan's bytes, so memory binds some of the time
    lean = np.minimum.reduceat(rows, np.arange(0, units * options, options), axis=1).sum(axis=1)
    room = rng.integers(lean, rows.max(axis=1) * units + 1)
    return times, np.arange(0, units * options + 1, options), rows, room


def _fastest_that_fits(times, offsets, rows, room) -> float | None:
    best = None
    for plan in itertools.product(*(range(a, b) for a, b in zip(offsets[:-1], offsets[1:]))):
        x = np.zeros(len(times), dtype=np.int64)
        x[list(plan)] = 1
        if ((rows @ x) <= room).all():
            best = min(best or np.inf, float(times[list(plan)].sum()))
    return best


def test_the_bound_is_below_every_plan_that_fits_and_above_the_memory_blind_one():
    rng = np.random.default_rng(7)
    fits = bounded = tighter = 0
    for _ in range(300):
        times, offsets, rows, room = _problem(rng)
        bound, fastest = slot_lower_bound(times, offsets, rows, room), _fastest_that_fits(times, offsets, rows, room)
        blind = float(np.minimum.reduceat(times, offsets[:-1]).sum())
        if fastest is None:
            assert bound is None  # a bound is given only where a plan is shown to fit
            continue
        fits += 1
        if bound is None:
            continue
        bounded += 1
        assert blind - 1e-12 <= bound <= fastest + 1e-9
        tighter += bound > blind + 1e-9
    # it bounds most problems that have a plan, and memory raises many of the bounds
    assert fits > 100 and bounded > 0.85 * fits and tighter > 0.3 * bounded


def test_a_pipelined_mesh_pruned_by_its_ranks_memory_keeps_the_plan(monkeypatch):
    """At 10 MB the toy's pipeline degree 2 loses to the plan without a pipeline once each rank's memory is in its
    bound (memory-blind, it was solved); the plan, and the entries of the meshes searched, stay."""
    from autoplan.solve import pipeline

    settings = dict(nodes=4, gpus_per_node=2, tp=1, global_batch=32, **TOY)
    pruned = autoplan.search("llama-tiny", "10MB", **settings)
    notes = {entry.pp_degree: entry.note for entry in pruned.solver.tp_degrees}
    assert notes[2].startswith("pruned: no pipelined plan beats") and "within its rank's memory" in notes[2]
    monkeypatch.setattr(pipeline, "rank_slot_bound", lambda *args: None)  # every rank's bound memory-blind
    blind = autoplan.search("llama-tiny", "10MB", **settings)
    entries = {entry.pp_degree: entry for entry in blind.solver.tp_degrees}
    assert entries[2].note == "" and entries[2].throughput_samples_s < pruned.predicted.throughput_samples_s
    strip = lambda plan: {k: v for k, v in json.loads(plan.to_json()).items() if k not in ("timing", "solver")}  # noqa: E731
    assert strip(blind) == strip(pruned)
    assert [e for e in blind.solver.tp_degrees if e.pp_degree == 1] == \
        [e for e in pruned.solver.tp_degrees if e.pp_degree == 1]
