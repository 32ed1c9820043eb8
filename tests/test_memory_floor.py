"""The memory floor (cost_models.memory_floor): never above any plan's highest memory row, and the sweep that stops
on it (no rows, no solve where even the floor overruns) gives the plans and records the solves gave."""

from __future__ import annotations

import numpy as np
import pytest

import autoplan
from autoplan.api.prepare import prepare
from autoplan.settings import SearchSettings
from autoplan.solve import solver, sweep
from autoplan.solve.sweep import _tables
from cost_models.memory_floor import memory_floor

CASES = [  # (model, memory limit, settings): sweeps that end where nothing fits, with and without the allocator fit
    ("gpt2-tiny", "40MB", dict(gpus=2, seq_len=64, profile="cpu-gloo-2")),
    ("llama-tiny", "30MB", dict(gpus=2, seq_len=64, profile="cpu-gloo-2", granularity="fine")),
    ("gpt2-tiny", "300MB", dict(gpus=8, seq_len=128, profile="h100-sxm-80gb")),  # fitted to what the allocator needs
    ("llama-tiny", "300MB", dict(gpus=8, seq_len=128, profile="h100-sxm-80gb", tp=2)),
]


@pytest.mark.parametrize(("model", "mem", "settings"), CASES)
def test_no_plan_is_under_the_floor(model, mem, settings):
    request = prepare(SearchSettings.create(None, model=model, mem=mem, **settings))
    mesh = request.meshes[0]  # tp 1, or the degree asked for
    source = request.tables.for_layout(None) if mesh.tp == 1 else None
    if source is None:
        from autoplan.solve.one_mesh import _recognised  # the tensor-parallel view of the tables, as the search's
        source = request.tables.for_layout(_recognised(request, mesh.tp, mesh.sequence_parallel))
    cluster = request.cluster.with_mesh(mesh)
    generator = np.random.default_rng(0)
    for micro_batch in (1, 4, 16):
        table = _tables(request, source, cluster, micro_batch, 1)[1]
        floor, affine = memory_floor(table), solver.AffineModel.of(table)
        plans = [[int(generator.integers(len(o))) for o in table.options] for _ in range(40)]
        plans += [affine.leanest_each(), affine.unconstrained_fastest()]
        peaks = [int(affine.memory(plan).max()) for plan in plans]
        assert floor <= min(peaks)
        lean = solver.solve_min_memory(table, affine=affine)  # the least peak any plan has: the floor is under it
        assert floor <= int(affine.memory(lean.choices).max())
        assert floor > 0


@pytest.mark.parametrize(("model", "mem", "settings"), CASES)
def test_the_sweep_stopped_by_the_floor_gives_the_solves_plan_and_record(model, mem, settings, monkeypatch):
    solves = []
    solve = sweep.solve_min_time
    monkeypatch.setattr(sweep, "solve_min_time", lambda *args, **kwargs: solves.append(1) or solve(*args, **kwargs))
    stopped = autoplan.search(model, mem, **settings)
    stopped_solves = len(solves)
    monkeypatch.setattr(sweep, "memory_floor", lambda table: 0)  # every micro-batch solved
    solved = autoplan.search(model, mem, **settings)
    assert stopped.model_dump(exclude={"timing"}) == solved.model_dump(exclude={"timing"})
    assert stopped.solver.micro_batch_sweep[-1].status == "INFEASIBLE"
    assert stopped_solves < len(solves) - stopped_solves  # the floor, not a solve, found where nothing fits
