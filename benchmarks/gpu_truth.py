"""The GPU kit: on one GPU, in one call of at most 8 minutes, everything a GPU can tell about autoplan's
predictions, written to one results file (gpu_truth.json, and gpu_truth.txt to read) after every stage.

A GPU is only lent now and then, so the first run on one must not be the kit's first run: the same
command runs here with `--device cpu` (a small grid; tests/test_gpu_truth.py runs it), and it copes with
a GPU machine that has torch but neither ortools nor pydantic and no package index (wheels carried in
benchmarks/wheels/, git-ignored, installed with `pip install --no-index`).

The budget (`--budget-min`, default 8) is shared out: each stage, when it starts, gets its weight's share of
what is left (profile 45, grid 35, compute 12, checkpoint 8: the profile 3.6 of 8 minutes, and what it leaves to
the next),
enforced by the timeouts of the commands it starts and by not starting a run its share cannot hold; work it
cannot finish is recorded as skipped ("skipped: out of time", or the stage "out of time"), its allowance and
wall time beside. Its files fit the device tool's return (at most 8): gpu_truth.json (with the grid's plans in
plans.json), gpu_truth.txt, the measured profile; the measurement cache goes to --cache-dir (/tmp).

Stages (`--stages`, default all four):
  profile  `autoplan profile --device cuda --nproc 1`: ops, host link, calibration steps, saved as a measured
           profile named after the device (profiles/<device>-measured.json on a GPU; a copy in --out). One
           process measures no collectives: links and collective fits come from the device's datasheet profile.
  grid     the fake-world memory grid: zoo models (Llama-3-8B and Llama-2-7B shapes, smaller ones) at 2-3
           micro-batches, plans all-shard, all-shard+checkpoint and the solver's at a tight limit, each run as
           rank 0 of an 8-GPU world on torch's fake process group (autoplan.run.fake_world, which `autoplan apply
           --fake-world` runs): predicted peak against the measured live-tensor peak and CUDA's
           max_memory_allocated and max_memory_reserved; compute time (collectives free) against the predicted.
           On a GPU each plan runs under both caching allocator configurations (expandable segments on, off),
           the process capped at the plan's `needed` bound under each (cost_models.allocator_margin): whether the
           step ran there, with max_memory_reserved and max_memory_allocated beside the bound.
  compute  single-GPU training runs (`autoplan apply` on one GPU): measured step time and peak against the plan's.
  checkpoint  one block of llama2-7b (on the CPU llama-tiny's), forward + backward under each checkpoint mode,
           four blocks timed against one (benchmarks/checkpoint_cost.py), beside the step model's figure for it.

On a machine with a GPU and a package index, or with the wheels installed:
    python benchmarks/gpu_truth.py --device cuda --out benchmarks/results/gpu_truth_cuda
    make gpu-truth
On this project's `run` tool (one H100 or H200, no package index), one call:
    python benchmarks/gpu_truth.py --fetch-wheels        # here, once: wheels into benchmarks/wheels/
    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_truth.py --device cuda --budget-min 8 --out $OUT",
        carry=["benchmarks/wheels"], timeout_s=600)
    # here: copy <files_at>/*-measured.json to profiles/ and <files_at>/gpu_truth.json, plans.json to
    # benchmarks/results/gpu_truth_cuda/; a stage the budget cut short resumes with --resume and --stages
On this machine: python benchmarks/gpu_truth.py --device cpu --quick --out /tmp/gpu-truth-cpu
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_truth_report, beside this file
WHEELS = REPO / "benchmarks" / "wheels"
SITE = Path("/tmp/autoplan-gpu-truth-site")
# what the kit needs beyond the GPU image's packages (torch, numpy, networkx, tqdm, absl-py, pandas, pyyaml are
# there), at the versions this environment runs (--fetch-wheels pins them), for CPython 3.12 on x86-64 Linux
WHEEL_PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "ortools",
                  "immutabledict", "protobuf")
WHEEL_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                   "manylinux1_x86_64"]
STAGES = ("profile", "grid", "compute", "checkpoint")
# each stage's share of what is left when it starts; checkpoint, last, gets all that is left
STAGE_WEIGHTS = {"profile": 45, "grid": 35, "compute": 12, "checkpoint": 8}
CACHE = Path("/tmp/autoplan-gpu-truth-cache")
WORLD = 8  # the grid's plans are for 8 GPUs; one of them runs here
TIGHT = 1.15  # the solver's limit: 15% above the leanest plan's (all-shard+checkpoint) predicted peak
FIT_FRACTION = 0.92  # a plan predicted above this share of the GPU's memory is not run (it could not be measured)
# (model, sequence, micro-batches[, plan kinds]), most telling first: the budget may end the grid early. The kinds
# (default KINDS): all-shard+ckpt, all-shard, autoplan (the solver's at TIGHT x the first's peak), and all-shard@tpN
# (all-shard with tensor degree N and sequence parallelism). The tensor-parallel row is first: on one H200 the
# default search's llama3-8b plans at 8192 tokens with tensor degree 2 and 4 held fp32 logits shards beyond their
# prediction, which the kit's blocks alive at the peak named (loss_parallel's; priced since, RESULTS.md section 9,
# third run): a row still missing records them.
KINDS = ("all-shard+ckpt", "all-shard", "autoplan")
GRID = {
    "cuda": [("llama3-8b", 8192, (1,), ("all-shard@tp4", "all-shard@tp2")), ("llama3-8b", 2048, (1, 2)),
             ("llama2-7b", 1024, (1, 2, 4)), ("llama-1b", 2048, (2, 8)), ("gpt2", 1024, (8, 32))],
    "cuda-quick": [("llama-1b", 1024, (2, 4)), ("gpt2", 512, (4, 8))],
    "cpu": [("gpt2-tiny", 64, (2, 8)), ("llama-tiny", 64, (2, 8)), ("llama-tiny", 64, (2,), ("all-shard@tp2",))],
    "cpu-quick": [("gpt2-tiny", 64, (2, 8)), ("llama-tiny", 64, (2,), ("all-shard@tp2",))],
}
# a block's forward + backward under each checkpoint mode (benchmarks/checkpoint_cost.py): (model, sequence,
# micro-batch, blocks timed against one, repetitions)
CHECKPOINT = {"cuda": ("llama2-7b", 1024, 2, 4, 10), "cpu": ("llama-tiny", 16, 1, 4, 10)}
COMPUTE = {  # single-GPU runs: (model, sequence, micro-batch)
    "cuda": [("gpt2", 1024, 16), ("llama-1b", 2048, 4)], "cuda-quick": [("gpt2", 1024, 8)],
    "cpu": [("gpt2-tiny", 64, 8)], "cpu-quick": [("gpt2-tiny", 64, 8)],
}


def wheel_pins() -> list[str]:
    """NAME==VERSION of each package the kit carries, at this environment's version."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in WHEEL_PACKAGES]


