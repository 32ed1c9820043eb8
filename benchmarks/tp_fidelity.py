"""Fidelity of tensor-parallel plans: predicted against measured on this machine (CPU, gloo, 2 ranks, the
cpu-gloo-2 profile). Each plan has TP degree 2 (a 1 x 2 mesh: both ranks one tensor-parallel group),
with and without sequence parallelism, uniform or from the solver; an FSDP-only plan (TP 1) of the same
model and micro-batch runs beside them. They run with `autoplan apply`'s training loop and measurement
(multi_worker.py), all plans of a model and micro-batch in one launch, in three rounds one after the
other, each plan keeping its fastest round (as benchmarks/fidelity.py does).

    python benchmarks/tp_fidelity.py            # the grid (~5 min on 2 cores)
    python benchmarks/tp_fidelity.py --quick    # one micro-batch

Targets (issue 5's, for the FSDP plans): memory error at most 5% median and 10% worst; step time 10%
median, 20% worst.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from common import compared, compared_text, execute_many, group_summary, make_plan, summary_text, write_results

MODELS = ["llama-tiny[n_layers=4,d_model=128,n_heads=4,n_kv_heads=2,ffn_hidden=352]"]
MICRO_BATCHES = [4, 16]
SEQ_LEN = 128
# (label, uniform plan kind of benchmarks/common.py or "autoplan", extra search flags)
PLANS = [
    ("tp1 all-shard", "all-shard", ["--tp", "1"]),
    ("tp2 all-shard", "all-shard", ["--tp", "2", "--sequence-parallel", "off"]),
    ("tp2+sp all-shard", "all-shard", ["--tp", "2", "--sequence-parallel", "on"]),
    ("tp2 all-shard+ckpt", "all-shard+ckpt", ["--tp", "2", "--sequence-parallel", "off"]),
    ("tp2+sp all-shard+ckpt", "all-shard+ckpt", ["--tp", "2", "--sequence-parallel", "on"]),
    ("tp2+sp all-shard_keep", "all-shard_keep", ["--tp", "2", "--sequence-parallel", "on"]),
    ("tp2+sp autoplan", "autoplan", ["--tp", "2", "--sequence-parallel", "on"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one micro-batch")
    args = parser.parse_args()
    batches = MICRO_BATCHES[:1] if args.quick else MICRO_BATCHES
    rows = []
    print(f"{'model':<24} {'mb':>3} {'plan':<22} {'peak pred MB':>12} {'meas MB':>9} {'err':>7} "
          f"{'step pred ms':>12} {'meas ms':>9} {'err':>7}")
    for model in MODELS:
        for batch_size in batches:
            plans = [make_plan(model, "100GB", batch_size, SEQ_LEN, kind, extra) for _, kind, extra in PLANS]
            for (label, _, _), plan, measured in zip(PLANS, plans, execute_many(plans)):
                short = model.split("[")[0]
                if measured is None:
                    print(f"{short:<24} {batch_size:>3} {label:<22} FAILED")
                    continue
                row = dict(model=model, micro_batch=batch_size, plan=label,
                           tp_degree=plan["cluster"].get("tp_degree", 1),
                           sequence_parallel=plan["cluster"].get("sequence_parallel", False),
                           **compared(plan, measured))
                rows.append(row)
                print(f"{short:<24} {batch_size:>3} {label:<22} {compared_text(row, mb_digits=2)}", flush=True)

    groups = defaultdict(list)
    for row in rows:
        groups["tp1" if row["tp_degree"] == 1 else "tp2+sp" if row["sequence_parallel"] else "tp2"].append(row)
    print(f"\n{'group':<10} {'n':>3} {'mem median':>11} {'mem worst':>10} {'time median':>12} {'time worst':>11}")
    summary = {}
    tp_rows = [r for r in rows if r["tp_degree"] > 1]
    for name, group in list(groups.items()) + [("all tp2", tp_rows)]:
        if not group:
            continue
        summary[name] = dict(group_summary(group), mem_bias=statistics.median(r["mem_error"] for r in group),
                             time_bias=statistics.median(r["time_error"] for r in group))
        print(summary_text(name, 10, summary[name]))
    path = write_results("tp_fidelity" + ("_partial" if args.quick else ""), {"rows": rows, "summary": summary})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
