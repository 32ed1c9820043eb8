"""Pipeline rows of the fidelity benchmarks: per stage, the plan's predicted peak (StageSpec.peak_mem_bytes,
from the search's pipeline pricing) beside the peak its ranks measured.

- gloo (`python benchmarks/fidelity.py --pipeline`): searched plans of 2 pipeline ranks x 2 data-parallel
  ranks (`--gpus 4 --pp 2 --schedule S`) run by `autoplan apply` on 4 gloo ranks (torch.distributed.pipelining's
  schedule, FSDP2 inside each stage); each pipeline rank's row is the largest peak of its two ranks;
- fake (`python benchmarks/fake_world.py --groups pipeline`): searched plans of a 64-rank world (8 nodes of 8)
  cut into pipeline stages; one rank of each pipeline rank run alone on the fake process group
  (autoplan.run.fake_world, FakeWorldOptions.rank), the busiest stage being the one of largest measured peak;
  then the run itself cross-checked: the first case's model planned for 2 x 2 ranks and run both on 4 gloo
  ranks and, one rank of each stage, on a 4-rank fake group (`cross_check`: the two measurements side by side).

Target (issue 28): per-stage memory within 3% (median) of measured, as for the other rows.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from common import PROFILE, cli, rel_error

import autoplan
from autoplan.run.fake_world import FakeWorldOptions, run_fake_world

# (model, schedule, micro-batch, global batch, sequence)
GLOO_CASES = [
    ("llama-tiny[n_layers=4,d_model=128,n_heads=4,n_kv_heads=2,ffn_hidden=352]", schedule, 4, 32, 128)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
] + [("gpt2-tiny[n_layers=4,d_model=128,tie_embeddings=false]", schedule, 4, 32, 128) for schedule in ("gpipe", "1f1b")]
# (model, pipeline degree, schedule, micro-batch, global batch, sequence), on 8 nodes of 8
FAKE_CASES = [
    ("llama-tiny[n_layers=8,d_model=256,n_heads=4,n_kv_heads=2,ffn_hidden=704]", pp, schedule, 2, 256, 64)
    for pp, schedule in ((2, "1f1b"), (2, "gpipe"), (4, "1f1b"), (8, "1f1b"))
]
HEADER = f"{'model':<44} {'schedule':<17} {'pp':>3} {'stage(s)':<9} {'pred MB':>9} {'meas MB':>9} {'err':>7}"


def _row(model: str, schedule: str, pp: int, stages: list[int], predicted: int, measured: int, **extra) -> dict:
    row = {"model": model, "schedule": schedule, "pp": pp, "stages": stages, "predicted_peak_bytes": predicted,
           "measured_peak_bytes": measured, "mem_error": rel_error(predicted, measured), **extra}
    print(f"{model[:44]:<44} {schedule:<17} {pp:>3} {','.join(map(str, stages)):<9} {predicted / 1e6:>9.3f} "
          f"{measured / 1e6:>9.3f} {100 * row['mem_error']:>6.1f}%", flush=True)
    return row


def gloo_rows(cases=GLOO_CASES, steps: int = 3) -> list[dict]:
    """Each case searched for 2 x 2 ranks and run on 4 gloo ranks: one row per pipeline rank."""
    rows = []
    for model, schedule, batch, global_batch, seq_len in cases:
        plan = autoplan.search(model, "100GB", gpus=4, pp=2, tp=1, schedule=schedule, profile=PROFILE, seq_len=seq_len,
                               batch_size=batch, global_batch=global_batch, allow_over_device_mem=True)
        with tempfile.TemporaryDirectory() as scratch:
            plan_path, report_path = Path(scratch) / "plan.json", Path(scratch) / "report.json"
            plan.save(plan_path)
            proc = cli("apply", str(plan_path), "--steps", str(steps), "--warmup", "1", "--report", str(report_path))
            if proc.returncode != 0:
                print(f"{model[:44]:<44} {schedule:<17} FAILED: {proc.stderr[-400:]}", flush=True)
                continue
            report = json.loads(report_path.read_text())
        for stage in report["stages"]:
            rows.append(_row(model, schedule, 2, stage["stages"], stage["predicted_peak_bytes"],
                             stage["measured_peak_bytes"], microbatches=plan.pipeline.microbatches,
                             micro_batch=batch, ranks=stage["ranks"]))
    return rows


def fake_rows(cases=FAKE_CASES) -> list[dict]:
    """Each case searched for 64 ranks; one rank of every pipeline rank run on the fake process group."""
    rows = []
    for model, pp, schedule, batch, global_batch, seq_len in cases:
        plan = autoplan.search(model, "100GB", gpus=64, nodes=8, pp=pp, tp=1, schedule=schedule, profile=PROFILE,
                               seq_len=seq_len, batch_size=batch, global_batch=global_batch, allow_over_device_mem=True)
        mine = []
        for rank in range(pp):
            started = time.perf_counter()
            result = run_fake_world(plan, steps=1, warmup=1, options=FakeWorldOptions(rank=rank * 64 // pp))
            stages = [i for i, stage in enumerate(plan.pipeline.stages) if stage.rank == rank]
            mine.append(_row(model, schedule, pp, stages, result.predicted_peak_bytes, result.measured_peak_bytes,
                             rank=result.rank, microbatches=plan.pipeline.microbatches, micro_batch=batch,
                             run_s=time.perf_counter() - started))
        busiest = max(mine, key=lambda row: row["measured_peak_bytes"])
        busiest["busiest"] = True
        print(f"  busiest: stage(s) {busiest['stages']}, {busiest['measured_peak_bytes'] / 1e6:.3f} MB measured", flush=True)
        rows += mine
    return rows


def cross_check() -> list[dict]:
    """FAKE_CASES[0]'s model planned for 2 x 2 ranks (seq, micro-batch as there), run on 4 gloo ranks and, one
    rank per stage, on a fake group of 4: whether a fake-world stage measures what a real rank measures."""
    model, _, schedule, batch, _, seq_len = FAKE_CASES[0]
    rows = gloo_rows([(model, schedule, batch, 8 * batch, seq_len)], steps=2)
    plan = autoplan.search(model, "100GB", gpus=4, pp=2, tp=1, schedule=schedule, profile=PROFILE, seq_len=seq_len,
                           batch_size=batch, global_batch=8 * batch, allow_over_device_mem=True)
    for row in rows:
        result = run_fake_world(plan, steps=1, warmup=1, options=FakeWorldOptions(rank=row["ranks"][0]))
        row["fake_measured_peak_bytes"] = result.measured_peak_bytes
        print(f"  stage(s) {row['stages']}: gloo {row['measured_peak_bytes'] / 1e6:.3f} MB, fake group "
              f"{result.measured_peak_bytes / 1e6:.3f} MB", flush=True)
    return rows
