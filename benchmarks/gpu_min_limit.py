"""On one GPU: the smallest memory cap each of the GPU kit's plans runs under, against the CPU replay's figure.

The kit (gpu_truth.py) runs each plan capped at the plan's own `needed` bound and says whether it ran; that
tells whether a bound is sound, not how close the replay (cost_models/allocator.py, the check `search
--fit-allocator` makes) comes to what CUDA's caching allocator really needs. This script takes the replay's
needed bytes for every plan and allocator configuration (`python benchmarks/allocator.py --kit DIR` writes them to
results/allocator_kit.json, here, without a GPU) and, on the GPU, runs the plan's step (rank 0 of its 8-rank world
on the fake process group, warm-up and two steps: the three steps the replay records) capped at that figure, then
one step (1%) below or above, then a second, pass after pass over all plans so that a budget cut short still
leaves every plan probed: the GPU's smallest cap bracketed around the replay's. Results are written after every
run to --out/gpu_min_limit.json (gpu_default_limits.json with --default).

    python benchmarks/allocator.py --kit benchmarks/results/gpu_truth_cuda    # here: the replay's figures
    run(command="cd benchmarks && PYTHONUNBUFFERED=1 python3 gpu_min_limit.py --budget-s 230 --out $OUT",
        carry=["benchmarks/wheels"], timeout_s=290)

With --default, the default search's plans of `allocator.py --default` (issue 23's grid, its plans saved beside its
results) instead, each capped at its --mem, at 95% of it and at the replay's figure (and, where lower, at the
replay's figure over its three recorded steps alone): whether the plan runs in its limit on the GPU and leaves at
most 5% of it unused:

    python benchmarks/allocator.py --default --conf native      # here, and --conf expandable beside it
    run(command="cd benchmarks && PYTHONUNBUFFERED=1 python3 gpu_min_limit.py --default
        results/allocator_default_native.json results/allocator_default_expandable.json --budget-s 140 --out $OUT",
        carry=["benchmarks/wheels"], timeout_s=195)

`--steps 19` runs twenty steps where the replay records three: whether a GPU needs what the replay says the settled
cache needs, not what three steps do (cost_models.steady_steps; natively gpt2-1.5b's default plans need 1-3% more
from their fourth to seventh step, RESULTS.md section 11b "Steps"):

    run(command="cd benchmarks && PYTHONUNBUFFERED=1 python3 gpu_min_limit.py --default
        results/allocator_default_native.json --only gpt2-1.5b-s1024-12GB-native --steps 19 --budget-s 100
        --out $OUT", carry=["benchmarks/wheels"], timeout_s=150)

`--conf` runs the plans under another allocator configuration than their own, at the same caps: e.g. the native
plans with `max_split_size_mb:256`, which the replay says lets llama-1b's 14GB plan run in its --mem
(allocator_max_split.py; RESULTS.md section 11b):

    run(command="cd benchmarks && PYTHONUNBUFFERED=1 python3 gpu_min_limit.py --default
        results/allocator_default_heldout_native.json --conf expandable_segments:False,max_split_size_mb:256
        --budget-s 60 --out $OUT", carry=["benchmarks/wheels"], timeout_s=120)

`--only KEY --caps-gib A,B,...` caps one plan at the caps given instead: e.g. whether the GPU, as the replay,
fails the held-out llama-1b 10GB plan natively at caps above one it runs under (the replay runs it at 8.59 GiB and
fails it from 8.65 to 8.87; its figure, past the last failing cap, is 8.95 with the workspaces; RESULTS.md 11b):

    run(command="cd benchmarks && PYTHONUNBUFFERED=1 python3 gpu_min_limit.py --default
        results/allocator_default_heldout_native.json --only llama-1b-s2048-10GB-native
        --caps-gib 8.65,8.70,8.75,8.82,8.87,8.95,8.60 --budget-s 60 --out $OUT", carry=["benchmarks/wheels"],
        timeout_s=120)
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from gpu_truth import REPO, ensure_packages, load_kit_plan, set_allocator_conf

KIT = REPO / "benchmarks" / "results" / "gpu_truth_cuda"
REPLAYS = REPO / "benchmarks" / "results" / "allocator_kit.json"
STEP = 0.01  # each probe this share of the replay's figure further from it
PROBES = 3  # per plan and configuration: at the replay's figure, then up to two steps away


def run_capped(plan, conf: str, cap: int, steps: int = 2) -> dict:
    """The plan's warm-up and `steps` steps under allocator configuration `conf`, the process capped at `cap`
    bytes."""
    import torch

    from autoplan.errors import AutoplanError
    from autoplan.run.fake_world import run_fake_world
    from autoplan.run.memtrack import allocation_failure

    gc.collect()
    torch.cuda.empty_cache()
    set_allocator_conf(conf)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
    torch.cuda.reset_peak_memory_stats()
    started, result = time.monotonic(), None
    try:
        result = run_fake_world(plan, steps=steps, warmup=1, device="cuda")
        status, note = "ran", None
    except (AutoplanError, RuntimeError, MemoryError) as exc:
        note = allocation_failure(exc)
        status, note = ("out of memory", note) if note else ("failed", repr(exc)[:300])
    finally:
        # the run resets CUDA's peaks per phase: its own figures are the step's; a failed run's, the failing phase's
        reserved, allocated = ((result.cuda_max_reserved_bytes, result.cuda_max_allocated_bytes) if result is not None
                               else (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()))
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"cap_bytes": cap, "status": status, "note": note, "reserved": reserved, "allocated": allocated,
            "wall_s": round(time.monotonic() - started, 2)}


def next_cap(replayed: int, probes: list[dict]) -> int | None:
    """The next cap to try: the replay's figure first, then a step further in the direction that finds the GPU's
    edge (down after a run, up after an out-of-memory), until the outcome turns or PROBES are spent."""
    if not probes:
        return replayed
    if len(probes) >= PROBES or len({p["status"] for p in probes}) > 1 or probes[-1]["status"] == "failed":
        return None
    sign = -1 if probes[-1]["status"] == "ran" else 1
    return int(replayed * (1 + sign * STEP * len(probes)))


def bracket(probes: list[dict]) -> dict:
    """The GPU's smallest cap as known from the probes: the largest cap it failed under, the smallest it ran under."""
    ran = [p["cap_bytes"] for p in probes if p["status"] == "ran"]
    oom = [p["cap_bytes"] for p in probes if p["status"] == "out of memory"]
    return {"ran_at_bytes": min(ran) if ran else None, "failed_at_bytes": max(oom) if oom else None}


