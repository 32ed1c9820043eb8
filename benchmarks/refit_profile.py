"""A measured GPU profile refitted here, from its own records, the way `autoplan profile` now fits one: what the
backward-floor and fit-reach changes would have made of the measurements, checked against the runs the GPU kit
measured with the profile as it was.

A measured profile holds every op's median times (op_times) and every calibration step's measured phases
(fsdp.calibration.cases). From them, on a machine without a GPU:
  1. each backward time less the backward call's floor (autoplan.profiling.ops.backward_floor_s; the profile
     did not record it, so it is estimated as the least backward time of any op less MIN_KERNEL_S, or given);
  2. the op families fitted again (autoplan.profiling.fit.fit_op_families), each fit with its reach (max_work);
  3. the calibration fitted again against the refitted profile (autoplan.profiling.calibration_fit.fit_calibration).
Then the kit's single-GPU runs and fake-world rows are predicted with the profile as measured and as refitted,
beside what the GPU measured (benchmarks/results/gpu_truth_cuda/gpu_truth.json).

    python benchmarks/refit_profile.py benchmarks/results/gpu_truth_cuda/nvidia-h200-measured.json \
        --kit benchmarks/results/gpu_truth_cuda/gpu_truth.json --out /tmp/h200-refit.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def refit(profile, floor_s: float | None):
    """`profile` refitted from its own op times and calibration cases; the floor taken off its backward times."""
    from autoplan.profiling.calibration import case_key
    from autoplan.profiling.calibration_fit import fit_calibration
    from autoplan.profiling.fit import fit_op_families
    from autoplan.profiling.op_timings import points_and_timings
    from autoplan.profiling.ops import MIN_KERNEL_S
    from autoplan.profiling.run import ProfileSettings, op_cases
    from cost_models.profile import FsdpOverhead

    backward = [t.bwd_s for t in profile.op_times if t.bwd_s > 0]
    floor_s = min(backward) - MIN_KERNEL_S if floor_s is None else floor_s
    seconds = {t.key: {"fwd_s": t.fwd_s or None,
                       "bwd_s": max(MIN_KERNEL_S, t.bwd_s - floor_s) if t.bwd_s > 0 else None}
               for t in profile.op_times}
    settings = profile.provenance.settings
    models = {spec.split("@mb")[0]: tuple(int(b) for b in spec.split("@mb")[1].split(","))
              for spec in settings["models"].split(";")}
    cases = [case for case in op_cases(ProfileSettings(device="cuda", models=models,
                                                        dtypes=tuple(settings["dtypes"].split(","))), "cuda")
             if case.key in seconds]
    points, op_times = points_and_timings(cases, seconds)
    fits = [report.fit for report in fit_op_families(points, None)]
    bare = profile.model_copy(update={"op_times": op_times, "op_fits": fits, "fsdp": FsdpOverhead()})
    measured = {case_key(c["strategy"], c["checkpoint"], c["depth"], c["micro_batch"]): c["measured"]
                for c in profile.fsdp.calibration["cases"]}
    calibration = fit_calibration(bare, measured, profile.provenance.settings["nproc"])
    fitted = {name: calibration[name] for name in FsdpOverhead.model_fields if name != "calibration"}
    refitted = bare.model_copy(update={"fsdp": FsdpOverhead(**fitted, calibration=calibration)})
    return refitted, floor_s, len(cases), len(profile.op_times)


def single_gpu_plan(model: str, seq_len: int, batch: int, profile_path: str):
    """The kit's single-GPU plan: the search `autoplan apply` ran (benchmarks/gpu_truth.py stage_compute)."""
    import autoplan

    return autoplan.search(model, "10000GB", gpus=1, profile=profile_path, seq_len=seq_len, batch_size=batch,
                           allow_over_device_mem=True)


def priced(plan, profile: str):
    """`plan`'s decisions costed with another profile."""
    import autoplan

    return autoplan.estimate(plan=plan, profile=profile, allow_over_device_mem=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--kit", type=Path, help="the GPU kit's gpu_truth.json to predict the runs of")
    parser.add_argument("--floor-us", type=float, help="the backward call's floor (default: estimated)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/refit-profile.json"))
    parser.add_argument("--datasheet", default="h200-sxm-141gb", help="the shipped profile to price beside them")
    args = parser.parse_args(argv)
    from autoplan.profile_store import load_profile, save_profile
    from autoplan.api.inspect import plan_table
    from autoplan.run.fake_world_prediction import predicted_compute_s
    from autoplan.plan.schema import Plan

    profile = load_profile(str(args.profile))
    refitted, floor_s, matched, timings = refit(profile, None if args.floor_us is None else args.floor_us * 1e-6)
    save_profile(refitted.model_copy(update={"name": profile.name + "-refit"}), args.out)
    print(f"{args.profile.name}: {matched} of {timings} op timings matched to their ops; backward floor "
          f"{floor_s * 1e6:.1f} us taken off")
    for label, p in (("as measured", profile), ("refitted", refitted)):
        f = p.fsdp
        print(f"  {label:12s} calibration: fwd x{f.compute_fwd_scale:.3f}, bwd x{f.compute_bwd_scale:.3f}, "
              f"recompute x{f.compute_recompute_scale or 0:.3f}, unit {f.unit_fwd_s * 1e3:.2f}/{f.unit_bwd_s * 1e3:.2f}"
              f" ms; worst fit error {f.calibration['fit_max_rel_err']}")
    if args.kit is None:
        return 0
    kit = json.loads(args.kit.read_text())
    profiles = {"as measured": str(args.profile), "refitted": str(args.out), "datasheet": args.datasheet}
    print("\nsingle-GPU runs, step ms: measured | " + " | ".join(profiles))
    for row in kit["stages"].get("compute", {}).get("rows", []):
        if row.get("measured_step_s"):
            plan = single_gpu_plan(row["model"], row["seq_len"], row["micro_batch"], str(args.profile))
            steps = [priced(plan, p).predicted.step_time_s for p in profiles.values()]
            label = f"{row['model']} s{row['seq_len']} mb{row['micro_batch']}"
            print(f"  {label:22s} " + _figures(row["measured_step_s"], steps))
    plans_file = args.kit.parent / "plans.json"
    plans = json.loads(plans_file.read_text()) if plans_file.is_file() else {}
    rows = [r for r in kit["stages"].get("grid", {}).get("rows", [])
            if r.get("status") == "ok" and r.get("plan_key") in plans]
    if rows:
        print("\nfake-world compute (collectives free), ms: measured | " + " | ".join(profiles))
    for row in rows:
        plan = Plan.model_validate(plans[row["plan_key"]])
        costed = [plan_table(plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"profile": p})}))
                  for p in profiles.values()]  # its cost table on each profile: FSDP2's per-unit overhead counted
        print(f"  {row['plan_key']:36s} " + _figures(row["measured_compute_s"],
                                                     [predicted_compute_s(*c) for c in costed]))
    return 0


def _figures(measured: float, predicted: list[float]) -> str:
    return f"{measured * 1e3:8.1f} | " + " | ".join(f"{p * 1e3:8.1f} ({p / measured - 1:+5.0%})" for p in predicted)


if __name__ == "__main__":
    raise SystemExit(main())
