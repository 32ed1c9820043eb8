"""Allocated vs reserved on CUDA for real plans, without a GPU: a step's allocations replayed through a model
of torch's caching allocator (cost_models/allocator.py).

How: one rank (rank 0 of 8) of each plan runs on fake tensors and torch's fake process group, as
autoplan/run/torch_tracker.py does, with `autoplan apply`'s step (the loss by worker.next_token_loss, the
optimizer as CUDA runs it: foreach). A live-tensor tracker (autoplan.run.memtrack) records every storage's
allocation and free, in order, with its size, from materialisation through a warm-up step and two more steps.
Each allocation is given the CUDA stream FSDP2 makes it on (its all-gather copy-in stream for the all-gather
buffers, its reduce-scatter stream for the reduction outputs and their fp32 casts, the default stream for
everything else): the caching allocator never lends a block cached for one stream to another.
The sequence is replayed through the allocator model: the reserved peak with no limit (what
torch.cuda.max_memory_reserved reports on a device with room to spare), and the smallest limit the step runs
in without an out-of-memory error (the allocator frees its cached segments under pressure): what a plan's
limit has to hold.

    python benchmarks/allocator.py            # the grid (about 2 minutes; run it under the heavy lock)
    python benchmarks/allocator.py --quick    # two small configurations
    python benchmarks/allocator.py --fit      # search with and without --fit-allocator (FIT_CASES)
    python benchmarks/allocator.py --kit DIR  # the GPU kit's plans (DIR/gpu_truth.json) replayed, beside what
                                              # the GPU reserved running them
    python benchmarks/allocator.py --default  # the default search's plans at three limits per model, made for each
                                              # allocator configuration and replayed under it (issue 23);
                                              # --conf native / expandable: one configuration, written to
                                              # results/allocator_default_<conf>.json (two run side by side)
    python benchmarks/allocator.py --default --refit --conf native  # the same cases fitted by replay
                                              # (--fit-allocator on): each round's need, the fit's time
    python benchmarks/allocator_weights.py --by-mode  # the native bound's constants fitted to these runs' replays
    python benchmarks/allocator.py --search-time  # `autoplan search` fitted to needed (the default, with the
                                              # replay check) beside --fit-to allocated --fit-allocator off, in turn

Not seen here (fake tensors run no kernel): cuBLAS/cuDNN workspaces and kernel scratch the allocator serves
(cuBLAS: a few MiB per handle and stream), and memory outside the allocator (CUDA context, NCCL's buffers).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from allocator_weights import mode_parts, packed, stranded_text, timeline_parts
from common import write_results

import autoplan
from autoplan.profile_store import load_profile
from autoplan.run.allocator_fit import record_steady, record_step, replay_events
from cost_models.allocator import ROUND_LARGE, SEGMENT_SLACK
from cost_models.allocator_conf import modelled_options
from cost_models.allocator_margin import needed_of_parts
from cost_models.allocator_replay import replay_room, run_and_min_limit, stranded

PROFILE = "h100-sxm-80gb"
WORLD = 8
# (model, checkpoint, micro-batch, sequence, memory limit for the solver; None: all-shard uniformly). A solver's
# plan with a node-sharded (2-D mesh) unit does not run on fake tensors yet: the mesh reads a rank map's values.
GRID = [
    ("llama2-7b", "full", 1, 4096, None),
    ("llama2-7b", "full", 2, 4096, None),
    ("llama2-7b", "full", 4, 4096, None),
    ("llama2-7b", "none", 1, 4096, None),
    ("llama2-7b", "selective", 2, 4096, None),
    ("llama3-8b", "full", 1, 8192, None),
    ("llama3-8b", "full", 2, 8192, None),
    ("llama3-8b", "none", 1, 4096, None),
    ("llama3-8b", "full", 2, 8192, None, 2),  # tensor-parallel (degree 2, sequence parallel off)
    ("llama2-7b", "selective", 2, 4096, None, 4),
    ("llama2-7b", "full", 2, 4096, None, 1, True),  # every unit offloaded to the host (its state left out)
    ("llama3-8b", "none", 1, 4096, None, 1, True),
]
# (model, sequence, limit): the solver's plan (tensor parallelism off, micro-batch searched) with and without
# search_fitting_allocator
FIT_CASES = [("llama2-7b", 4096, "20GB"), ("llama2-7b", 4096, "40GB"), ("llama3-8b", 8192, "40GB"),
             ("llama2-7b[n_layers=4]", 1024, "5.2GB")]
QUICK = [("llama2-7b[n_layers=4]", "full", 2, 1024, None), ("llama2-7b[n_layers=4]", "none", 1, 1024, None)]
# (model, sequence, limits): the default search's plans (tensor degrees searched)
DEFAULT_CASES = [("gpt2-1.5b", 1024, ("8GB", "12GB", "16GB")), ("llama2-7b", 4096, ("20GB", "30GB", "40GB")),
                 ("llama3-8b", 8192, ("30GB", "40GB", "60GB"))]
# models the bounds' constants were not fitted on (benchmarks/allocator_weights.py reads the default cases' files
# only): whether their default plans' bounds hold their replays (`--default --held-out`)
HELD_OUT_CASES = [("llama-1b", 2048, ("10GB", "14GB", "20GB", "30GB")), ("gpt2", 1024, ("3GB", "6GB", "12GB"))]
CONFIGS = ("expandable_segments:True", "expandable_segments:False")
# (name, search flags): what fitting to `needed` costs a search, measured against the live-bytes fit in one run
SEARCH_TIME_CASES = [
    ("gpt2-1.5b, 8 x A100, 8GB", ["--model", "gpt2-1.5b", "--mem", "8GB"]),
    ("llama3-8b, 8 x H100, 40GB", ["--model", "llama3-8b", "--profile", "h100-sxm-80gb", "--gpus", "8",
                                   "--mem", "40GB"]),
    ("llama2-70b, 8 x 8 H100, 80GB", ["--model", "llama2-70b", "--profile", "h100-sxm-80gb", "--nodes", "8",
                                      "--gpus-per-node", "8", "--mem", "80GB"]),
]
LIVE_FIT = ["--fit-to", "allocated", "--fit-allocator", "off"]


def selective_activation_bytes(plan) -> int:
    """The activations `plan`'s selectively checkpointed units save (what the expandable bound's selective term
    counts)."""
    return sum(u.predicted.activation_bytes for u in plan.units if u.checkpoint in ("selective", "selective_op"))


def plan_needed_bytes(plan, conf: str) -> int:
    """The needed bound of `plan`'s predicted timeline under `conf` (cost_models.allocator_margin, per time point),
    whichever configuration the plan was made for."""
    return needed_of_parts(timeline_parts(plan), conf, selective_activation_bytes(plan))


def default_results_name(args) -> str:
    """The results file of a --default run: one per configuration where --conf names one (two runs side by side,
    one per configuration, would otherwise overwrite each other's file), per model and limit where asked for."""
    return ("allocator_default" + ("_refit" if args.refit else "") + ("_heldout" if args.held_out else "")
            + (f"_{args.conf}" if args.conf else "")
            + (f"_{args.only}" if args.only else "") + (f"_{args.limit}" if args.limit else ""))


def search_times(repeats: int) -> list[dict]:
    """Wall seconds of `autoplan search` per case, the default fit and the live-bytes fit in turn (each repeat
    runs both), and their ratio by medians."""
    import statistics
    import subprocess
    import sys

    rows = []
    for name, flags in SEARCH_TIME_CASES:
        times: dict[str, list[float]] = {"needed": [], "allocated": []}
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(repeats):
                for fit, extra in (("needed", []), ("allocated", LIVE_FIT)):
                    started = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "autoplan", "search", *flags, *extra, "-o",
                                    str(Path(folder) / f"{fit}.json")], check=True, capture_output=True)
                    times[fit].append(time.perf_counter() - started)
        ratio = statistics.median(times["needed"]) / statistics.median(times["allocated"])
        print(f"{name}: fitted to needed {statistics.median(times['needed']):.1f} s, to allocated "
              f"{statistics.median(times['allocated']):.1f} s (medians of {repeats}): {ratio:.2f}x "
              "(target at most 1.3x)", flush=True)
        rows.append({"case": name, "flags": flags, "needed_s": times["needed"], "allocated_s": times["allocated"],
                     "ratio": ratio})
    return rows