def fetch_wheels() -> int:
    """Download the wheels a GPU machine without a package index needs (here, where pip reaches an index)."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *platforms, "-d", str(WHEELS), *wheel_pins()]
    print(" ".join(command), flush=True)
    done = subprocess.run(command)
    if done.returncode == 0:
        size = sum(p.stat().st_size for p in WHEELS.glob("*.whl")) >> 20
        print(f"{len(list(WHEELS.glob('*.whl')))} wheels, {size} MiB, in {WHEELS}: carry benchmarks/wheels")
    return done.returncode


def ensure_packages() -> str:
    """Make autoplan importable here and in the commands the kit starts: the repository on the path, and
    pydantic and ortools installed from the carried wheels where the machine lacks them. What was done."""
    paths = [str(REPO)]
    missing = [name for name in ("pydantic", "ortools") if importlib.util.find_spec(name) is None]
    note = "pydantic and ortools already installed"
    if missing:
        wheels = sorted(WHEELS.glob("*.whl"))
        if not wheels:
            sys.exit(f"gpu_truth: {', '.join(missing)} missing and no wheels in {WHEELS}: run `python "
                     "benchmarks/gpu_truth.py --fetch-wheels` where pip reaches a package index, and carry that folder")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--find-links", str(WHEELS), "--target", str(SITE), "--upgrade", *map(str, wheels)], check=True)
        paths.insert(0, str(SITE))
        note = f"installed from {len(wheels)} carried wheels: {', '.join(missing)} were missing"
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and p not in paths])
    importlib.invalidate_caches()
    return note


class Budget:
    """The kit's time limit and the current stage's share of it: what is left, and whether another item starts."""

    def __init__(self, minutes: float):
        self.end = time.monotonic() + minutes * 60
        self.stage_end = self.end

    def start_stage(self, stage: str, stages: list[str]) -> float:
        """Give `stage` its weight's share of what is left against the stages still to run; its allowance, s."""
        weights = [STAGE_WEIGHTS[s] for s in stages[stages.index(stage):]]
        left = max(0.0, self.end - time.monotonic())
        self.stage_end = time.monotonic() + left * weights[0] / sum(weights)
        return self.stage_end - time.monotonic()

    def left_s(self) -> float:
        return min(self.end, self.stage_end) - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left_s() > seconds


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=max(timeout, 1))


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def links_reference(device: str, device_name: str) -> str | None:
    """The profile whose links a one-process profile of this device takes; None: the device's datasheet one."""
    from autoplan.profile_store import load_profile, profile_entries

    if device == "cpu":
        return "cpu-gloo-2"
    for entry in profile_entries():
        profile = load_profile(str(entry.path))
        if profile.source == "datasheet" and profile.provenance.device_name == device_name:
            return None
    return "h100-sxm-80gb" if re.search(r"H100|H200|H800|H20", device_name) else "a100-sxm4-80gb"


