"""autoplan's predicted peak beside torch's FSDPMemTracker, for rank 0 of an 8-rank world, at real sizes.

torch's tracker (torch.distributed._tools.fsdp2_mem_tracker) is an independent account of what FSDP2,
autograd and the optimizer allocate. It runs here on fake tensors and a fake process group (see
autoplan/run/torch_tracker.py), so 7B-class models are tracked in seconds without a GPU. Nine
configurations: llama2-7b and gpt2-xl truncated to 4 to 48 layers, all-shard, with and without activation
checkpointing, at sequence 1024; and llama2-7b (32 layers) at 16,384 tokens, micro-batch 1, with full and with
selective checkpointing, where long sequences make activations and the logits the bulk of the peak. Costed with
the H100 profile (bf16-mixed, AdamW, its foreach step as on CUDA).

    python benchmarks/memtracker.py                # the nine configurations
    python benchmarks/memtracker.py --long-only    # the two at 16,384 tokens
    python benchmarks/memtracker.py --hold-logits  # the step as `out = model(x); loss = f(out, y)` writes it

Target (issue 13): the predicted peak within 1-2% of the tracker's. With --hold-logits the tracker is above
the prediction by one micro-batch of bf16 logits (the caller's reference to the model's output keeps it
through the backward; `autoplan apply` frees it), which the `+logits` column shows in units of that tensor.
"""

from __future__ import annotations

import argparse
import time

from common import summarize, write_results

import autoplan
from autoplan.run.torch_tracker import track_plan

PROFILE = "h100-sxm-80gb"
WORLD = 8
LONG = 16384
# (model, layers, checkpoint mode, micro-batch, sequence)
CONFIGS = [
    ("llama2-7b", 4, "none", 2, 1024),
    ("llama2-7b", 4, "full", 8, 1024),
    ("llama2-7b", 32, "none", 1, 1024),
    ("llama2-7b", 32, "full", 4, 1024),
    ("gpt2-xl", 4, "none", 8, 1024),
    ("gpt2-xl", 48, "none", 2, 1024),
    ("gpt2-xl", 48, "full", 8, 1024),
    ("llama2-7b", 32, "full", 1, LONG),
    ("llama2-7b", 32, "selective", 1, LONG),
]


def plan_for(model: str, layers: int, checkpoint: str, batch: int, seq_len: int):
    context = f",max_seq_len={seq_len}" if seq_len == LONG else ""  # beyond llama2's 4096: its RoPE tables grow
    return autoplan.search(f"{model}[n_layers={layers}{context}]", "1000GB", gpus=WORLD, profile=PROFILE,
                           seq_len=seq_len, batch_size=batch, strategy="shard", checkpoint=checkpoint, tp=1,
                           allow_over_device_mem=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hold-logits", action="store_true", help="keep the model's output alive through backward")
    parser.add_argument("--long-only", action="store_true", help=f"only the configurations at {LONG:,} tokens")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if c[4] == LONG] if args.long_only else CONFIGS
    mib = 2 ** 20
    print(f"{'model':<22} {'ckpt':>4} {'mb':>3} {'seq':>6} {'phase':<9} {'pred MiB':>9} {'tracker MiB':>11} "
          f"{'err':>7} {'+logits':>8}")
    rows = []
    for model, layers, checkpoint, batch, seq_len in configs:
        started = time.perf_counter()
        r = track_plan(plan_for(model, layers, checkpoint, batch, seq_len), hold_logits=args.hold_logits)
        label = f"{model}[{layers} layers]"
        for phase in r.predicted_phase_bytes:
            predicted, tracked = r.predicted_phase_bytes[phase], r.tracked_phase_bytes[phase]
            print(f"{label:<22} {checkpoint[:4]:>4} {batch:>3} {seq_len:>6} {phase:<9} "
                  f"{predicted / mib:>9.1f} {tracked / mib:>11.1f} {100 * (predicted - tracked) / tracked:>6.2f}% "
                  f"{(tracked - predicted) / r.logits_bytes:>8.2f}")
        print(f"{label:<22} {'':>4} {'':>3} {'':>6} {'peak':<9} {r.predicted_peak_bytes / mib:>9.1f} "
              f"{r.tracked_peak_bytes / mib:>11.1f} {100 * r.error:>6.2f}%   ({time.perf_counter() - started:.0f} s; "
              f"buffers, not predicted: {r.buffer_bytes / mib:.1f}; "
              f"tracker at its peak: " + ", ".join(f"{k} {v / mib:.0f}" for k, v in r.tracked_categories.items())
              + ")", flush=True)
        rows.append({"model": model, "layers": layers, "checkpoint": checkpoint, "micro_batch": batch,
                     "seq_len": seq_len, "hold_logits": args.hold_logits,
                     "predicted_phases": r.predicted_phase_bytes, "tracked_phases": r.tracked_phase_bytes,
                     "tracked_categories": r.tracked_categories, "buffer_bytes": r.buffer_bytes, "logits_bytes": r.logits_bytes,
                     "predicted_peak_bytes": r.predicted_peak_bytes, "tracked_peak_bytes": r.tracked_peak_bytes,
                     "error": r.error})
    median, worst = summarize([row["error"] for row in rows])
    print(f"\n{len(rows)} configurations: peak |error| median {100 * median:.2f}%, worst {100 * worst:.2f}% "
          "(target: within 1-2%)")
    path = write_results("memtracker" + ("_hold_logits" if args.hold_logits else "") + ("_long" if args.long_only else ""),
                         {"rows": rows, "summary": {"median": median, "worst": worst}})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
