"""Plan quality: are autoplan's plans faster, in real runs, than what a user would otherwise run?

For several models and memory limits spread from the smallest limit anything fits in up to the
limit all-replicate needs, autoplan's plan and every uniform plan that fits are executed on this
machine (CPU, gloo, 2 ranks, measured cpu-gloo-2 profile, micro-batch fixed so that plans differ
only in their sharding decisions). Reported: autoplan's measured speedup over all-shard and over
the best uniform plan, and whether every executed plan stayed under its limit. On one small model,
every plan of the search space is executed too, and autoplan's regret against the best measured
plan that fits is reported (also against the best that fits the limit less the search's headroom),
in the sweep and again in a second launch of the sweep's five fastest beside autoplan's plan (the
fastest of 72 noisy measurements is flattered by its own noise).
The plans of every limit of one model and micro-batch run in one launch; plans with the same
decisions (the uniform ones recur at several limits, and autoplan's plan is often one of them) are
run once; every plan runs in three rounds, one after the other, and keeps its fastest.

Checkpointing per unit is none, selective or full (issue 12); the uniform plans include all-shard+sel
(every block selectively checkpointed) beside all-shard+ckpt, and the summary says what selective
checkpointing changed, measured: its step time and peak against full checkpointing's (where both ran
at the same micro-batch). No plan offloads: on a CPU device the host is the device, so offloading frees
nothing; the search offers none on a CPU profile, and `--host-mem 1` keeps it so.

    python benchmarks/plan_quality.py           # ~25 min on 2 cores
    python benchmarks/plan_quality.py --skip-exhaustive

Targets (issue 5): >= 1.1x all-shard (geometric mean, where the limit lets a mixed plan differ),
never more than 3% below the best uniform plan that fits, no plan over its limit, regret <= 5%.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import statistics

from common import RESULTS, UNIFORM, decisions, execute_many, make_plan, write_results

from autoplan.settings import DEFAULT_HEADROOM
from cost_models.options import SHARDING_KINDS

MODELS = [
    "gpt2-tiny[n_layers=4,d_model=128]",
    "llama-tiny[n_layers=4,d_model=128,n_heads=4,n_kv_heads=2,ffn_hidden=352]",
]
EXHAUSTIVE_MODEL = "gpt2-tiny[n_layers=2,d_model=64]"
# micro-batch fixed per case, so that plans differ only in their decisions; at the smaller one the
# collectives' fixed costs weigh more against the compute
MICRO_BATCHES, SEQ_LEN = (4, 16), 128
EXHAUSTIVE_BATCH_SIZE = 16
LIMIT_FRACTIONS = (0.0, 1 / 3, 2 / 3, 1.0)  # of the way from the leanest plan to all-replicate
CONFIRM_TOP = 5  # the sweep's fastest plans that fit, measured again beside autoplan's
# uniform plans measured beside autoplan's: common.UNIFORM's and every block selectively checkpointed
KINDS = {**{kind: (kind, []) for kind in UNIFORM}, "all-shard+sel": ("all-shard", ["--checkpoint", "selective"])}
# on the CPU the host is the device: a 1-byte host memory keeps offload out of every plan (see the docstring)
NO_OFFLOAD = ["--host-mem", "1"]


def plan_of(model: str, limit, batch_size: int, kind: str) -> dict | None:
    base, flags = KINDS.get(kind, (kind, []))
    return make_plan(model, str(limit), batch_size, SEQ_LEN, base, [*flags, *NO_OFFLOAD])


def unit_options(plan: dict) -> list[tuple]:
    """Each unit's (sharding, checkpoint mode[, "offload"]); plans of older autoplans say checkpoint true/false."""
    def mode(value) -> str:
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value
    return [(u["sharding"], mode(u["checkpoint"]), *(("offload",) if u.get("offload") else ())) for u in plan["units"]]


def throughput(plan: dict, measured: dict) -> float:
    return plan["training"]["global_batch_size"] / measured["step_time_s"]


