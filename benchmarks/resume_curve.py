"""A loss curve across a checkpoint and a change of plan: `autoplan apply --save` under one plan, `--resume`
under others, beside a run that never stopped (issue 27).

    python benchmarks/resume_curve.py              # about 2 minutes here: 5 runs of 2 (or 1) gloo ranks

Plans for llama-tiny at 64 tokens, searched on this machine's profile: A (2 ranks, the root and blocks pinned
to shard, the blocks with selective checkpointing), B (2 ranks, the root replicated, the blocks shard_keep with
full checkpointing), C (1 rank, the search's own, 2 micro-batches accumulated: the same 8 samples per step). The uninterrupted run trains 6 steps under A; the interrupted one trains 3 under A
and saves, then 3 more under B, and again under C, each from the step-3 checkpoint (resharded by DCP for its
plan). Text in an Alpaca file (byte tokens), which the model learns from, so that a resumed run that started
afresh would show. Prints the losses and the largest relative difference from the uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import autoplan

REPO = Path(__file__).resolve().parents[1]
COMMON = dict(gpus=2, seq_len=64, global_batch=8, profile="cpu-gloo-2")


def _apply(plan: Path, report: Path, data: Path, *flags: str) -> list[float]:
    subprocess.run([sys.executable, "-m", "autoplan", "apply", str(plan), "--warmup", "0", "--lr", "0.01", "--data",
                    str(data), "--report", str(report), *flags], check=True, capture_output=True, text=True)
    return json.loads(report.read_text())["measured"]["losses"]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="resume-curve-") as scratch:
        folder = Path(scratch)
        data = folder / "alpaca.json"
        data.write_text(json.dumps([{"instruction": f"Say {w} {i} times.", "input": "",
                                     "output": " ".join([w] * (i % 7 + 1))}
                                    for i, w in enumerate(["sharding", "plan", "memory", "checkpoint"] * 20)]))
        plans = {
            "A": autoplan.search("llama-tiny", "40MB", tp=1, pin=["layers.*=shard+sel", "<root>=shard"], **COMMON),
            "B": autoplan.search("llama-tiny", "40MB", tp=1, pin=["layers.*=shard_keep+ckpt", "<root>=replicate"],
                                 **COMMON),
            "C": autoplan.search("llama-tiny", "40MB", **{**COMMON, "gpus": 1}, batch_size=4),
        }
        for name, plan in plans.items():
            plan.save(folder / f"{name}.json")
            units = ", ".join(f"{u.module or '<root>'} {u.label.replace(' ', '')}" for u in plan.units)
            print(f"plan {name}: {plan.cluster.world_size} rank(s), micro-batch {plan.training.micro_batch_size} x "
                  f"{plan.training.grad_accum_steps}; {units}")
        whole = _apply(folder / "A.json", folder / "whole.json", data, "--steps", "6")
        first = _apply(folder / "A.json", folder / "first.json", data, "--steps", "3", "--save", str(folder / "ck"),
                       "--save-every", "3")
        print(f"\n{'run':<34} " + " ".join(f"{'step ' + str(i):>9}" for i in range(1, 7)) + "   max rel. diff")
        print(f"{'A, uninterrupted':<34} " + " ".join(f"{x:>9.5f}" for x in whole))
        print(f"{'A, steps 1-3, saved':<34} " + " ".join(f"{x:>9.5f}" for x in first) + " " * 30
              + f"   {max(abs(a - b) / b for a, b in zip(first, whole)):.1e}")
        for name in ("B", "C"):
            resumed = _apply(folder / f"{name}.json", folder / f"{name}-resumed.json", data, "--steps", "3",
                             "--resume", str(folder / "ck" / "step-3"))
            worst = max(abs(a - b) / b for a, b in zip(resumed, whole[3:]))
            print(f"{'resumed at 3 under ' + name:<34} " + " " * 30 + " ".join(f"{x:>9.5f}" for x in resumed)
                  + f"   {worst:.1e}")


if __name__ == "__main__":
    main()