def stage_profile(args, device_name: str, budget: Budget) -> dict:
    name = f"{device_slug(device_name)}-measured" + ("-quick" if args.quick else "")
    out = args.out / f"{name}.json"
    reference = links_reference(args.device, device_name)
    command = ["profile", "--device", args.device, "--nproc", "1", "--name", name, "-o", str(out), "--no-progress",
               "--cache-dir", str(args.cache_dir)]
    command += ["--quick"] if args.quick else []
    command += ["--links-from", reference] if reference else []
    started = time.monotonic()
    try:
        done = cli(*command, timeout=budget.left_s())
    except subprocess.TimeoutExpired:
        return {"status": "out of time", "command": "autoplan " + " ".join(command),
                "note": f"the measurements finished are in the cache ({args.cache_dir}): the same command resumes"}
    record = {"status": "ok" if done.returncode == 0 else "failed", "command": "autoplan " + " ".join(command),
              "wall_s": time.monotonic() - started, "stdout_tail": done.stdout[-4000:],
              "stderr_tail": done.stderr[-4000:]}
    if done.returncode == 0:
        profile = json.loads(out.read_text())
        if args.device == "cuda":  # shipped with the project: the profile is data like the others
            (REPO / "profiles" / out.name).write_text(out.read_text())
        calibration = profile["fsdp"].get("calibration") or {}
        record.update(name=name, path=str(out), links_from=reference or "the device's datasheet profile",
                      peak_flops=profile["peak_flops"], mem_bandwidth_bytes_s=profile["mem_bandwidth_bytes_s"],
                      optimizer_bytes_s=profile["optimizer_bytes_s"], host_link=profile["host_link"],
                      op_times=len(profile["op_times"]), op_fits=len(profile["op_fits"]),
                      calibration_fit_max_rel_err=calibration.get("fit_max_rel_err"),
                      fsdp={k: v for k, v in profile["fsdp"].items() if k != "calibration"})
    return record


def plan_profile(args, results: dict) -> str:
    """The profile the grid and the single-GPU runs plan with: the one measured (this run or --resume), else
    the device's shipped one."""
    measured = results.get("stages", {}).get("profile", {})
    if measured.get("status") == "ok" and Path(measured["path"]).is_file():
        return measured["path"]
    for candidate in ([REPO / "profiles" / Path(measured["path"]).name] if measured.get("path") else []):
        if candidate.is_file():
            return str(candidate)
    if args.device == "cpu":
        return "cpu-gloo-2"
    import torch

    return links_reference("cuda", torch.cuda.get_device_name(0)) or _shipped_of(torch.cuda.get_device_name(0))


def _shipped_of(device_name: str) -> str:
    """The shipped datasheet profile of this GPU (by its identity's name), else H100 SXM's."""
    from autoplan.profile_store import load_profile, profile_entries

    for entry in profile_entries():
        profile = load_profile(str(entry.path))
        if profile.source == "datasheet" and profile.identity and profile.identity.name == device_name:
            return entry.pick
    return "h100-sxm-80gb"