def plan_for(model: str, checkpoint: str | None, batch: int | None, seq_len: int, limit: str | None, tp: int = 1,
             offload: bool = False):
    if limit is not None:
        return autoplan.search(model, limit, gpus=WORLD, profile=PROFILE, seq_len=seq_len)
    return autoplan.search(model, "1000GB", gpus=WORLD, profile=PROFILE, seq_len=seq_len, batch_size=batch,
                           strategy="shard", checkpoint=checkpoint, allow_over_device_mem=True, tp=tp,
                           offload=offload)


def fit_cases(cases) -> list[dict]:
    """Each case's plain plan and fitted plan: predicted peak, what the replay says the step needs, step time."""
    from autoplan.errors import InfeasibleError
    from autoplan.run.allocator_fit import replay_plan, search_fitting_allocator
    from autoplan.settings import SearchSettings

    gib, rows = 2 ** 30, []
    for model, seq_len, limit in cases:
        settings = SearchSettings.create(model=model, mem=limit, gpus=WORLD, profile=PROFILE, seq_len=seq_len, tp=1)
        started = time.perf_counter()
        plain = autoplan.search(settings=settings)
        plain_needed = replay_plan(plain).needed_bytes
        row = {"model": model, "seq_len": seq_len, "limit": limit, "limit_bytes": plain.cluster.mem_limit_bytes,
               "plain_peak_bytes": plain.predicted.peak_mem_bytes, "plain_needed_bytes": plain_needed,
               "plain_throughput": plain.predicted.throughput_samples_s, "plain_micro_batch": plain.training.micro_batch_size}
        try:
            fitted, replays = search_fitting_allocator(settings)
            row.update(fitted_peak_bytes=fitted.predicted.peak_mem_bytes,
                       fitted_needed_bytes=fitted.predicted.allocator_needed_bytes,
                       fitted_throughput=fitted.predicted.throughput_samples_s, fitted_micro_batch=fitted.training.micro_batch_size,
                       rounds=len(replays))
        except InfeasibleError as error:
            row.update(fitted_error=str(error))
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        fitted_text = (f"fitted peak {row['fitted_peak_bytes'] / gib:.2f}, needs {row['fitted_needed_bytes'] / gib:.2f}, "
                       f"throughput {row['fitted_throughput'] / row['plain_throughput']:.3f}x (mb {row['plain_micro_batch']} -> "
                       f"{row['fitted_micro_batch']}), {row['rounds']} round(s)"
                       if "fitted_error" not in row else f"fitted: {row['fitted_error']}")
        print(f"{model} seq {seq_len} @ {limit}: plain peak {row['plain_peak_bytes'] / gib:.2f}, needs "
              f"{plain_needed / gib:.2f} GiB (limit {row['limit_bytes'] / gib:.2f}); {fitted_text} "
              f"({row['seconds']:.0f} s)", flush=True)
    return rows


