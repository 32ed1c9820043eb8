"""Pipelines in the search: `pp` and `schedule`, the stages a plan records, their report, explain, diff and
estimate (the search side of issue 28; the run is autoplan.run's)."""

import json

import pytest

import autoplan
from autoplan.api.inspect import diff, explain
from autoplan.plan.schema import Plan, load_plan
from cost_models.pipeline import bubble_slots, deferred, in_flight, refusal, stages_per_rank
from cost_models.schedules import SCHEDULES

TOY = dict(seq_len=128, profile="h100-sxm-80gb", fit_to="allocated")


@pytest.fixture(scope="module")
def pipelined() -> Plan:
    return autoplan.search("llama-tiny", "80GB", gpus=4, pp=2, tp=1, batch_size=2, global_batch=32, **TOY)


def _modules(plan: Plan) -> list[str]:
    return [module for stage in plan.pipeline.stages for module in stage.modules]


def test_fixed_degree_plans_a_pipeline_of_whole_units(pipelined):
    pipe = pipelined.pipeline
    assert pipelined.cluster.pp_degree == 2 and pipe.degree == 2
    # global batch 32 over 4 GPUs in 2 stages: 2 data-parallel ranks, micro-batch 2, so 8 micro-batches per step
    assert pipe.microbatches == 8 and pipelined.training.global_batch_size == 32
    assert sorted({stage.rank for stage in pipe.stages}) == [0, 1]
    blocks = ["tok_embeddings", "layers.0", "layers.1", "norm", "lm_head"]
    assert _modules(pipelined) == blocks  # every module once, in forward order
    planned = {unit.module for unit in pipelined.units}
    assert {u for stage in pipe.stages for u in stage.units} <= planned
    assert max(stage.peak_mem_bytes for stage in pipe.stages) == pipelined.predicted.peak_mem_bytes
    assert pipe.bubble_s > 0 and pipe.p2p_s > 0


def test_plan_file_round_trip_and_estimate_of_it(pipelined, tmp_path):
    path = tmp_path / "pp.json"
    path.write_text(pipelined.to_json())
    loaded = load_plan(path)
    assert loaded.to_json() == pipelined.to_json()
    est = autoplan.estimate(plan=path)
    assert est.pipeline == pipelined.pipeline
    assert est.predicted.peak_mem_bytes == pipelined.predicted.peak_mem_bytes
    assert est.predicted.step_time_s == pytest.approx(pipelined.predicted.step_time_s, rel=1e-9)


def test_search_is_deterministic(pipelined):
    again = autoplan.search("llama-tiny", "80GB", gpus=4, pp=2, tp=1, batch_size=2, global_batch=32, **TOY)
    strip = lambda plan: {k: v for k, v in json.loads(plan.to_json()).items() if k != "timing"}  # noqa: E731
    assert strip(again) == strip(pipelined)


def test_fixed_schedule_holds_every_micro_batch_under_gpipe():
    plan = autoplan.search("llama-tiny", "80GB", gpus=4, pp=2, tp=1, schedule="gpipe", batch_size=1,
                           global_batch=8, **TOY)
    pipe = plan.pipeline
    assert pipe.schedule == "gpipe" and pipe.microbatches == 4
    assert all(stage.in_flight == 4 for stage in pipe.stages)


def test_four_stages_on_parts_of_a_node():
    plan = autoplan.search("llama-tiny", "80GB", gpus=4, pp=4, tp=1, schedule="1f1b", batch_size=1, **TOY)
    pipe = plan.pipeline
    assert [stage.rank for stage in pipe.stages] == [0, 1, 2, 3]
    assert [stage.in_flight for stage in pipe.stages] == [4, 3, 2, 1]  # 1F1B: pp - rank in flight
    assert len(set(_modules(plan))) == len(_modules(plan))