def _plan(model: str, seq_len: int, batch: int, kind: str, profile: str, lean: int | None = None):
    import autoplan

    common = {"gpus": WORLD, "profile": profile, "seq_len": seq_len, "batch_size": batch, "allow_over_device_mem": True}
    if kind.startswith("all-shard@tp"):  # tensor-parallel: degree N inside the node, sequence parallelism on
        tp = int(kind.removeprefix("all-shard@tp"))
        return autoplan.search(model, "10000GB", strategy="shard", tp=tp, sequence_parallel="on", **common)
    if kind == "all-shard":
        return autoplan.search(model, "10000GB", strategy="shard", **common)
    if kind == "all-shard+ckpt":
        return autoplan.search(model, "10000GB", strategy="shard", checkpoint=True, **common)
    return autoplan.search(model, int(lean * TIGHT), **common)


def _decisions(plan) -> list[str]:
    """The plan's distinct unit decisions, e.g. "shard+full", "replicate+none+offload"."""
    return sorted({f"{u.sharding}+{u.checkpoint}" + ("+offload" if getattr(u, "offload", False) else "")
                   for u in plan.units})


PLANS = "plans.json"


def _save_plan(folder: Path, key: str, plan) -> None:
    path = folder / PLANS
    plans = json.loads(path.read_text()) if path.is_file() else {}
    plans[key] = json.loads(plan.to_json())
    path.write_text(json.dumps(plans) + "\n")


def load_kit_plan(folder: Path, data: dict):
    """A plan the kit saved in `folder`'s plans.json (`data`), its profile read from `folder` where the path it was
    made with is not on this machine (the kit writes the measured profile beside its results)."""
    import tempfile

    from autoplan.plan.schema import load_plan

    profile = Path(data["cluster"]["profile"])
    if not profile.is_file() and (folder / profile.name).is_file():
        data = {**data, "cluster": {**data["cluster"], "profile": str(folder / profile.name)}}
    with tempfile.TemporaryDirectory() as scratch:  # the kit keeps its plans in one file; a plan loads from its own
        path = Path(scratch) / "plan.json"
        path.write_text(json.dumps(data))
        return load_plan(path)


# the grid runs each plan under both allocator configurations, capped at what the plan says it needs under each
ALLOCATOR_CONFS = ("expandable_segments:True", "expandable_segments:False")


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.0f} MB"