def quality(models: list[str]) -> dict:
    rows = []
    print(f"{'model':<72} {'mb':>3} {'limit MB':>9} {'plan':<18} {'pred ms':>8} {'meas ms':>8} {'meas MB':>8} "
          f"{'fits':>5}")
    for model, batch_size in itertools.product(models, MICRO_BATCHES):
        lean = plan_of(model, "100GB", batch_size, "all-shard+ckpt")["predicted"]["peak_mem_bytes"]
        full = plan_of(model, "100GB", batch_size, "all-replicate")["predicted"]["peak_mem_bytes"]
        # the search plans to the limit less its headroom: from the limit the leanest plan just fits
        limits = [int((lean + fraction * (full - lean)) / (1 - DEFAULT_HEADROOM)) + 1 for fraction in LIMIT_FRACTIONS]
        plans_at = {}
        for limit in limits:
            plans = {kind: plan_of(model, limit, batch_size, kind) for kind in ["autoplan", *KINDS]}
            plans_at[limit] = {kind: plan for kind, plan in plans.items() if plan is not None}
        # every limit's plans in one launch: a plan that recurs (the uniform ones) is measured once
        measured_all = iter(execute_many([plan for plans in plans_at.values() for plan in plans.values()]))
        for limit, plans in plans_at.items():
            results = {kind: next(measured_all) for kind in plans}
            case = {"model": model, "micro_batch": batch_size, "limit_bytes": limit, "plans": {}}
            for kind, plan in plans.items():
                measured = results[kind]
                if measured is None:
                    continue
                fits = measured["peak_mem_bytes"] <= limit
                case["plans"][kind] = {
                    "predicted_step_s": plan["predicted"]["step_time_s"], "measured_step_s": measured["step_time_s"],
                    "measured_peak_bytes": measured["peak_mem_bytes"], "measured_throughput": throughput(plan, measured),
                    "under_limit": fits, "decisions": sorted(set(unit_options(plan))),
                    "micro_batch_size": plan["training"]["micro_batch_size"],
                    "same_plan_as": next((other for other, p in plans.items() if other != kind
                                          and decisions(p) == decisions(plan)), None),
                }
                print(f"{model:<72} {batch_size:>3} {limit / 1e6:>9.1f} {kind:<18} {plan['predicted']['step_time_s'] * 1e3:>8.1f} "
                      f"{measured['step_time_s'] * 1e3:>8.1f} {measured['peak_mem_bytes'] / 1e6:>8.1f} "
                      f"{'yes' if fits else 'NO':>5}", flush=True)
            mine = case["plans"].get("autoplan")
            uniform = {k: v for k, v in case["plans"].items() if k != "autoplan" and v["under_limit"]}
            if mine and uniform:
                best_kind = max(uniform, key=lambda k: uniform[k]["measured_throughput"])
                case["best_uniform"] = best_kind
                case["vs_best_uniform"] = mine["measured_throughput"] / uniform[best_kind]["measured_throughput"]
                if "all-shard" in uniform:
                    shard_throughput = uniform["all-shard"]["measured_throughput"]
                    case["vs_all_shard"] = mine["measured_throughput"] / shard_throughput
                    # what was there to gain: the fastest plan measured at this limit, autoplan's included
                    case["best_vs_all_shard"] = max(p["measured_throughput"] for p in case["plans"].values()
                                                    if p["under_limit"]) / shard_throughput
                all_shard_plan = plans.get("all-shard")
                case["differs_from_all_shard"] = (all_shard_plan is not None
                                                  and unit_options(plans["autoplan"]) != unit_options(all_shard_plan))
            case["autoplan_selective_units"] = sum(o[1] == "selective" for o in unit_options(plans["autoplan"]))
            sel, ckpt = case["plans"].get("all-shard+sel"), case["plans"].get("all-shard+ckpt")
            if sel and ckpt and sel["micro_batch_size"] == ckpt["micro_batch_size"]:
                # what selective checkpointing changed, measured: the same plan but for the mode
                case["sel_vs_full"] = {"throughput": sel["measured_throughput"] / ckpt["measured_throughput"],
                                       "peak": sel["measured_peak_bytes"] / ckpt["measured_peak_bytes"],
                                       "predicted_step": sel["predicted_step_s"] / ckpt["predicted_step_s"]}
            rows.append(case)

    differing = [c for c in rows if c.get("differs_from_all_shard") and "vs_all_shard" in c]

    def geomean(values: list[float]) -> float | None:
        return math.exp(statistics.fmean(map(math.log, values))) if values else None

    summary = {
        "geomean_vs_all_shard_where_different": geomean([c["vs_all_shard"] for c in differing]),
        "geomean_best_measured_vs_all_shard_where_different": geomean([c["best_vs_all_shard"] for c in differing]),
        "cases_where_different": len(differing),
        "worst_vs_best_uniform": min((c["vs_best_uniform"] for c in rows if "vs_best_uniform" in c), default=None),
        "plans_over_limit": sum(1 for c in rows for p in c["plans"].values() if not p["under_limit"]),
        "plans_executed": sum(len(c["plans"]) for c in rows),
        "limits_where_autoplan_picks_selective": sum(1 for c in rows if c.get("autoplan_selective_units")),
        "geomean_all_shard_sel_vs_ckpt_throughput": geomean([c["sel_vs_full"]["throughput"] for c in rows
                                                             if "sel_vs_full" in c]),
        "geomean_all_shard_sel_vs_ckpt_peak": geomean([c["sel_vs_full"]["peak"] for c in rows if "sel_vs_full" in c]),
    }
    print("\nper limit: autoplan measured speedup")
    for case in rows:
        nan = float("nan")
        print(f"  {case['model'][:40]:<40} mb {case['micro_batch']:>2} {case['limit_bytes'] / 1e6:>8.1f} MB: "
              f"vs all-shard {case.get('vs_all_shard', nan):.2f}x (best measured {case.get('best_vs_all_shard', nan):.2f}x), "
              f"vs best uniform ({case.get('best_uniform')}) {case.get('vs_best_uniform', nan):.2f}x")
    return {"cases": rows, "summary": summary}