def test_pins_hold_inside_a_pipeline_and_alike_stages_are_not_pinned_with_them():
    # 4 stages; the second and third (layers.1, layers.2) are of one kind, which share tables and solves
    common = dict(gpus=4, pp=4, tp=1, schedule="1f1b", batch_size=1, **TOY)
    free = autoplan.search("llama-tiny[n_layers=4]", "80GB", **common)
    plan = autoplan.search("llama-tiny[n_layers=4]", "80GB", pin=["layers.2=shard+ckpt"], **common)
    assert [stage.modules for stage in plan.pipeline.stages][1:3] == [["layers.1"], ["layers.2"]]
    decide = lambda p: {u.module: (u.sharding, u.checkpoint) for u in p.units}  # noqa: E731
    assert decide(free)["layers.2"] != ("shard", "full") and decide(plan)["layers.2"] == ("shard", "full")
    assert decide(plan)["layers.1"] != ("shard", "full")  # its twin's stage is not pinned with it
    assert [(pin.pattern, pin.decision) for pin in plan.pins] == [("layers.2", "shard+ckpt")]


def test_pins_a_pipeline_cannot_hold_are_named_in_the_message(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    args = ["search", "--model", "llama-tiny", "--gpus", "4", "--pp", "2", "--tp", "1", "--batch-size", "2",
            "--global-batch", "32", "--seq-len", "128", "--profile", "h100-sxm-80gb", "--fit-to", "allocated",
            "--mem", "3MB", "-o", str(out)]
    assert run_cli(*args).returncode == 0  # without the pin a plan fits
    out.unlink()
    pinned = run_cli(*args, "--pin", "layers.*=replicate")
    # the pins are the cause (a pipelined plan fits without them), named on the rank where they fail
    assert pinned.returncode == 3 and "on pipeline rank 0 of 2" in pinned.stderr, pinned.stderr
    assert "and one does without them" in pinned.stderr
    assert "The pin `layers.*: replicate` (from --pin) cannot hold by itself; loosen it." in pinned.stderr
    assert not out.exists()
    tight = run_cli(*[a if a != "3MB" else "1MB" for a in args], "--pin", "layers.*=replicate")
    assert tight.returncode == 3 and "on pipeline degree 2 with the pins:" in tight.stderr
    assert "The pins are not the cause: without them no pipelined plan fits either." in tight.stderr
    assert not out.exists()


def test_report_shows_stages_and_what_the_pipeline_costs(pipelined):
    text = pipelined.table()
    assert "mesh 2 pipeline x 2 data-parallel" in text
    assert "pipeline: " in text and "costs: bubble" in text and "in flight" in text


def test_default_search_on_two_nodes_tries_pipelines_beside_the_rest():
    plan = autoplan.search("llama-tiny", "80GB", nodes=2, gpus_per_node=2, tp=1, global_batch=16, **TOY)
    degrees = {entry.pp_degree for entry in plan.solver.tp_degrees}
    assert degrees == {1, 2}  # a toy's low MFU leaves a pipeline room to pay
    text = plan.table()
    if plan.pipeline is None:
        assert "no pipeline:" in text
    else:
        assert any(b.name == "no-pipeline" for b in plan.baselines)


def test_pipelined_meshes_that_cannot_beat_the_plan_without_one_are_pruned_to_the_same_plan(monkeypatch):
    from autoplan.plan.pipeline_report import pipeline_lines
    from autoplan.solve import one_mesh

    settings = dict(nodes=4, gpus_per_node=2, tp=1, global_batch=32, **TOY)
    pruned = autoplan.search("llama-tiny", "80GB", **settings)
    notes = {entry.pp_degree: entry.note for entry in pruned.solver.tp_degrees}
    assert notes[4].startswith("pruned: no pipelined plan beats") and notes[2] == "" and notes[1] == ""
    assert any("1 pipelined mesh not searched" in line for line in pipeline_lines(pruned))
    searched = one_mesh.search_pipeline
    monkeypatch.setattr(one_mesh, "search_pipeline",
                        lambda request, mesh, layout, schedule, beat, bounds: searched(request, mesh, layout, schedule))
    full = autoplan.search("llama-tiny", "80GB", **settings)
    entries = {entry.pp_degree: entry for entry in full.solver.tp_degrees}
    assert entries[4].note == "" and entries[4].throughput_samples_s < pruned.predicted.throughput_samples_s
    strip = lambda plan: {k: v for k, v in json.loads(plan.to_json()).items() if k not in ("timing", "solver")}  # noqa: E731
    assert strip(full) == strip(pruned)  # the same plan: only the pruned mesh's entry differs
    assert [e for e in full.solver.tp_degrees if e.pp_degree < 4] == \
        [e for e in pruned.solver.tp_degrees if e.pp_degree < 4]


@pytest.mark.parametrize("known", [False, True])
def test_pipelined_meshes_searched_before_the_beat_is_known_give_the_plan_made_mesh_by_mesh(monkeypatch, known):
    """With workers, the pipelined meshes start beside the meshes without a pipeline, before the throughput they
    must beat is known: such a search prunes nothing against it and stands only where every bound it compared is
    above the beat (else it is searched again with it). Here every pipelined mesh of the first round is searched so
    (the beat never handed to the workers) or none is (each claimed after the beat), and the plan, every mesh's entry
    (pp 4's `pruned`) included, is the one made mesh by mesh."""
    from autoplan.solve import mesh_search, mesh_workers

    settings = dict(nodes=4, gpus_per_node=2, tp=1, global_batch=32, **TOY)
    one_by_one = autoplan.search("llama-tiny", "80GB", **settings)
    monkeypatch.setattr(mesh_search, "PARALLEL_MIN_UNITS", 0)
    monkeypatch.setattr(mesh_search.os, "sched_getaffinity", lambda pid: {0, 1})  # one worker even on 1 core
    if not known:
        monkeypatch.setattr(mesh_workers.MeshWorkers, "publish", lambda self, value: None)
    else:  # the meshes without a pipeline (the first, here) found before any pipelined mesh is claimed
        monkeypatch.setattr(mesh_workers.MeshWorkers, "_claim", _after_the_first(mesh_workers.MeshWorkers._claim))
    forked = autoplan.search("llama-tiny", "80GB", **settings)
    assert forked.solver.tp_degrees[-1].note.startswith("pruned: no pipelined plan beats")
    assert json.loads(forked.to_json()) | {"timing": None} == json.loads(one_by_one.to_json()) | {"timing": None}


def test_pipelined_meshes_begun_where_no_pipeline_pays_are_left_out_as_mesh_by_mesh(monkeypatch):
    """Where the best plan without a pipeline leaves a pipeline nothing to win, the pipelined meshes the workers began
    beside the others are dropped (the round stopped, their results not waited for): the plan made mesh by mesh."""
    from autoplan.solve import mesh_search, mesh_workers

    monkeypatch.setattr(mesh_search, "PIPELINE_MFU", 0.0)  # no model FLOPs use is below it: a pipeline never pays
    settings = dict(nodes=2, gpus_per_node=2, tp=1, global_batch=16, **TOY)
    one_by_one = autoplan.search("llama-tiny", "80GB", **settings)
    assert one_by_one.pipeline is None and all(entry.pp_degree == 1 for entry in one_by_one.solver.tp_degrees)
    monkeypatch.setattr(mesh_search, "PARALLEL_MIN_UNITS", 0)
    monkeypatch.setattr(mesh_search.os, "sched_getaffinity", lambda pid: {0, 1})  # one worker even on 1 core
    stopped, stop = [], mesh_workers.MeshWorkers.stop
    monkeypatch.setattr(mesh_workers.MeshWorkers, "stop", lambda self: stopped.append(1) or stop(self))
    forked = autoplan.search("llama-tiny", "80GB", **settings)
    assert stopped == [1]
    assert json.loads(forked.to_json()) | {"timing": None} == json.loads(one_by_one.to_json()) | {"timing": None}


def _after_the_first(claim):
    """MeshWorkers._claim where the workers claim nothing before the beat is handed to them (the search's first
    mesh, the only one without a pipeline here, is this process's)."""
    import math
    import os
    import time

    parent = os.getpid()

    def claimed(self, tasks):
        while os.getpid() != parent and math.isnan(self._shared[1]) and not self._shared[2]:
            time.sleep(0.01)
        return claim(self, tasks)
    return claimed


def test_explain_covers_the_stages_and_their_boundaries():
    plan = autoplan.search("llama-tiny", "80GB", gpus=2, pp=2, tp=1, schedule="1f1b", batch_size=1, **TOY)
    why = explain(plan)
    text = why.table()
    assert "stage 0 (rank 0)" in text and "stage 1 (rank 1)" in text
    assert "boundary 0|1 a unit earlier" in text and "boundary 0|1 a unit later" in text
    assert {group.pattern for group in why.groups} >= {"layers.0", "layers.1"} or \
        any(group.pattern == "layers.0-1" for group in why.groups)


def test_diff_names_the_stages_that_differ(pipelined):
    other = autoplan.search("llama-tiny", "80GB", gpus=4, pp=2, tp=1, schedule="1f1b", batch_size=2,
                            global_batch=32, **TOY)
    found = diff(pipelined, other)
    if pipelined.pipeline.schedule != "1f1b":
        assert any("schedule" in line for line in found.settings)
    assert "stage 0:" in found.table() or _modules(pipelined) == _modules(other)
    flat = autoplan.search("llama-tiny", "80GB", gpus=4, tp=1, batch_size=2, global_batch=32, **TOY)
    assert "pipeline degree 1 -> 2" in diff(flat, pipelined).table()


def test_estimate_with_pp_balances_a_uniform_strategy():
    est = autoplan.estimate("llama-tiny", "shard", gpus=4, pp=2, seq_len=128, profile="h100-sxm-80gb")
    pipe = est.pipeline
    assert pipe.schedule == "1f1b" and len(pipe.stages) == 2 and pipe.microbatches == 8
    assert all(unit.sharding == "shard" for unit in est.units if unit.module)
    assert "pipeline: 2 stages" in est.table()


def test_estimate_with_pp_takes_pins_over_the_strategy():
    est = autoplan.estimate("llama-tiny[n_layers=4]", "shard", gpus=4, pp=4, seq_len=128, profile="h100-sxm-80gb",
                            pin=["layers.2=shard+ckpt"])
    checkpoint = {unit.module: unit.checkpoint for unit in est.units}
    assert checkpoint["layers.2"] == "full" and checkpoint["layers.1"] == checkpoint["layers.3"] == "none"
    assert est.strategy.startswith("shard + 1 pin") and "pinned: layers.2: shard+ckpt" in est.description


def test_bad_pipeline_degree_and_schedule_are_usage_errors(run_cli, tmp_path):
    result = run_cli("search", "--model", "llama-tiny", "--gpus", "4", "--pp", "3", "--seq-len", "64")
    assert result.returncode == 2 and "--pp 3 does not cut" in result.stderr and "1, 2, 4" in result.stderr
    result = run_cli("search", "--model", "llama-tiny", "--gpus", "4", "--pp", "2", "--schedule", "nope")
    assert result.returncode == 2 and "1f1b" in result.stderr
    assert not (tmp_path / "plan.json").exists()


def test_a_limit_the_allocator_margin_takes_whole_is_infeasible_with_the_limit_that_would_fit(run_cli, tmp_path):
    # 60 MB on a CUDA profile: the caching allocator's margin alone is over it, so no rank of any pipeline fits
    # (this divided by the zero bytes left to plan); the answer is the search's infeasible exit and what would fit
    out = tmp_path / "plan.json"
    result = run_cli("search", "--model", "llama-tiny", "--mem", "60MB", "--nodes", "2", "--gpus-per-node", "2",
                     "--seq-len", "64", "--batch-size", "4", "-o", str(out))
    assert result.returncode == 3, result.stderr
    assert "allocator's margin is what does not" in result.stderr and "a limit of at least" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    result = run_cli("search", "--model", "llama-tiny", "--mem", "60MB", "--nodes", "2", "--gpus-per-node", "2",
                     "--seq-len", "64", "--batch-size", "4", "--pp", "2", "-o", str(out))
    assert result.returncode == 3 and "pipeline degree 2" in result.stderr and "a limit of at least" in result.stderr


def test_schedule_formulas():
    one, gpipe, looped, zero, zbv = (SCHEDULES[name] for name in
                                     ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv"))
    assert [in_flight(one, 4, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(gpipe, 4, 2, 16) == 16
    # Megatron: rank 0 of an interleaved pipeline holds pp (1 + (pp - 1) / (pp v)) micro-batches' worth
    assert in_flight(looped, 4, 0, 16) == pytest.approx(4 * (1 + 3 / 8))
    assert bubble_slots(one, 4) == 3 and bubble_slots(looped, 4) == 1.5
    assert bubble_slots(zero, 4) == pytest.approx(0.5) and bubble_slots(zbv, 4) == pytest.approx(0.5)
    assert "at least 4 micro-batches" in refusal(one, 4, 2, 10)
    assert refusal(gpipe, 4, 2, 10) is None
    assert "needs 8 stages" in refusal(looped, 4, 8, 6)


def _torch_peaks(row, pp: int, m: int) -> list[tuple[int, int]]:
    """Per pipeline rank, from torch's own action order (`pipeline_order`, built on the fake process group): its most
    stage-chunks whose forward ran and whose weight pass (or full backward) has not, and at the first point holding
    that many after an input-gradient pass, how many chunks' weight passes are pending."""
    import re

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    peaks = []
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            mine = [rank, 2 * pp - 1 - rank] if row.name == "zbv" else [rank, rank + pp]
            stages = [PipelineStage(nn.Identity(), i, 2 * pp, torch.device("cpu")) for i in mine]
            schedule = getattr(torch_schedules, row.torch_class)(stages, m, loss_fn=lambda out, target: out.sum())
            order = schedule.pipeline_order[rank]
        finally:
            dist.destroy_process_group()
        flight = pending = 0
        states = []
        for action in filter(None, order):
            kind = re.fullmatch(r"\d+([A-Z]+)\d+", str(action)).group(1)
            flight += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
            pending += {"I": 1, "W": -1}.get(kind, 0)
            states.append((flight, pending if kind == "I" else -1))
        most = max(f for f, _ in states)
        peaks.append((most, max(p for f, p in states if f == most)))
    return peaks


@pytest.mark.parametrize("name", ["zero_bubble", "zbv"])
def test_zero_bubble_counts_are_torchs(name):
    """What the pricing holds for torch's zero-bubble schedules is what their own action order holds."""
    row = SCHEDULES[name]
    for pp, m in ((2, 4), (2, 8), (4, 8), (4, 16)):
        priced = [(round(in_flight(row, pp, r, m) * stages_per_rank(row)), deferred(row, pp, r, m)) for r in range(pp)]
        assert priced == _torch_peaks(row, pp, m), (pp, m)


def test_zbv_beyond_two_ranks_warns_what_its_memory_leaves_out(run_cli):
    args = ["estimate", "--model", "llama-tiny[n_layers=8]", "--tp", "1", "--schedule", "zbv", "--batch-size", "1",
            "--global-batch", "16", "--seq-len", "64", "--profile", "h100-sxm-80gb", "--mem", "80GB"]
    four = run_cli(*args, "--gpus", "4", "--pp", "4")
    assert four.returncode == 0 and "warning: ZB-V on pipeline degree 4" in four.stderr, four.stderr
    assert "--schedule zero_bubble" in four.stderr
    two = run_cli(*args, "--gpus", "2", "--pp", "2")  # pp 2: measured within the fidelity target (RESULTS 20)
    assert two.returncode == 0 and "ZB-V" not in two.stderr, two.stderr