def default_rows(cases, configs=CONFIGS, plans: dict | None = None) -> list[dict]:
    """Each default plan (fitted to what the allocator needs, per configuration) replayed under its configuration:
    what the step needs against the limit, and how much of the limit it leaves unused. `plans`: filled with each
    plan (as JSON) under its row's `plan_key`, for gpu_min_limit.py to run on a GPU."""
    from autoplan.errors import UsageError
    from autoplan.run.replayable import check_replayable

    gib, rows = 2 ** 30, []
    for model, seq_len, limits in cases:
        for limit in limits:
            for conf in configs:
                started = time.perf_counter()
                plan = autoplan.search(model, limit, gpus=WORLD, profile=PROFILE, seq_len=seq_len,
                                       allocator_conf=conf)  # tensor degrees searched, as a user runs it
                try:
                    check_replayable(plan)
                except UsageError as exc:  # plans that cannot be replayed yet
                    print(f"{model} seq {seq_len} @ {limit} ({conf}): not replayed: {exc}", flush=True)
                    rows.append({"model": model, "seq_len": seq_len, "limit": limit, "allocator_conf": conf,
                                 "not_replayed": str(exc)})
                    continue
                key = f"{model}-s{seq_len}-{limit}-{'expandable' if conf.endswith('True') else 'native'}"
                if plans is not None:
                    plans[key] = json.loads(plan.to_json())
                steps = record_steady(plan)  # as autoplan.run.allocator_fit.replay_plan, keeping the events
                events, expandable = steps.events, conf.endswith("True")
                replayed = replay_events(events, *modelled_options(conf), steps)  # natively with its max_split_size_mb
                needed = replayed.needed_bytes
                recorded = replay_events(events[:steps.recorded_end()], *modelled_options(conf)).needed_bytes
                mem = plan.cluster.mem_limit_bytes
                row = {"model": model, "seq_len": seq_len, "limit": limit, "limit_bytes": mem, "allocator_conf": conf,
                       "plan_key": key, "tp": plan.cluster.tp_degree, "sp": plan.cluster.sequence_parallel,
                       "micro_batch": plan.training.micro_batch_size, "peak_bytes": plan.predicted.peak_mem_bytes,
                       "bound_bytes": plan.predicted.needed_bytes, "needed_bytes": needed,
                       "needed_recorded_bytes": recorded,  # over the three recorded steps alone
                       "reserved_bytes": replayed.reserved_bytes, "fits": needed <= mem,
                       # within the limit less what a GPU needs beyond a replay (GPU_REPLAY_ERROR)
                       "fits_with_gpu_error": needed <= replay_room(mem, expandable),
                       "bound_holds": plan.predicted.needed_bytes >= needed,  # the bound the plan is fitted to
                       "used": needed / mem,
                       "parts": packed(timeline_parts(plan) if expandable else mode_parts(plan)),
                       "selective_bytes": selective_activation_bytes(plan)}
                where = None if expandable else stranded(events, needed - SEGMENT_SLACK - ROUND_LARGE)
                if where is not None:
                    row["stranded"] = {"event": where.event, "request_bytes": where.request, "total_bytes": where.total,
                                       "by_segment": {str(k): v for k, v in where.by_segment.items()}}
                row["seconds"] = time.perf_counter() - started
                rows.append(row)
                print(f"{model} seq {seq_len} @ {limit} ({conf}): tp {row['tp']}, mb {row['micro_batch']}, "
                      f"peak {row['peak_bytes'] / gib:.2f}, "
                      f"bound {row['bound_bytes'] / gib:.2f}, replay needs {row['needed_bytes'] / gib:.2f} GiB = "
                      f"{row['used']:.1%} of the limit{'' if row['fits'] else ' OVER'} ({row['seconds']:.0f} s)"
                      + (f"; {stranded_text(where)}" if where is not None else ""), flush=True)
    return rows


