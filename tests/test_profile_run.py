"""`autoplan profile` end to end on this machine (CPU, gloo, 2 ranks) with a tiny sweep, the cache,
the op re-execution, and that what it measures is what `autoplan search` looks up."""

import argparse
import re
import time

import pytest
import torch

from autoplan.cli import profile as cli_profile
from autoplan.models.resolve import resolve_model
from autoplan.profile_store import load_profile, save_profile
from autoplan.profiling import measure_profile
from autoplan.profiling.cache import MeasurementCache
from autoplan.profiling.ops import OpCase, collect_cases, has_work, materialize, measure_case, zoo_workload
from autoplan.profiling.timing import Repeats
from autoplan.solve.tables import CostTables
from cost_models.records import extrapolate_ops

FEW = Repeats(warmup=1, min_repeats=2, max_repeats=3, min_time_s=0.0)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_profile.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["profile", *argv])


def measures_a_profile(test):
    """A test of the `quick` profile: it spawns 2 gloo ranks (distributed) and measures for a while (slow)."""
    return pytest.mark.distributed(pytest.mark.slow(test))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `--quick` profile measured into a fresh cache (a few seconds: one tiny model, 2 ranks)."""
    cache_dir = tmp_path_factory.mktemp("cache")
    settings = cli_profile.settings_from_args(_parse("--quick", "--cache-dir", str(cache_dir), "--no-progress"))
    return cache_dir, measure_profile(settings)


@measures_a_profile
def test_quick_profile_measures_ops_collectives_overlap_optimizer(quick):
    _, result = quick
    profile = result.profile
    assert profile.source == "measured" and profile.name == "cpu-gloo-2"
    assert result.ops_cached == 0
    # every op with work is timed; only a getitem whose backward the tracer charges to the split
    # it reads (its own output has no grad_fn to re-run) stays without an OpTiming: one per traced
    # shape (gpt2-tiny at micro-batch 1, the calibration model at 2 and 8)
    assert result.ops_measured - 3 <= len(profile.op_times) <= result.ops_measured
    assert {f.collective for f in profile.collectives} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert profile.overlap.compute_slowdown >= 1.0 and profile.overlap.comm_slowdown >= 1.0
    assert profile.optimizer_bytes_s > 1e8  # AdamW streams at least 100 MB/s of state on any CPU
    assert profile.peak_flops["fp32"] > 1e9
    assert profile.links["intra_node"].bus_bandwidth_bytes_s > 0
    assert any(f.family == "Linear" and f.dtype == "fp32" for f in profile.op_fits)


@measures_a_profile
def test_quick_profile_calibrates_on_whole_training_steps(quick):
    """The calibration model was trained on the ranks under each plan, depth and micro-batch, its ops
    were timed too (so the fit compares like with like), and the fit is recorded beside its inputs."""
    _, result = quick
    fsdp = result.profile.fsdp
    cases = fsdp.calibration["cases"]
    plans = {("shard", False), ("shard_keep", False), ("replicate", False), ("shard", True), ("replicate", True)}
    assert {(c["strategy"], c["checkpoint"], c["depth"], c["micro_batch"]) for c in cases} == {
        (s, ckpt, d, mb) for s, ckpt in plans for d in (2, 4) for mb in (2, 8)}
    for case in cases:
        assert case["units"] == case["depth"] + 1  # one per block and the root
        # all-gather per unit (none replicated); backward: reduce-scatter, all-gather again unless kept
        # (the root is not offered shard_keep), all-reduce when replicated
        expected_calls = {"shard": (case["units"], 2 * case["units"]),
                          "shard_keep": (case["units"], case["units"] + 1),
                          "replicate": (0, case["units"])}[case["strategy"]]
        assert (case["calls_fwd"], case["calls_bwd"]) == expected_calls
        assert case["ops_fwd_s"] > 0 and case["ops_bwd_s"] > case["ops_fwd_s"]
        # checkpointed: every block's forward ops again in the backward (the root is not checkpointed)
        assert (0 < case["ops_recompute_s"] < case["ops_fwd_s"]) if case["checkpoint"] else case["ops_recompute_s"] == 0
        assert all(case["measured"][phase] > 0 for phase in ("fwd", "bwd", "step"))
        # a real step is never faster than its ops and collectives timed one by one would allow by much
        assert case["measured"]["bwd"] > 0.5 * case["ops_bwd_s"]
    assert fsdp.compute_fwd_scale > 0 and fsdp.compute_bwd_scale > 0 and fsdp.compute_recompute_scale > 0
    assert min(fsdp.unit_fwd_s, fsdp.unit_bwd_s, fsdp.collective_fwd_s, fsdp.collective_bwd_s) >= 0
    assert fsdp.calibration["compute_fwd_scale"] == fsdp.compute_fwd_scale


@measures_a_profile
def test_measured_keys_are_the_keys_search_looks_up(quick):
    """Every op of gpt2-tiny with work, as the search traces it at micro-batch 1, has a measured time,
    but for ops whose backward the tracer charges to a different node (getitem of split's outputs)."""
    _, result = quick
    measured = {t.key for t in result.profile.op_times}
    model = resolve_model("gpt2-tiny")
    traced = CostTables(model.module, model.config["max_seq_len"], "fp32", "block")
    ops = [op for op in extrapolate_ops(traced.trace_1.ops, traced.trace_2.ops, 1)
           if has_work(op, "fwd") or has_work(op, "bwd")]
    missing = {op.key for op in ops if op.key not in measured}
    assert all(key.startswith("getitem[") for key in missing), missing
    assert len(missing) <= 1


@measures_a_profile
def test_rerun_from_cache_measures_nothing_and_is_fast(quick, run_cli, tmp_path):
    cache_dir, result = quick
    out = tmp_path / "p.json"
    start = time.perf_counter()
    done = run_cli("profile", "--quick", "--cache-dir", str(cache_dir), "--no-progress", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "(0 ops measured" in done.stdout
    assert time.perf_counter() - start < 30  # seconds: imports and tracing, no ranks spawned
    again = load_profile(str(out))
    assert again.op_times == result.profile.op_times and again.collectives == result.profile.collectives


def test_cache_keeps_entries_per_scope(tmp_path):
    scope = {"device": "Some CPU", "torch": "2.13.0", "threads": 1}
    cache = MeasurementCache(tmp_path, scope)
    cache.put("op:x", {"fwd_s": 1.0, "bwd_s": None})
    assert MeasurementCache(tmp_path, dict(scope)).get("op:x") == {"fwd_s": 1.0, "bwd_s": None}
    other = MeasurementCache(tmp_path, {**scope, "torch": "2.14.0"})
    assert other.get("op:x") is None
    other.put("op:x", {"fwd_s": 2.0, "bwd_s": None})  # lives beside the first, does not replace it
    assert MeasurementCache(tmp_path, dict(scope)).get("op:x") == {"fwd_s": 1.0, "bwd_s": None}
    cache.path.write_text("{not json")
    assert MeasurementCache(tmp_path, dict(scope)).get("op:x") is None
    assert MeasurementCache(None, scope).get("op:x") is None


def _case(cases: list[OpCase], prefix: str) -> OpCase:
    return next(case for case in cases if case.key.startswith(prefix))


def test_op_replay_keeps_strides_index_ranges_and_grad_flags():
    cases = collect_cases(zoo_workload("gpt2-tiny", (1,)), "fp32")
    flatten = _case(cases, "flatten[")  # reads the transposed attention output: a copy, not a view
    forward, _ = materialize(flatten, torch.device("cpu"))
    assert not flatten.args[0].is_contiguous()
    assert forward().data_ptr() != flatten.args[0].data_ptr()

    embedding = _case(cases, "Embedding[1x128]")
    forward, leaves = materialize(embedding, torch.device("cpu"))
    assert forward().shape == (1, 128, 64)  # indices drawn below num_embeddings, or it would raise
    assert [tuple(p.shape) for p in leaves] == [(512, 64)]  # the weight; int indices take no grad

    loss = _case(cases, "cross_entropy[1x128x512]")
    timing = measure_case(loss, torch.device("cpu"), FEW)
    assert timing.fwd_s > 0 and timing.bwd_s > 0


@pytest.mark.parametrize("argv, message", [
    (("--nproc", "1"), "at least 2"),
    (("--model", "no-such-model"), "unknown model"),
    (("--micro-batch", "2"), "--micro-batch applies to --model"),
    (("--no-cache", "--cache-dir", "x"), "contradict"),
    (("--nproc", "0"), "must be at least 1"),
    (("--dtype", "int8"), "invalid choice"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    from autoplan.cli.main import main

    try:
        code = main(["profile", "--no-progress", *argv])
    except SystemExit as exc:  # argparse rejects bad values itself
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_usage_error(run_cli):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    done = run_cli("profile", "--device", "cuda")
    assert done.returncode == 2 and "CUDA" in done.stderr, done.stderr


def test_profiles_lists_shipped_and_local_with_provenance(run_cli, tmp_path, monkeypatch):
    local = tmp_path / "local-profiles"
    local.mkdir()
    save_profile(load_profile("cpu-gloo-2").model_copy(update={"name": "mine"}), local / "mine.json")
    (local / "broken.json").write_text("{}")
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(local))
    done = run_cli("profiles")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert re.search(r"shipped\s+datasheet\s+cuda", rows["a100-sxm4-80gb"])
    assert re.search(r"shipped\s+measured\s+cpu", rows["cpu-gloo-2"])
    assert re.search(r"local\s+measured\s+cpu", rows["mine"])
    assert "unreadable" in rows["broken"]
    assert str(local) in done.stdout


def test_help_has_examples(run_cli):
    done = run_cli("profile", "--help")
    assert done.returncode == 0 and "examples:" in done.stdout and "--nproc" in done.stdout
