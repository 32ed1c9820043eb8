"""search through the Python API: plans are optimal for the cost model, monotone, deterministic."""

import json
import math

import pytest

from autoplan.api.search import search
from autoplan.errors import InfeasibleError, UsageError
from autoplan.models.zoo import build_model

# live bytes alone (`fit_to` allocated): these tiny limits are below what a GPU's caching allocator needs to run any step
TINY = dict(model="gpt2-tiny", gpus=2, seq_len=64, profile="a100-sxm4-80gb", fit_to="allocated")


def test_looser_limit_never_gives_a_slower_plan():
    times = []
    for limit_mb in (40, 60, 90, 150, 400):
        try:
            times.append(search(mem=f"{limit_mb}MB", batch_size=8, **TINY).predicted.step_time_s)
        except InfeasibleError:
            times.append(float("inf"))
    assert any(t < float("inf") for t in times)
    assert all(later <= earlier + 1e-12 for earlier, later in zip(times, times[1:])), times


def test_plan_fits_its_limit_and_beats_or_matches_every_fitting_baseline():
    plan = search(mem="60MB", batch_size=8, **TINY)
    assert plan.predicted.peak_mem_bytes <= plan.cluster.mem_limit_bytes
    for baseline in plan.baselines:
        if baseline.fits:
            assert plan.predicted.throughput_samples_s >= baseline.throughput_samples_s * (1 - 1e-9)


def test_all_replicate_is_picked_where_it_fits_and_is_fastest():
    plan = search(mem="80GB", **TINY)
    replicate = next(b for b in plan.baselines if b.name == "all-replicate")
    assert replicate.fits
    assert {u.sharding for u in plan.units} == {"replicate"}
    assert all(u.checkpoint == "none" for u in plan.units)
    assert plan.predicted.throughput_samples_s == pytest.approx(replicate.throughput_samples_s)


def test_limit_below_the_smallest_plan_reports_the_needed_amount():
    with pytest.raises(InfeasibleError) as info:
        search(mem="100KB", **TINY)
    needed = info.value.min_mem_bytes
    assert needed and needed > 10**5
    assert "what would help" in str(info.value).lower() and "more GPUs" in str(info.value)
    plan = search(mem=needed, batch_size=1, **TINY)  # exactly that much fits
    assert plan.predicted.peak_mem_bytes <= needed


def test_headroom_keeps_a_fraction_of_the_limit_free():
    exact = search(mem="1TB", strategy="replicate", batch_size=1, headroom=0.0, allow_over_device_mem=True,
                   **TINY).predicted.peak_mem_bytes
    # a limit exactly at the all-replicate peak: it fits with no headroom, not with the default 2%
    assert search(mem=exact, strategy="replicate", batch_size=1, headroom=0.0, **TINY).cluster.mem_headroom == 0.0
    with pytest.raises(InfeasibleError) as info:
        search(mem=exact, strategy="replicate", batch_size=1, **TINY)
    assert "2% headroom" in str(info.value)
    plan = search(mem=exact, batch_size=1, **TINY)  # the solver finds something leaner instead
    assert plan.predicted.peak_mem_bytes <= exact * 0.98 and plan.cluster.mem_headroom == 0.02
    # the needed amount an infeasible search reports leaves the headroom free
    with pytest.raises(InfeasibleError) as info:
        search(mem="100KB", batch_size=1, headroom=0.1, **TINY)
    lean = search(mem=info.value.min_mem_bytes, batch_size=1, headroom=0.1, **TINY)
    assert lean.predicted.peak_mem_bytes <= info.value.min_mem_bytes * 0.9


@pytest.mark.parametrize("headroom", [-0.1, 0.5, 2.0])
def test_headroom_out_of_range_is_a_usage_error(headroom):
    with pytest.raises(UsageError, match="`headroom`"):
        search(mem="60MB", headroom=headroom, **TINY)