def refit_rows(cases, configs=CONFIGS) -> list[dict]:
    """Each default case searched as `autoplan search --fit-allocator on` does (the default plan replayed, then planned
    up by what its replay leaves unused, each round replayed): what the chosen plan's step needs against the limit,
    and the fit's time over the default search's (wall seconds, measured in the same run)."""
    from autoplan.run.allocator_fit import search_fitting_allocator
    from autoplan.settings import SearchSettings

    gib, rows = 2 ** 30, []
    for model, seq_len, limits in cases:
        for limit in limits:
            for conf in configs:
                settings = SearchSettings.create(model=model, mem=limit, gpus=WORLD, profile=PROFILE, seq_len=seq_len,
                                                 allocator_conf=conf)
                started = time.perf_counter()
                autoplan.search(settings=settings)
                search_s = time.perf_counter() - started
                plan, replays = search_fitting_allocator(settings)
                fit_s = time.perf_counter() - started - search_s
                mem, needed = plan.cluster.mem_limit_bytes, plan.predicted.allocator_needed_bytes
                row = {"model": model, "seq_len": seq_len, "limit": limit, "limit_bytes": mem, "allocator_conf": conf,
                       "tp": plan.cluster.tp_degree, "sp": plan.cluster.sequence_parallel, "micro_batch": plan.training.micro_batch_size,
                       "peak_bytes": plan.predicted.peak_mem_bytes, "needed_bytes": needed, "fits": needed <= mem,
                       "used": needed / mem, "rounds_used": [r.needed_bytes / mem for r in replays],
                       "fits_with_gpu_error": needed <= replay_room(mem, conf.endswith("True")),
                       "search_s": search_s, "fit_s": fit_s, "throughput": plan.predicted.throughput_samples_s}
                rows.append(row)
                print(f"{model} seq {seq_len} @ {limit} ({conf}): tp {row['tp']}, mb {row['micro_batch']}, peak "
                      f"{row['peak_bytes'] / gib:.2f}, replay needs {needed / gib:.2f} GiB = {row['used']:.1%} of the "
                      f"limit (rounds: {', '.join(f'{u:.1%}' for u in row['rounds_used'])}), {fit_s:.0f} s "
                      f"against the search's {search_s:.1f} s", flush=True)
    return rows


