"""Plans fitted to what CUDA's caching allocator needs (issue 23), through the command line: the figure a plan is
fitted to, the allocator configuration it records, and a limit that only the allocator's margin makes too tight."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.run.launch import run_allocator_conf
from autoplan.api.prepare import prepare
from autoplan.settings import EstimateSettings
from cost_models.allocator_conf import ALLOC_CONF_ENV, ALLOC_CONF_ENVS, is_expandable
from cost_models.allocator_margin import needed_of_parts, point_margin
from cost_models.stranding import forward_stranding

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--profile", "h100-sxm-80gb"]


def _cli(tmp_path: Path, *args: str, conf: str | None = None, var: str = ALLOC_CONF_ENV) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ALLOC_CONF_ENVS:
        env.pop(name, None)
    if conf is not None:
        env[var] = conf
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)


def _needed(plan: dict, conf: str, pick=max) -> int:
    """The needed bound of a plan file's timeline under `conf`, with its selectively checkpointed units' activations
    and what gpt2-tiny's tensor sizes strand under `conf` at the plan's micro-batch (cost_models.stranding); where
    the bound weights activations per checkpoint mode (natively), every activation weighted as `pick` of the modes'
    weights (the plan's own figure, from its units' modes, lies between the lightest and the heaviest)."""
    timeline = [{k.removesuffix("_bytes"): v for k, v in p["breakdown"].items()} for p in plan["predicted"]["timeline"]]
    selective = sum(u["predicted"]["activation_bytes"] for u in plan["units"] if u["checkpoint"] == "selective")
    settings = EstimateSettings(model="gpt2-tiny", seq_len=64, gpus=2, profile="h100-sxm-80gb")
    strands = forward_stranding(prepare(settings).tables.trace_1, plan["training"]["micro_batch_size"],
                                is_expandable(conf))
    margin = point_margin(conf, strands)
    if margin.by_mode:
        margin = replace(margin, weights=dict(margin.weights, activations=pick(margin.by_mode.values())), by_mode=None)
    return needed_of_parts(timeline, conf, selective, margin)


def test_a_cuda_plan_is_fitted_to_what_the_allocator_needs_with_expandable_segments(tmp_path):
    done = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "-o", "plan.json")
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    cluster, predicted = plan["cluster"], plan["predicted"]
    assert cluster["allocator_conf"] == "expandable_segments:True" and cluster["mem_fitted_to"] == "needed"
    assert predicted["needed_bytes"] == _needed(plan, "expandable_segments:True") <= 400e6 * 0.98  # per time point
    assert predicted["peak_mem_bytes"] < predicted["needed_bytes"]
    assert "needed (CUDA caching allocator, expandable_segments:True)" in done.stdout
    assert "the plan is fitted to this" in done.stdout and "reserved: up to" in done.stdout
    assert "not checked by replay" not in done.stdout  # the expandable bound holds the held-out models' replays


def test_the_environments_allocator_configuration_is_planned_for_and_recorded(tmp_path):
    native = "expandable_segments:False,max_split_size_mb:256"
    done = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "-o", "plan.json", conf=native)
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["cluster"]["allocator_conf"] == native
    # per time point, each unit's activations weighted by its checkpoint mode's
    # (to a few bytes: the solver's rows and this sum round the weighted bytes in another order)
    assert _needed(plan, native, min) - 8 <= plan["predicted"]["needed_bytes"] <= _needed(plan, native, max) + 8
    assert plan["predicted"]["needed_bytes"] <= 400e6 * 0.98
    unchecked = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "--fit-allocator", "off", "-o", "off.json",
                     conf=native)  # natively the bound is in-sample: a plan not replayed says so, and how to check it
    assert "not checked by replay: natively with max_split_size_mb:256 the bound held" in unchecked.stdout
    assert "--fit-allocator checks" in unchecked.stdout
    plain = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "--fit-allocator", "off", "-o", "plain.json",
                 conf="expandable_segments:False")
    assert "fitted on replays of the settled cache of five models' plans" in plain.stdout
    assert "may need more" in plain.stdout
    given = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "--allocator-conf", "expandable_segments:True",
                 "-o", "given.json", conf=native)  # the flag over the environment
    assert json.loads((tmp_path / "given.json").read_text())["cluster"]["allocator_conf"] == "expandable_segments:True"
    assert given.returncode == 0
    newer = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "-o", "newer.json", conf=native, var="PYTORCH_ALLOC_CONF")
    assert json.loads((tmp_path / "newer.json").read_text())["cluster"]["allocator_conf"] == native, newer.stderr
    bad = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "-o", "bad.json", conf="expandable_segments:maybe")
    assert bad.returncode == 2 and "expandable_segments takes True or False" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_fit_to_allocated_keeps_the_live_bytes_fit_and_says_the_step_may_not_run(tmp_path):
    done = _cli(tmp_path, "search", *TINY, "--mem", "40MB", "--fit-to", "allocated", "--batch-size", "64",
                "-o", "plan.json")
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["predicted"]["peak_mem_bytes"] <= 40e6 * 0.98 < plan["predicted"]["needed_bytes"]
    assert "mem_fitted_to" not in plan["cluster"]  # the fit of older plans: live bytes
    assert "fitted to the live bytes alone (--fit-to allocated): it may run out on the GPU" in done.stdout


def test_a_limit_only_the_allocators_margin_makes_too_tight_says_so(tmp_path):
    # gpt2-tiny's live bytes are well under 100 MB at micro-batch 1; the allocator's pages and workspaces are not
    done = _cli(tmp_path, "search", *TINY, "--mem", "100MB", "-o", "plan.json")
    assert done.returncode == 3
    assert "the live bytes alone would fit, so the allocator's margin is what does not" in done.stderr
    assert "--fit-to allocated plans to the live bytes alone" in done.stderr
    assert not (tmp_path / "plan.json").exists()
    # the limit it names is one the search finds a plan in: the bound it planned to, that bound's slack included
    least = re.search(r"a limit of at least ([\d.]+) MB", done.stderr)
    assert least and float(least[1]) > 100
    done = _cli(tmp_path, "search", *TINY, "--mem", f"{float(least[1]) * 1.01:.2f}MB", "-o", "plan.json")
    assert done.returncode == 0, done.stderr


def test_estimate_prints_allocated_needed_and_reserved_with_the_configuration(tmp_path):
    done = _cli(tmp_path, "estimate", *TINY, "--mem", "400MB", "--strategy", "shard")
    assert done.returncode == 0, done.stderr
    for text in ("total (allocated)", "needed", "expandable_segments:True", "reserved", "fits"):
        assert text in done.stdout, text
    tight = _cli(tmp_path, "estimate", *TINY, "--mem", "100MB", "--strategy", "shard")
    assert tight.returncode == 0 and "does not fit" in tight.stdout


def test_the_reserved_figure_stops_at_the_device_memory(tmp_path):
    """With memory to spare the cache keeps what a step freed (the reserved figure: at least the flat needed bound,
    here 224 MB for a 6 MB step with expandable segments' pages), but never more than the device has (210 MB, above
    the 205 MB the step needs)."""
    profile = json.loads((REPO / "autoplan" / "shipped_profiles" / "h100-sxm-80gb.json").read_text())
    profile.update(name="h100-small", mem_bytes=210_000_000)
    (tmp_path / "small.json").write_text(json.dumps(profile))
    shard = ["--strategy", "shard", "--batch-size", "8", "--mem", "210MB"]
    done = _cli(tmp_path, "estimate", *TINY[:-2], "--profile", "small.json", *shard)
    assert done.returncode == 0, done.stderr
    assert "reserved                210.00 MB  at most" in done.stdout and "the device's memory" in done.stdout
    roomy = _cli(tmp_path, "estimate", *TINY, *shard)  # the same step on an 80 GB device
    assert "reserved                224.53 MB  at most" in roomy.stdout and "the device's memory" not in roomy.stdout


@pytest.mark.parametrize("profile", ["cpu-gloo-2"])
def test_a_cpu_plan_has_no_allocator_figures(tmp_path, profile):
    done = _cli(tmp_path, "search", *TINY[:-2], "--profile", profile, "--mem", "40MB", "-o", "plan.json")
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "allocator_conf" not in plan["cluster"] and "needed_bytes" not in plan["predicted"]


def test_apply_runs_cuda_ranks_with_the_plans_allocator_conf_unless_the_environment_sets_one():
    """The ranks' PYTORCH_CUDA_ALLOC_CONF: the plan's where the environment has none; the environment's where it
    has one, with a warning when that changes what the plan was fitted to; nothing on the CPU."""
    planned = "expandable_segments:True"
    assert run_allocator_conf(planned, "cuda", {}) == (planned, None)
    assert run_allocator_conf(planned, "cpu", {}) == (None, None)
    assert run_allocator_conf(None, "cuda", {}) == (None, None)  # an older plan: torch's default
    same = "expandable_segments:True,max_split_size_mb:512"
    assert run_allocator_conf(planned, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": same}) == (same, None)
    conf, warning = run_allocator_conf(planned, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert conf == "expandable_segments:False"
    assert "may need more memory than planned" in warning and "--allocator-conf 'expandable_segments:False'" in warning
    conf, warning = run_allocator_conf(planned, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments"})
    assert conf == "expandable_segments" and "torch may refuse it" in warning
    split = "expandable_segments:False,max_split_size_mb:256"  # natively the replay reads max_split_size_mb too
    assert "may need more memory" in run_allocator_conf(split, "cuda", {ALLOC_CONF_ENV: "expandable_segments:False"})[1]
    assert run_allocator_conf(split, "cuda", {ALLOC_CONF_ENV: f"{split},garbage_collection_threshold:0.8"})[1] is None
    conf, warning = run_allocator_conf(planned, "cuda", {ALLOC_CONF_ENV: "max_split_size_mb:20"})
    assert "max_split_size_mb takes a whole number of MiB above 20" in warning
    newer = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}  # torch's other name for it (2.9 and later)
    conf, warning = run_allocator_conf(planned, "cuda", newer)
    assert conf == "expandable_segments:False" and "PYTORCH_ALLOC_CONF='expandable_segments:False'" in warning
    both = {**newer, ALLOC_CONF_ENV: planned}  # differing: which applies depends on torch's release
    assert "are both set and differ" in run_allocator_conf(planned, "cuda", both)[1]


@pytest.mark.parametrize("value", ["20", "1.5", "big"])
def test_a_max_split_size_torch_would_refuse_is_refused_before_any_plan_is_written(tmp_path, value):
    done = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "--allocator-conf",
                f"expandable_segments:False,max_split_size_mb:{value}", "-o", "plan.json")
    assert done.returncode == 2 and "max_split_size_mb takes a whole number of MiB above 20" in done.stderr
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:False"])
def test_diff_says_a_change_that_frees_memory_fits_by_the_bound_the_plan_was_made_to(tmp_path, conf):
    """A plan fitted to the allocator's per-point bound near its limit, against the same micro-batch with every unit
    checkpointed: each change frees memory, so each fits (compared with the flat bound's live bytes, none did)."""
    done = _cli(tmp_path, "search", *TINY, "--mem", "300MB", "--allocator-conf", conf, "-o", "a.json")
    assert done.returncode == 0, done.stderr
    micro_batch = json.loads((tmp_path / "a.json").read_text())["training"]["micro_batch_size"]
    done = _cli(tmp_path, "search", *TINY, "--mem", "300MB", "--allocator-conf", conf, "--strategy", "shard",
                "--checkpoint", "full", "--batch-size", str(micro_batch), "-o", "b.json")
    assert done.returncode == 0, done.stderr
    done = _cli(tmp_path, "diff", "a.json", "b.json", "--json")
    assert done.returncode == 0, done.stderr
    changes = json.loads(done.stdout)["changes"]
    assert changes and all(c["peak_change_bytes"] <= 0 and c["fits"] for c in changes)


def test_allocator_options_the_model_does_not_follow_are_named_in_the_report_and_the_estimate(tmp_path):
    """PYTORCH_CUDA_ALLOC_CONF options that change what a step needs, which neither the bound nor the replay reads,
    are named beside the needed figure; the options the model reads are not."""
    gc = "expandable_segments:True,garbage_collection_threshold:0.8"
    done = _cli(tmp_path, "search", *TINY, "--mem", "400MB", "--fit-allocator", "off", "-o", "plan.json", conf=gc)
    assert done.returncode == 0, done.stderr
    assert "not modelled: garbage_collection_threshold:0.8 (frees cached blocks early" in done.stdout
    estimate = _cli(tmp_path, "estimate", *TINY, "--mem", "400MB", "--strategy", "shard",
                    conf="backend:cudaMallocAsync,roundup_power2_divisions:[256:4,>:1]")
    assert estimate.returncode == 0, estimate.stderr
    assert "not modelled: backend:cudaMallocAsync (a backend other than torch's caching allocator" in estimate.stdout
    assert "roundup_power2_divisions:[256:4,>:1] (rounds requests up" in estimate.stdout
    assert "default for them" in estimate.stdout
    plain = _cli(tmp_path, "estimate", *TINY, "--mem", "400MB", "--strategy", "shard",
                 conf="expandable_segments:False,max_split_size_mb:256,backend:native")
    assert plain.returncode == 0 and "not modelled" not in plain.stdout