def test_identical_inputs_give_identical_plans():
    first = search(mem="60MB", **TINY).model_dump(mode="json")
    second = search(mem="60MB", **TINY).model_dump(mode="json")
    for plan in (first, second):
        assert plan.pop("timing")["solver_s"] > 0  # wall-clock times, kept apart from the rest
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_global_batch_uses_gradient_accumulation():
    plan = search(mem="60MB", global_batch=64, **TINY)
    t = plan.training
    assert t.micro_batch_size * t.grad_accum_steps * plan.cluster.world_size == 64
    with pytest.raises(UsageError, match="divisible"):
        search(mem="60MB", global_batch=63, **TINY)


def test_multi_node_offers_hybrid_sharding():
    plan = search(model="gpt2-tiny", mem="80GB", nodes=2, gpus_per_node=4, seq_len=64,
                  profile="a100-sxm4-80gb", batch_size=4)
    assert plan.cluster.world_size == 8
    # across nodes, all-reduce over the slow link makes sharding within a node worth it for big units
    assert {u.sharding for u in plan.units} <= {"shard", "shard_keep", "replicate", "hybrid"}


@pytest.mark.parametrize("model", ["llama-tiny", "bert-tiny"])
def test_other_families_plan(model):
    plan = search(model=model, mem="200MB", gpus=2, seq_len=64, granularity="fine", fit_to="allocated")
    paths = [u.module for u in plan.units]
    assert paths[0] == "" and len(paths) > 3


def test_bad_inputs_are_usage_errors():
    with pytest.raises(UsageError, match="gpt2-xl.*package.module:factory"):
        search(model="no-such-model", mem="8GB")
    with pytest.raises(UsageError, match="a100-sxm4-80gb"):
        search(model="gpt2-tiny", mem="8GB", profile="no-such-gpu")
    with pytest.raises(UsageError, match="no_such_factory"):
        search(model="autoplan.models:no_such_factory", mem="8GB")
    with pytest.raises(UsageError, match="`seq_len`"):  # a model object outside the zoo: no default length
        search(model=build_model("gpt2-tiny"), mem="8GB")


def _without_wall_times(value):
    if isinstance(value, dict):
        return {k: _without_wall_times(v) for k, v in value.items() if k not in ("wall_time_s", "timing")}
    if isinstance(value, list):
        return [_without_wall_times(v) for v in value]
    return value