def kit_rows(folder: Path) -> list[dict]:
    """The GPU kit's grid plans replayed here under both allocator configurations: the replay's reserved peak beside
    CUDA's (the kit's free run, expandable segments), and the replay's needed beside the bound the kit capped the
    GPU at and whether the step ran there (a replay that says more than a bound the GPU failed under would have
    caught it; one that says more than a bound the GPU ran under is conservative by the difference)."""
    from autoplan.errors import AutoplanError
    from gpu_truth import load_kit_plan

    results = json.loads((folder / "gpu_truth.json").read_text())
    plans = json.loads((folder / "plans.json").read_text()) if (folder / "plans.json").is_file() else {}
    rows, mib = [], 2 ** 20
    for row in results.get("stages", {}).get("grid", {}).get("rows", []):
        if not row.get("cuda_max_reserved_bytes") or row.get("plan_key") not in plans:
            continue
        label = f"{row['model']} s{row['seq_len']} mb{row['micro_batch']} {row['plan']}"
        try:
            events, _ = record_step(load_kit_plan(folder, plans[row["plan_key"]]))
        except AutoplanError as exc:
            print(f"{label}: not replayed: {exc}")
            continue
        out = {"plan": label, "plan_key": row["plan_key"], "measured_allocated_bytes": row["cuda_max_allocated_bytes"],
               "measured_reserved_bytes": row["cuda_max_reserved_bytes"], "confs": {}}
        for conf, gpu in row.get("allocator", {}).items():
            replayed = replay_events(events, *modelled_options(conf))
            needed, bound = replayed.needed_bytes, gpu["needed_bound_bytes"]
            out["confs"][conf] = {"replayed_allocated_bytes": replayed.allocated_bytes,
                                  "replayed_reserved_bytes": replayed.reserved_bytes, "replayed_needed_bytes": needed,
                                  "gpu_bound_bytes": bound, "gpu_status": gpu["status"],
                                  "gpu_reserved_bytes": gpu.get("reserved"),
                                  "gpu_allocated_bytes": gpu.get("allocated"),
                                  # the replay agrees with the GPU: it needs more than a bound the GPU failed under, or
                                  # no more than one it ran under
                                  "agrees": (needed > bound) == (gpu["status"] != "ran")}
            short = "exp" if conf.endswith("True") else "nat"
            c = out["confs"][conf]
            print(f"{label} [{short}]: GPU {gpu['status']} at {bound / mib:.0f} MiB; replay needs {needed / mib:.0f} "
                  f"MiB ({needed / bound - 1:+.1%}); reserved free run: replay {replayed.reserved_bytes / mib:.0f}"
                  + (f", GPU {row['cuda_max_reserved_bytes'] / mib:.0f} MiB" if short == "exp" else " MiB")
                  + ("" if c["agrees"] else "  DISAGREES"), flush=True)
        rows.append(out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small configurations")
    parser.add_argument("--fit", action="store_true", help="the solver's plans with and without --fit-allocator")
    parser.add_argument("--kit", type=Path, metavar="DIR", help="replay the GPU kit's plans in DIR (its --out)")
    parser.add_argument("--default", action="store_true", help="the default search's plans, per allocator configuration")
    parser.add_argument("--only", help="with --default: the models whose name contains this")
    parser.add_argument("--limit", help="with --default: this limit only (e.g. 16GB)")
    parser.add_argument("--refit", action="store_true", help="with --default: fitted by replay (--fit-allocator on)")
    parser.add_argument("--held-out", action="store_true",
                        help="with --default: models the bounds were not fitted on (HELD_OUT_CASES)")
    parser.add_argument("--conf", choices=("expandable", "native"), help="with --default: one configuration only")
    parser.add_argument("--search-time", type=int, nargs="?", const=3, metavar="REPEATS",
                        help="search wall time fitted to needed against allocated (default 3 repeats)")
    args = parser.parse_args()
    assert load_profile(PROFILE).device_type == "cuda"
    if args.kit:
        path = write_results("allocator_kit", {"kit": str(args.kit), "rows": kit_rows(args.kit)})
        print(f"written to {path}")
        return
    if args.search_time:
        path = write_results("allocator_search_time", {"rows": search_times(args.search_time)})
        print(f"written to {path}")
        return
    if args.default:
        configs = [c for c in CONFIGS if not args.conf or c.endswith("True") == (args.conf == "expandable")]
        cases = [(model, seq, tuple(m for m in limits if not args.limit or m == args.limit))
                 for model, seq, limits in (HELD_OUT_CASES if args.held_out else DEFAULT_CASES)
                 if not args.only or args.only in model]
        plans = {}
        rows = refit_rows(cases, configs) if args.refit else default_rows(cases, configs, plans)
        replayed = [r for r in rows if "fits" in r]
        room = sum(r["fits_with_gpu_error"] for r in replayed)
        holds = f"; the plan's bound at least its replay in {sum(r['bound_holds'] for r in replayed)}" \
            if not args.refit else ""  # a fitted plan is held to its replay, not its bound
        print(f"fit: {sum(r['fits'] for r in replayed)} of {len(replayed)} replayed ({len(rows) - len(replayed)} not "
              f"replayable); used {min(r['used'] for r in replayed):.1%}-{max(r['used'] for r in replayed):.1%} of the "
              f"limit (target: at most 100%, at least 95%); {room} within it less what a GPU was measured to need "
              f"beyond a replay{holds}")
        path = write_results(default_results_name(args), {"rows": rows})
        if plans:  # the plans themselves, for gpu_min_limit.py --default on a GPU
            write_results("plans_" + default_results_name(args), plans)  # not a results file: named apart
        print(f"written to {path}")
        return
    if args.fit:
        path = write_results("allocator_fit", {"rows": fit_cases(FIT_CASES)})
        print(f"written to {path}")
        return
    gib = 2 ** 30
    print(f"{'plan':<34} {'mb':>2} {'seq':>5} {'predicted':>9} {'live':>7} {'alloc':>7} {'reserved':>8} "
          f"{'needed':>7} {'need/pred':>9} {'exp. res':>8} {'exp. need':>9} {'need/pred':>9} {'exp. bound':>10} "
          f"{'nat. bound':>10}  (GiB)")
    rows = []
    for model, checkpoint, batch, seq_len, limit, *more in QUICK if args.quick else GRID:
        started = time.perf_counter()
        plan = plan_for(model, checkpoint, batch, seq_len, limit, *more)
        steps = record_steady(plan)
        events = steps.events
        (free_run, needed), (expandable_run, needed_expandable) = (
            run_and_min_limit(events, expandable=expandable, settle=steps) for expandable in (False, True))
        # as a plan's needed bound counts them: the kernel workspaces a replay cannot see on top
        needed, needed_expandable = needed + SEGMENT_SLACK, needed_expandable + SEGMENT_SLACK
        predicted = plan.predicted.peak_mem_bytes
        bound, native_bound = (plan_needed_bytes(plan, conf) for conf in CONFIGS)
        label = f"{model} " + (f"shard+{checkpoint}" if limit is None else f"solver@{limit}") + \
            (f" tp{plan.cluster.tp_degree}" if plan.cluster.tp_degree > 1 else "") + \
            (" offload" if any(u.offload for u in plan.units) else "")
        mb = plan.training.micro_batch_size
        print(f"{label:<34} {mb:>2} {seq_len:>5} {predicted / gib:>9.2f} {free_run.peak_requested / gib:>7.2f} "
              f"{free_run.peak_allocated / gib:>7.2f} {free_run.peak_reserved / gib:>8.2f} {needed / gib:>7.2f} "
              f"{needed / predicted:>9.4f} {expandable_run.peak_reserved / gib:>8.2f} {needed_expandable / gib:>9.2f} "
              f"{needed_expandable / predicted:>9.4f} {bound / gib:>10.2f} {native_bound / gib:>10.2f}  "
              f"({time.perf_counter() - started:.0f} s, "
              f"{len(events)} events, {free_run.segments} segments)", flush=True)
        rows.append({"model": model, "plan": label, "micro_batch": mb, "seq_len": seq_len,
                     "predicted_peak_bytes": predicted, "live_peak_bytes": free_run.peak_requested,
                     "allocated_peak_bytes": free_run.peak_allocated, "reserved_peak_bytes": free_run.peak_reserved,
                     "needed_limit_bytes": needed, "native_bound_bytes": native_bound,
                     "expandable_reserved_bytes": expandable_run.peak_reserved,
                     "expandable_needed_bytes": needed_expandable, "expandable_bound_bytes": bound,
                     "events": len(events), "segments": free_run.segments, "parts": packed(timeline_parts(plan))})
    for conf, needed_key, bound_key in ((CONFIGS[1], "needed_limit_bytes", "native_bound_bytes"),
                                        (CONFIGS[0], "expandable_needed_bytes", "expandable_bound_bytes")):
        worst = max(rows, key=lambda r: r[needed_key] / r["predicted_peak_bytes"])
        print(f"{conf}: worst needed/predicted {worst[needed_key] / worst['predicted_peak_bytes']:.4f} "
              f"({worst['plan']}, mb {worst['micro_batch']}); bound/needed at least "
              f"{min(r[bound_key] / r[needed_key] for r in rows):.4f}")
    path = write_results("allocator" + ("_quick" if args.quick else ""), {"rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