def kit_cases(kit: Path, replays: Path) -> tuple[dict, list[dict]]:
    """The kit's plans (key -> plan JSON) and a case per plan and configuration, probed around the replay's figure."""
    plans = json.loads((kit / "plans.json").read_text())
    cases = []
    for row in json.loads(replays.read_text())["rows"]:
        key = row.get("plan_key") or "-".join(row["plan"].split())  # "llama-1b s2048 mb2 autoplan"
        for conf, replay in row["confs"].items():
            cases.append({"plan": row["plan"], "key": key if key in plans else None, "allocator_conf": conf,
                          "replayed_needed_bytes": replay["replayed_needed_bytes"], "caps": None})
    return plans, cases


def default_cases(results: list[Path]) -> tuple[dict, list[dict]]:
    """The default search's plans of `allocator.py --default` (each results file beside its plans_ file), each
    capped at its --mem (it must run there), at 95% of it (a step that runs there leaves more than 5% unused) and at
    the replay's figure."""
    plans, cases = {}, []
    for path in results:
        plans.update(json.loads(path.with_name("plans_" + path.name).read_text()))
        for row in json.loads(path.read_text())["rows"]:
            if row.get("plan_key") in plans:
                mem, replayed = row["limit_bytes"], row["needed_bytes"]
                recorded = row.get("needed_recorded_bytes", replayed)  # over the three recorded steps alone
                cases.append({"plan": row["plan_key"], "key": row["plan_key"], "allocator_conf": row["allocator_conf"],
                              "replayed_needed_bytes": replayed, "caps": [mem, int(0.95 * mem), replayed]
                              + ([recorded] if recorded < replayed else [])})
    return plans, cases