def test_meshes_searched_in_worker_processes_give_the_same_plan(monkeypatch):
    """The meshes after the first go to forked workers for a large model; the plan (every mesh's best
    included) is the one the search makes mesh by mesh. Here a small model is made to take that path."""
    import autoplan.solve.mesh_search as mesh_search

    settings = dict(model="llama-tiny", mem="30MB", gpus=2, seq_len=64, profile="cpu-gloo-2")
    one_by_one = search(**settings)
    monkeypatch.setattr(mesh_search, "PARALLEL_MIN_UNITS", 0)
    monkeypatch.setattr(mesh_search.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # two workers even on 1 core
    forked = search(**settings)
    assert len(forked.solver.tp_degrees) == 3  # FSDP alone, TP 2 with and without sequence parallelism
    assert _without_wall_times(forked.to_dict()) == _without_wall_times(one_by_one.to_dict())


def test_the_pipelined_meshes_go_to_the_workers_forked_for_the_first_meshes(monkeypatch):
    """A search with pipelines forks its workers once: the pipelined meshes (searched after the others, where a
    pipeline can pay) go to the same processes, and the plan, every mesh's entry included, is the one made mesh by
    mesh."""
    import multiprocessing

    import autoplan.solve.mesh_search as mesh_search
    import autoplan.solve.mesh_workers as mesh_workers

    settings = dict(model="llama-tiny", mem="80GB", nodes=2, gpus_per_node=2, seq_len=128, global_batch=16,
                    profile="h100-sxm-80gb", fit_to="allocated")
    one_by_one = search(**settings)
    assert {entry.pp_degree for entry in one_by_one.solver.tp_degrees} == {1, 2}  # both rounds searched
    pools = []
    context = multiprocessing.get_context("fork")
    monkeypatch.setattr(mesh_search, "PARALLEL_MIN_UNITS", 0)
    monkeypatch.setattr(mesh_search.os, "sched_getaffinity", lambda pid: {0, 1})  # one worker even on 1 core
    monkeypatch.setattr(mesh_workers.multiprocessing, "get_context",
                        lambda method: pools.append(method) or context)
    forked = search(**settings)
    assert pools == ["fork"]
    assert _without_wall_times(forked.to_dict()) == _without_wall_times(one_by_one.to_dict())


def test_a_refusal_in_a_worker_process_is_reported_as_one_mesh_by_mesh(monkeypatch):
    """Pins that do not run beside tensor parallelism refuse those meshes, whichever process searched them."""
    import autoplan.solve.mesh_search as mesh_search

    settings = dict(model="llama-tiny", mem="1GB", gpus=2, seq_len=64, profile="h100-sxm-80gb",
                    pin=["layers.0=replicate"])
    one_by_one = search(**settings)
    monkeypatch.setattr(mesh_search, "PARALLEL_MIN_UNITS", 0)
    forked = search(**settings)
    notes = [entry.note for entry in forked.solver.tp_degrees if entry.degree > 1]
    assert notes and all(note.startswith("not with the pins") for note in notes)
    assert _without_wall_times(forked.to_dict()) == _without_wall_times(one_by_one.to_dict())


def test_a_search_longer_than_its_progress_delay_says_how_it_goes(monkeypatch, capsys):
    """Past PROGRESS_DELAY_S a line on stderr per micro-batch (the mesh and its shape, what it gave, the best so
    far) and per mesh; a search of one mesh shows its micro-batches too."""
    import autoplan.solve.mesh_search as mesh_search

    monkeypatch.setattr(mesh_search, "PROGRESS_DELAY_S", 0.0)
    search(model="llama-tiny", mem="30MB", gpus=2, seq_len=64, profile="cpu-gloo-2", tp=1, global_batch=16)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autoplan: mesh")]  # not tracing's
    assert lines and all(line.startswith("autoplan: mesh 1 of 1 (2 data-parallel), micro-batch ") for line in lines)
    assert {line.split("micro-batch ")[1].split(" x")[0] for line in lines} >= {"1", "2"}
    assert all("best so far" in line for line in lines[1:]) and "samples/s" in lines[0]
    search(model="llama-tiny", mem="30MB", gpus=2, seq_len=64, profile="cpu-gloo-2")
    err = capsys.readouterr().err
    assert "(1 data-parallel x 2 tensor-parallel +sp), micro-batch" in err and "mesh 3 of 3 (tp 2)" in err


def test_a_uniform_strategy_that_does_not_fit_says_its_own_peak_and_the_limit_it_needs():
    """A uniform strategy rules the solver's leaner plans out, so the error gives that plan's peak and need (it gave
    the smallest any plan reaches: 4.7 MB here, under the very limit that failed) and a limit at which it fits."""
    with pytest.raises(InfeasibleError) as info:
        search(mem="6MB", strategy="replicate", batch_size=8, **TINY)
    text = str(info.value)
    assert "the uniform plan for gpt2-tiny (every unit replicate, checkpointing none, micro-batch 8)" in text
    assert "leave out `strategy`" in text
    assert info.value.min_mem_bytes > 6 * 10**6
    plan = search(mem=info.value.min_mem_bytes, strategy="replicate", batch_size=8, **TINY)
    assert {u.sharding for u in plan.units} == {"replicate"}


def test_a_uniform_strategy_that_only_the_allocator_margin_rules_out_says_so():
    cuda = dict(TINY, profile="h100-sxm-80gb", fit_to="needed", allocator_conf="expandable_segments:False")
    free = search(mem="1TB", strategy="replicate", batch_size=8, allow_over_device_mem=True, **cuda).predicted
    between = (free.peak_mem_bytes + free.needed_bytes) // 2
    with pytest.raises(InfeasibleError) as info:
        search(mem=math.ceil(between / 0.98), strategy="replicate", batch_size=8, **cuda)
    assert "the live bytes alone would fit, so the allocator's margin is what does not" in str(info.value)
    plan = search(mem=info.value.min_mem_bytes, strategy="replicate", batch_size=8, **cuda)
    assert plan.predicted.needed_bytes <= info.value.min_mem_bytes * 0.98
