"""Truth at real sizes: predicted vs measured peak memory of one rank of a world of 8 or 64 ranks.

Each plan is run in this process as rank 0 of its world on torch's fake process group
(autoplan.run.fake_world: `autoplan apply`'s training step and live-tensor tracker, collectives free).
Groups of runs (`--groups`, all by default):
- tiny: gpt2-tiny and llama-tiny at micro-batch 2 and 8, sequence 64, all-shard, all-shard+checkpoint and
  the solver's plan at a tight limit, worlds 8 and 64 (24 runs, a few minutes);
- gpt2: gpt2 124M with its 50,257-token vocabulary, sequence 32, all-shard, worlds 8 and 64;
- llama-1.1b: a 1.1B Llama (TinyLlama's shape: d 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, 32,000-token
  vocabulary) at sequence 64, micro-batch 1, world 8, all-shard and all-shard+checkpoint (a few GB, minutes);
- experts: moe-tiny (8 experts, top-2) at micro-batch 2 and 8, sequence 64, world 64 (8 nodes of 8), all-shard
  without expert parallelism (ep1) and all-shard (+checkpoint) with the experts split 8-way (`ep` 8: each rank's all-to-alls taken as balanced);
- long: 16,384-token sequences at micro-batch 1, checkpointed, world 8: a 4-layer llama and gpt2 of width 256
  (512-token vocabulary, so a block's activations and its recompute, not the logits, make the peak),
  all-shard+checkpoint, the solver's plan (`tpN` where it is tensor-parallel) and the solver's plan without tensor
  parallelism (`autoplan-fsdp`).
Plans are costed with the cpu-gloo-2 profile, whose own prediction counts gloo's copy of a reduce-scatter
input, which a fake group never allocates. The headline prediction (`pred MB`, `err`) is therefore the one for
the backend that runs: the same decisions on the same profile with every reduction in place (run_fake_world
does it); the plan's own prediction is `plan MB`, `plan err`. `gloo copy` is the largest unit's copy, the
most the two can differ by.

    python benchmarks/fake_world.py                     # every group (about 10 minutes on 2 cores)
    python benchmarks/fake_world.py --groups tiny       # the tiny grid only (about a minute)

Targets (issue 13): median error <= 3%, worst <= 6%, none measured over its limit.
"""

from __future__ import annotations

import argparse
import time

from common import summarize, write_results

import autoplan
from autoplan.errors import InfeasibleError
from autoplan.run.fake_world import run_fake_world

PROFILE = "cpu-gloo-2"
KINDS = {"all-shard": {"strategy": "shard", "tp": 1}, "all-shard+ckpt": {"strategy": "shard", "checkpoint": True, "tp": 1},
         "autoplan": {}, "autoplan-fsdp": {"tp": 1},  # the solver's plan; the same without tensor parallelism
         "all-shard ep1": {"strategy": "shard", "tp": 1, "ep": 1},  # mixtures of experts: FSDP alone,
         "all-shard ep8": {"strategy": "shard", "tp": 1, "ep": 8},  # and the experts split 8-way
         "all-shard+ckpt ep8": {"strategy": "shard", "checkpoint": True, "tp": 1, "ep": 8}}
TIGHT = 1.15  # the solvers' limit: 15% above the leanest plan's (all-shard+checkpoint) predicted peak
LLAMA_1B = ("llama-1b[n_layers=22,n_kv_heads=4,ffn_hidden=5632,vocab_size=32000,tie_embeddings=false,"
            "rope_theta=10000.0]")
LONG = 16384
LONG_MODELS = {f"llama-tiny[n_layers=4,d_model=256,ffn_hidden=704,max_seq_len={LONG}]": "llama 4x256",
               f"gpt2-tiny[n_layers=4,d_model=256,max_seq_len={LONG}]": "gpt2 4x256"}  # peaks in a block's recompute
LABELS = {"gpt2": "gpt2 124M", LLAMA_1B: "llama 1.1B", **LONG_MODELS}
GROUPS = ("tiny", "gpt2", "llama-1.1b", "long", "experts")


def runs_of(group: str) -> list[tuple[str, int, int, str, int]]:
    """(model, world, micro-batch, plan kind, sequence) of each run in `group`."""
    if group == "tiny":
        return [(m, w, b, k, 64) for w in (8, 64) for m in ("gpt2-tiny", "llama-tiny") for b in (2, 8)
                for k in ("all-shard", "all-shard+ckpt", "autoplan")]
    if group == "gpt2":
        return [("gpt2", w, 2, "all-shard", 32) for w in (8, 64)]
    if group == "experts":
        return [("moe-tiny", 64, b, k, 64) for b in (2, 8) for k in ("all-shard ep1", "all-shard ep8", "all-shard+ckpt ep8")]
    if group == "llama-1.1b":
        return [(LLAMA_1B, 8, 1, k, 64) for k in ("all-shard", "all-shard+ckpt")]
    return [(m, 8, 1, k, LONG) for m in LONG_MODELS for k in ("all-shard+ckpt", "autoplan", "autoplan-fsdp")]