def only_case(cases: list[dict], key: str, caps_gib: str | None) -> list[dict]:
    """The case of plan `key` alone, capped at `caps_gib` (comma-separated GiB) where given, else at its own caps.
    SystemExit naming the keys there are where `key` is none of them."""
    chosen = [case for case in cases if case["key"] == key]
    if not chosen:
        raise SystemExit(f"no plan {key!r} in the results; there are: {', '.join(c['key'] for c in cases)}")
    if caps_gib:
        try:
            caps = [int(float(cap) * 2 ** 30) for cap in caps_gib.split(",")]
        except ValueError:
            raise SystemExit(f"--caps-gib takes numbers separated by commas, got {caps_gib!r}") from None
        chosen = [dict(case, caps=caps) for case in chosen]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kit", type=Path, default=KIT, help="the kit's folder: plans.json and the measured profile")
    parser.add_argument("--replays", type=Path, default=REPLAYS, help="allocator.py --kit's results for that folder")
    parser.add_argument("--default", type=Path, nargs="+", metavar="RESULTS",
                        help="instead: allocator.py --default's results files (results/allocator_default_*.json)")
    parser.add_argument("--conf", help="with --default: run every plan under this PYTORCH_CUDA_ALLOC_CONF instead of "
                        "its own (e.g. expandable_segments:False,max_split_size_mb:256; allocator_max_split.py)")
    parser.add_argument("--only", metavar="KEY", help="with --default: this plan alone (its key in the plans file)")
    parser.add_argument("--caps-gib", help="with --only: cap it at these GiB (comma-separated) instead")
    parser.add_argument("--steps", type=int, default=2, help="steps after the warm-up (default 2: the three the "
                        "replay records; 19: the twenty its settled figure is carried to, cost_models.steady_steps)")
    parser.add_argument("--budget-s", type=float, default=240, help="stop starting runs after this many seconds")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if (args.conf or args.only) and not args.default:
        parser.error("--conf and --only go with --default")
    if args.caps_gib and not args.only:
        parser.error("--caps-gib goes with --only")
    end = time.monotonic() + args.budget_s
    packages = ensure_packages()
    import torch

    plans, cases = default_cases(args.default) if args.default else kit_cases(args.kit, args.replays)
    if args.only:
        cases = only_case(cases, args.only, args.caps_gib)
    for case in cases if args.conf else ():
        case["allocator_conf"] = args.conf  # the caps stay the plan's (its --mem, 95%, its own replay's figure)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu_default_limits.json" if args.default else "gpu_min_limit.json"
    results = {"device_name": torch.cuda.get_device_name(0), "torch": torch.__version__, "packages": packages,
               "step": STEP, "steps_after_warmup": args.steps,
               "rows": [{k: v for k, v in case.items() if k not in ("key", "caps")} | {"probes": []}
                        for case in cases]}
    loaded, folder = {}, args.default[0].parent if args.default else args.kit  # where a plan's profile may lie
    passes = max([PROBES] + [len(case["caps"] or ()) for case in cases])
    for probe_index in range(passes):  # a pass over every case per probe: the most telling runs first
        for case, row in zip(cases, results["rows"]):
            key, conf, replayed = case["key"], case["allocator_conf"], case["replayed_needed_bytes"]
            if case["caps"] is not None:
                cap = case["caps"][probe_index] if probe_index < len(case["caps"]) else None
            else:
                cap = next_cap(replayed, row["probes"]) if key else None
            if cap is None or time.monotonic() > end:
                continue
            plan = loaded.get(key) or loaded.setdefault(key, load_kit_plan(folder, plans[key]))
            probe = run_capped(plan, conf, cap, args.steps)
            row["probes"].append(probe)
            row.update(bracket(row["probes"]))
            print(f"{case['plan']} [{conf}]: {probe['status']} capped at {cap / 2**20:.0f} MiB (replay "
                  f"{replayed / 2**20:.0f}; reserved {probe['reserved'] / 2**20:.0f}, {probe['wall_s']} s)", flush=True)
            (args.out / name).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