def set_allocator_conf(conf: str) -> None:
    """The caching allocator's configuration for the segments it makes from now on (torch's call for it where this
    torch has it, else the older one it replaced)."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(conf)


def _run_under(plan, device: str, conf: str | None, gpu_mem: int | None) -> dict:
    """One fake-world run of `plan`; on a GPU under the caching allocator configuration `conf` (set at run time,
    the cache emptied first) with the process capped at the plan's needed bound under it
    (cost_models.allocator_margin; `gpu_mem` None: not capped): whether the step ran, what torch reserved and
    allocated."""
    import gc

    import torch

    from autoplan.errors import AutoplanError
    from autoplan.run.fake_world import run_fake_world
    from autoplan.run.memtrack import allocation_failure
    from cost_models.allocator_conf import is_expandable
    from cost_models.allocator_margin import (
        SELECTIVE_RECOMPUTE,
        needed_bytes,
        needed_of_parts,
        reserved_bytes,
    )
    from cost_models.options import CHECKPOINT_MODES

    summary: dict = {}
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        set_allocator_conf(conf)  # new segments follow it; the cache is empty
        peak = plan.predicted.peak_mem_bytes
        # the plan's own per-point bound under `conf`, its selectively checkpointed units' saved activations in
        selective = sum(u.predicted.activation_bytes for u in plan.units
                        if CHECKPOINT_MODES[u.checkpoint].recompute in SELECTIVE_RECOMPUTE)
        bound = needed_of_parts([{k.removesuffix("_bytes"): v for k, v in p.breakdown.model_dump().items()}
                                 for p in plan.predicted.timeline], conf, selective) if plan.predicted.timeline else \
            needed_bytes(peak, conf)
        made_for = plan.cluster.allocator_conf
        if made_for is not None and plan.predicted.needed_bytes and is_expandable(made_for) == is_expandable(conf):
            bound = plan.predicted.needed_bytes  # the configuration it was made for: its model's own bound
        summary.update(needed_bound_bytes=bound, predicted_reserved_bytes=reserved_bytes(peak, conf))
        if gpu_mem is not None:  # None: uncapped
            torch.cuda.set_per_process_memory_fraction(min(1.0, bound / gpu_mem))
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()  # the retries below are this run's
    started = time.monotonic()
    result = None
    try:
        result = run_fake_world(plan, steps=3, warmup=1, device=device)
        summary.update(status="ran")
    except (AutoplanError, RuntimeError, MemoryError) as exc:
        refused = allocation_failure(exc)
        summary.update(status="out of memory" if refused else "failed", note=refused or repr(exc)[:500])
    finally:
        if device == "cuda":  # a run's own peaks span its phases; torch's after a failure, the failing phase's
            stats = torch.cuda.memory_stats()
            summary.update(reserved=result.cuda_max_reserved_bytes if result else torch.cuda.max_memory_reserved(),
                           allocated=result.cuda_max_allocated_bytes if result else torch.cuda.max_memory_allocated(),
                           # cached blocks freed to make room (a bound that is tight) and refusals
                           alloc_retries=stats.get("num_alloc_retries"), ooms=stats.get("num_ooms"))
            torch.cuda.set_per_process_memory_fraction(1.0)
    return {"result": result, "summary": summary, "wall_s": time.monotonic() - started}


PEAK_MISS = 0.015  # a grid run whose live peak misses the prediction by more has its peak's blocks recorded


def _peak_blocks(plan) -> dict:
    """The plan run again, uncapped, with CUDA's allocator history recorded: the blocks alive at its peak, by
    where they were allocated (autoplan.run.peak_blocks)."""
    import gc

    import torch

    from autoplan.run.fake_world import run_fake_world
    from autoplan.run.peak_blocks import recorded_peak

    gc.collect()
    torch.cuda.empty_cache()
    try:
        return recorded_peak(lambda: run_fake_world(plan, steps=1, warmup=1, device="cuda"))
    except Exception as exc:  # noqa: BLE001 - a diagnosis that fails is recorded, the grid goes on
        return {"error": repr(exc)[:500]}


def stage_grid(args, profile: str, budget: Budget) -> dict:
    import torch

    from autoplan.errors import AutoplanError, InfeasibleError
    from cost_models.allocator import reserved_bound

    on_gpu = args.device == "cuda"
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if on_gpu else None
    rows = []
    for model, seq_len, batches, *kinds in GRID[args.device + ("-quick" if args.quick else "")]:
        for batch in batches:
            lean = None
            for kind in (kinds[0] if kinds else KINDS):
                row = {"model": model, "seq_len": seq_len, "micro_batch": batch, "plan": kind, "world_size": WORLD}
                rows.append(row)
                if not budget.allows(30):
                    row["status"] = "skipped: out of time"
                    continue
                if kind == "autoplan" and lean is None:
                    row["status"] = "skipped: no all-shard+checkpoint plan to set its limit from"
                    continue
                try:
                    plan = _plan(model, seq_len, batch, kind, profile, lean)
                except InfeasibleError as exc:
                    row.update(status="no plan", note=str(exc).splitlines()[0])
                    continue
                except AutoplanError as exc:  # a trace or profile this torch cannot make: the next rows may run
                    row.update(status="failed", note=str(exc)[:1000])
                    continue
                lean = lean or plan.predicted.peak_mem_bytes
                # the plan itself, so that its allocations can be replayed later on any machine against what
                # this GPU reserved (python benchmarks/allocator.py --kit OUT): all plans in one file, plans.json
                key = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{model}-s{seq_len}-mb{batch}-{kind}")
                _save_plan(args.out, key, plan)
                row.update(predicted=plan.predicted.model_dump(mode="json"), plan_key=key,
                           mem_limit_bytes=plan.cluster.mem_limit_bytes, decisions=_decisions(plan))
                if gpu_mem and plan.predicted.peak_mem_bytes > FIT_FRACTION * gpu_mem:
                    row["status"] = f"skipped: predicted above {FIT_FRACTION:.0%} of the GPU's memory"
                    continue
                runs = {conf: _run_under(plan, args.device, conf, gpu_mem) for conf in
                        (ALLOCATOR_CONFS if on_gpu else (None,))}
                if on_gpu:  # each configuration: whether the step ran capped at the plan's needed bound, and what
                    row["allocator"] = {conf: run["summary"] for conf, run in runs.items()}  # it took
                # the memory and time figures: on a GPU from a run without a cap (a capped run near its bound may time
                # the allocator freeing its cache to make room: its alloc_retries say)
                first = _run_under(plan, args.device, ALLOCATOR_CONFS[0], None) if on_gpu else runs[None]
                if first["result"] is None:
                    row.update(status=first["summary"]["status"], note=first["summary"].get("note"))
                    continue
                result = first["result"]
                measured = result.measured_peak_bytes
                row.update(status="ok", wall_s=first["wall_s"],
                           predicted_peak_bytes=result.predicted_peak_bytes, measured_peak_bytes=measured,
                           mem_error=(result.predicted_peak_bytes - measured) / measured,
                           cuda_max_allocated_bytes=result.cuda_max_allocated_bytes,
                           cuda_max_reserved_bytes=result.cuda_max_reserved_bytes,
                           predicted_phase_bytes=result.predicted_phase_bytes,
                           measured_phase_bytes=result.measured_phase_bytes,
                           over_limit=measured > plan.cluster.mem_limit_bytes,
                           predicted_compute_s=result.predicted_compute_s, measured_compute_s=result.measured_compute_s,
                           # by phase: where a time miss is (forward, backward with its recompute, optimizer step)
                           predicted_phase_s=result.predicted_phase_s, measured_phase_s=result.measured_phase_s,
                           mem_source=result.mem_source,
                           # the caching allocator's figure the plan gives (cost_models.allocator), beside the measured
                           predicted_reserved_bytes=reserved_bound(result.predicted_peak_bytes),
                           step_times_s=result.step_times_s)
                if on_gpu and abs(row["mem_error"]) > PEAK_MISS and budget.allows(60):
                    row["peak_blocks"] = _peak_blocks(plan)  # what the memory model did not count
                for conf, run in runs.items():
                    if conf is not None:
                        summary = run["summary"]
                        print(f"  {model} mb {batch} {kind} ({conf}): {summary['status']} capped at the needed bound "
                              f"{summary['needed_bound_bytes'] / 1e6:.0f} MB; reserved {_mb(summary.get('reserved'))}, "
                              f"allocated {_mb(summary.get('allocated'))} (predicted "
                              f"{result.predicted_peak_bytes / 1e6:.0f} MB)", flush=True)
    return {"profile": profile, "world_size": WORLD, "rows": rows}


def stage_compute(args, profile: str, budget: Budget) -> dict:
    import tempfile

    rows = []
    for model, seq_len, batch in COMPUTE[args.device + ("-quick" if args.quick else "")]:
        row = {"model": model, "seq_len": seq_len, "micro_batch": batch, "gpus": 1}
        rows.append(row)
        if not budget.allows(60):
            row["status"] = "skipped: out of time"
            continue
        with tempfile.TemporaryDirectory() as scratch:
            plan, report = Path(scratch) / "plan.json", Path(scratch) / "report.json"
            search = cli("search", "--model", model, "--gpus", "1", "--seq-len", str(seq_len), "--batch-size",
                         str(batch), "--profile", profile, "--mem", "10000GB", "--allow-over-device-mem",
                         "-o", str(plan), timeout=budget.left_s())
            if search.returncode != 0:
                row.update(status="no plan", note=search.stderr.strip()[-500:])
                continue
            try:
                steps = ("2", "1") if args.quick else ("5", "2")
                done = cli("apply", str(plan), "--steps", steps[0], "--warmup", steps[1], "--report", str(report),
                           timeout=budget.left_s())
            except subprocess.TimeoutExpired:
                row["status"] = "out of time"
                continue
            if not report.is_file():
                row.update(status="failed", note=(done.stderr or done.stdout).strip()[-1000:])
                continue
            data = json.loads(report.read_text())
        predicted, measured = data["predicted"], data["measured"]
        row.update(status=data["status"], device=data["device"], predicted_step_s=predicted["step_time_s"],
                   measured_step_s=measured["step_time_s"], predicted_peak_bytes=predicted["peak_mem_bytes"],
                   measured_peak_bytes=measured["peak_mem_bytes"], step_times_s=measured["step_times_s"],
                   peak_mem_source=measured["peak_mem_source"])
        if row["measured_step_s"]:
            row["time_error"] = (row["predicted_step_s"] - row["measured_step_s"]) / row["measured_step_s"]
        if row["measured_peak_bytes"]:
            row["mem_error"] = (row["predicted_peak_bytes"] - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
    return {"profile": profile, "rows": rows}


def stage_checkpoint(args, profile: str, budget: Budget) -> dict:
    """What each checkpoint mode costs one block, forward + backward, no FSDP (checkpoint_cost.mode_row, in
    this process), beside the step model's figure for the same block on the kit's profile: a selectively
    checkpointed block cost 5-7 ms a step more than predicted on two H200s (benchmarks/RESULTS.md section 9)."""
    from checkpoint_cost import MODES, mode_row

    model, seq_len, batch, blocks, reps = CHECKPOINT[args.device]
    rows = []
    for mode in MODES:
        row = {"mode": mode}
        rows.append(row)
        if not budget.allows(20):
            row["status"] = "skipped: out of time"
            continue
        try:
            row.update(mode_row(model, mode, blocks, batch, seq_len, args.device, reps, profile), status="ok")
        except Exception as exc:  # noqa: BLE001 - a stage records what failed and the kit goes on
            row.update(status="failed", note=f"{type(exc).__name__}: {exc}"[:500])
    return {"profile": profile, "model": model, "seq_len": seq_len, "micro_batch": batch, "blocks": blocks,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    global PEAK_MISS  # --peak-miss
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--quick", action="store_true", help="a quick profile and a small grid")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_truth",
                        help="folder of gpu_truth.json, gpu_truth.txt and the measured profile")
    parser.add_argument("--resume", type=Path, help="an earlier gpu_truth.json whose stages this run adds to")
    parser.add_argument("--profile", help="plan with this profile (default: the one measured, else the shipped one)")
    parser.add_argument("--budget-min", type=float, default=8.0,
                        help="the whole run's minutes, shared out among the stages (default 8)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE,
                        help=f"the profile's measurement cache (default {CACHE})")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the wheels into benchmarks/wheels, exit")
    parser.add_argument("--peak-miss", type=float, default=PEAK_MISS,
                        help=f"record the blocks alive at a grid run's peak past this miss (default {PEAK_MISS})")
    args = parser.parse_args(argv)
    PEAK_MISS = args.peak_miss
    if args.fetch_wheels:
        return fetch_wheels()
    stages = [s for s in args.stages.split(",") if s]
    if unknown := [s for s in stages if s not in STAGES]:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if args.resume and not args.resume.is_file():
        parser.error(f"--resume {args.resume}: no such file")
    budget = Budget(args.budget_min)
    packages = ensure_packages()

    import torch
    from gpu_truth_report import format_results, summarize

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU here (use --device cpu)")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.resume.read_text()) if args.resume else {"kind": "autoplan gpu truth", "stages": {}}
    results.setdefault("runs", []).append({
        "stages": stages, "device": args.device, "device_name": device_name, "torch": torch.__version__,
        "python": sys.version.split()[0], "quick": args.quick, "packages": packages,
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()})
    for stage in stages:
        allowance, started = budget.start_stage(stage, stages), time.monotonic()
        print(f"gpu_truth: {stage} ({allowance / 60:.1f} of {(budget.end - started) / 60:.1f} min left)", flush=True)
        if stage == "profile":
            results["stages"]["profile"] = stage_profile(args, device_name, budget)
        else:
            profile = args.profile or plan_profile(args, results)
            run = {"grid": stage_grid, "compute": stage_compute, "checkpoint": stage_checkpoint}[stage]
            results["stages"][stage] = run(args, profile, budget)
        results["stages"][stage].update(allowance_s=round(allowance, 1),
                                        stage_wall_s=round(time.monotonic() - started, 1))
        results["summary"] = summarize(results)
        (args.out / "gpu_truth.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "gpu_truth.txt").write_text(format_results(results) + "\n")
    print(format_results(results))
    print(f"\nwritten: {args.out / 'gpu_truth.json'}, {args.out / 'gpu_truth.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