def plan_for(model: str, world: int, batch: int, kind: str, seq_len: int):
    common = {"gpus": world, "profile": PROFILE, "seq_len": seq_len, "batch_size": batch, "allow_over_device_mem": True,
              "nodes": world // 8 if model == "moe-tiny" else None}  # the experts' groups inside nodes of 8
    if not kind.startswith("autoplan"):
        return autoplan.search(model, "100GB", **common, **KINDS[kind])
    lean = autoplan.search(model, "100GB", **common, **KINDS["all-shard+ckpt"]).predicted.peak_mem_bytes
    return autoplan.search(model, int(lean * TIGHT), **common, **KINDS[kind])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help=f"comma-separated groups of runs, of {', '.join(GROUPS)} (default: all)")
    args = parser.parse_args()
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        parser.error(f"--groups: unknown group(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(GROUPS)}")
    runs = [run for group in GROUPS if group in groups for run in runs_of(group)]
    header = (f"{'model':<12} {'world':>5} {'mb':>3} {'seq':>6} {'plan':<15} {'pred MB':>10} {'meas MB':>10} "
              f"{'err':>7} {'plan MB':>10} {'plan err':>8} {'gloo copy MB':>12} {'limit MB':>9} "
              f"{'compute pred ms':>15} {'meas ms':>9} {'run s':>6}")
    print(header)
    rows = []
    for model, world, batch, kind, seq_len in runs:
        label = LABELS.get(model, model)
        try:
            plan = plan_for(model, world, batch, kind, seq_len)
        except InfeasibleError as exc:
            print(f"{label:<12} {world:>5} {batch:>3} {seq_len:>6} {kind:<15} no plan: {exc}")
            continue
        if plan.cluster.tp_degree > 1:
            kind += f" tp{plan.cluster.tp_degree}"
        big = plan.model.n_params > 50_000_000 or seq_len > 1024  # memory is deterministic: one measured step
        started = time.perf_counter()
        r = run_fake_world(plan, steps=1 if big else 2, warmup=1)
        run_s = time.perf_counter() - started
        rows.append({"model": label, "spec": model, "world_size": world, "micro_batch": batch, "kind": kind,
                     "seq_len": seq_len, "tp_degree": plan.cluster.tp_degree, "predicted_peak_bytes": r.predicted_peak_bytes,
                     "measured_peak_bytes": r.measured_peak_bytes, "mem_error": r.error,
                     "plan_predicted_peak_bytes": r.plan_predicted_peak_bytes, "plan_error": r.plan_error,
                     "prediction_basis": r.prediction_basis, "gloo_copy_bytes": r.gloo_copy_bytes,
                     "mem_limit_bytes": r.mem_limit_bytes, "over_limit": r.measured_peak_bytes > r.mem_limit_bytes,
                     "predicted_phases": r.predicted_phase_bytes, "measured_phases": r.measured_phase_bytes,
                     "predicted_peak_point": r.predicted_peak_point, "decisions": [
                         f"{u.module or '<root>'}: {u.label}" for u in plan.units],
                     "predicted_compute_s": r.predicted_compute_s, "measured_compute_s": r.measured_compute_s,
                     "run_s": run_s})
        print(f"{label:<12} {world:>5} {batch:>3} {seq_len:>6} {kind:<15} {r.predicted_peak_bytes / 1e6:>10.3f} "
              f"{r.measured_peak_bytes / 1e6:>10.3f} {100 * r.error:>6.1f}% {r.plan_predicted_peak_bytes / 1e6:>10.3f} "
              f"{100 * r.plan_error:>7.1f}% {r.gloo_copy_bytes / 1e6:>12.3f} {r.mem_limit_bytes / 1e6:>9.1f} "
              f"{r.predicted_compute_s * 1e3:>15.1f} {r.measured_compute_s * 1e3:>9.1f} {run_s:>6.0f}", flush=True)
    median, worst = summarize([row["mem_error"] for row in rows])
    plan_median, plan_worst = summarize([row["plan_error"] for row in rows])
    over = sum(row["over_limit"] for row in rows)
    print(f"\n{len(rows)} runs: against the prediction for the backend that ran (reductions in place) median "
          f"|error| {100 * median:.1f}%, worst {100 * worst:.1f}%; against the plans' own {PROFILE} prediction "
          f"(gloo's copy counted) median {100 * plan_median:.1f}%, worst {100 * plan_worst:.1f}%; {over} measured "
          "over the limit (targets: 3%, 6%, none)")
    summary = {"n": len(rows), "groups": groups, "mem_median": median, "mem_worst": worst,
               "plan_median": plan_median, "plan_worst": plan_worst, "over_limit": over}
    name = "fake_world" + ("" if set(groups) == set(GROUPS) else "_" + "_".join(g.replace(".", "") for g in groups))
    path = write_results(name, {"rows": rows, "summary": summary})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