def exhaustive(model: str) -> dict:
    """Every plan of the search space on a small model, at a limit where the solver must mix."""
    lean = plan_of(model, "100GB", EXHAUSTIVE_BATCH_SIZE, "all-shard+ckpt")["predicted"]["peak_mem_bytes"]
    full = plan_of(model, "100GB", EXHAUSTIVE_BATCH_SIZE, "all-replicate")["predicted"]["peak_mem_bytes"]
    limit = int((lean + full) / 2)
    mine = plan_of(model, limit, EXHAUSTIVE_BATCH_SIZE, "autoplan")
    base = plan_of(model, "100GB", EXHAUSTIVE_BATCH_SIZE, "all-shard")
    choices_per_unit = []
    for unit in base["units"]:
        if unit["module"] == "":
            choices_per_unit.append([("shard", False), ("replicate", False)])
        else:
            choices_per_unit.append([(s, c) for s in ("shard", "shard_keep", "replicate") for c in (False, True)])
    space = list(itertools.product(*choices_per_unit))
    plans = []
    for combo in space:
        plan = copy.deepcopy(base)
        for unit, (sharding, checkpoint) in zip(plan["units"], combo):
            unit.update(sharding=sharding, checkpoint=checkpoint, reshard_after_forward=SHARDING_KINDS[sharding].reshard_after_forward)
        plans.append(plan)
    print(f"\nexhaustive: {len(plans)} plans of {model} at limit {limit / 1e6:.1f} MB, plus autoplan's", flush=True)
    measured = execute_many(plans + [mine])
    mine_measured = measured[-1]
    mine_combo = tuple((u["sharding"], u["checkpoint"]) for u in mine["units"])
    result = {"model": model, "limit_bytes": limit, "space": len(space),
              "autoplan": {"plan": mine_combo, **mine_measured}}
    # against every plan that fits the limit, and against those that fit what the search plans to (the
    # limit less its headroom, DEFAULT_HEADROOM): autoplan leaves that margin on purpose, and in a space
    # this small one discrete memory level can sit inside it
    caps = {"limit": limit, "limit_less_headroom": limit * (1 - DEFAULT_HEADROOM)}
    finalists = {}
    for name, cap in caps.items():
        fitting = [(combo, m) for combo, m in zip(space, measured[:-1]) if m and m["peak_mem_bytes"] <= cap]
        best_combo, best = min(fitting, key=lambda cm: cm[1]["step_time_s"])
        regret = mine_measured["step_time_s"] / best["step_time_s"] - 1
        rank = 1 + sum(1 for _, m in fitting if m["step_time_s"] < mine_measured["step_time_s"])
        print(f"  within {name} ({cap / 1e6:.2f} MB): {len(fitting)} of {len(space)} plans fit (measured); best "
              f"{best_combo} {best['step_time_s'] * 1e3:.1f} ms; autoplan {mine_combo} "
              f"{mine_measured['step_time_s'] * 1e3:.1f} ms (rank {rank}); regret {100 * regret:.1f}%")
        result[name] = {"cap_bytes": cap, "fitting": len(fitting), "best": {"plan": best_combo, **best},
                        "autoplan_rank": rank, "regret": regret}
        for combo, _ in sorted(fitting, key=lambda cm: cm[1]["step_time_s"])[:CONFIRM_TOP]:
            finalists[combo] = plans[space.index(combo)]
    # The fastest of many noisy measurements is flattered by its noise (it won partly by luck), so
    # the sweep's best is measured again beside autoplan's plan, in a launch of their own
    finalists[mine_combo] = mine
    again = dict(zip(finalists, execute_many(list(finalists.values()))))
    sweep_peak = {combo: m["peak_mem_bytes"] for combo, m in zip(space, measured[:-1]) if m}
    for name, cap in caps.items():
        contenders = {combo: m for combo, m in again.items() if m is not None
                      and max(m["peak_mem_bytes"], sweep_peak.get(combo, 0)) <= cap}
        best_combo = min(contenders, key=lambda combo: contenders[combo]["step_time_s"])
        regret = again[mine_combo]["step_time_s"] / contenders[best_combo]["step_time_s"] - 1
        print(f"  measured again, within {name}: best of {len(contenders)} {best_combo} "
              f"{contenders[best_combo]['step_time_s'] * 1e3:.1f} ms; autoplan "
              f"{again[mine_combo]['step_time_s'] * 1e3:.1f} ms; regret {100 * regret:.1f}%")
        result[name]["confirmed"] = {"best": {"plan": best_combo, **contenders[best_combo]},
                                     "autoplan": again[mine_combo], "regret": regret,
                                     "finalists": [{"plan": c, **m} for c, m in again.items() if m]}
    result["all"] = [{"plan": combo, **m} for combo, m in zip(space, measured[:-1]) if m]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-exhaustive", action="store_true", help="keep the previous exhaustive results")
    parser.add_argument("--skip-quality", action="store_true", help="keep the previous per-limit results")
    args = parser.parse_args()
    previous = RESULTS / "plan_quality.json"
    results = json.loads(previous.read_text()) if previous.exists() else {}
    if not args.skip_quality:
        results["quality"] = quality(MODELS)
        print(json.dumps(results["quality"]["summary"], indent=2))
    if not args.skip_exhaustive:
        results["exhaustive"] = exhaustive(EXHAUSTIVE_MODEL)
    print(f"written to {write_results('plan_quality', results)}")


if __name__ == "__main__":
    main()
