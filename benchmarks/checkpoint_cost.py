"""What each checkpoint mode costs a transformer block, measured on this machine beside what the step model
predicts for the same block.

Why: on an H200 the GPU kit's plans that mix checkpoint modes ran 5-36% slower than predicted (median -25%) where
uniform plans of the same models ran -36% to +16% (median -14%), and llama2-7b's autoplan plan at micro-batch 2,
mostly selectively checkpointed, took 493 ms where every block fully checkpointed took 373 (predicted 314 and 352;
benchmarks/RESULTS.md section 9, fifth run). The step model prices selective recomputation by the kernels it
re-runs; torch's selective checkpoint (`create_selective_checkpoint_contexts`) also runs a Python dispatch mode on
every op of the block's forward and of its recompute, which a fast GPU can wait on. This times forward + backward
of `--blocks` blocks of the model, no FSDP, under each mode as `autoplan apply` sets it (autoplan.run.ac.apply_ac),
and again with one block, so that the embedding and the head drop out: per block, the time over no checkpointing.

    python benchmarks/checkpoint_cost.py --tiny                      # here: the host's cost alone (llama-tiny's
                                                                     # shapes; the kernels cost next to nothing)
    python benchmarks/checkpoint_cost.py --device cuda --model llama2-7b --seq-len 1024 --batch 2 \\
        --profile h200-sxm-141gb                                     # on a GPU, beside the profile's prediction

Prints per mode the measured ms per block and, with `--profile`, what the step model gives the same block
(`autoplan estimate --strategy shard --checkpoint MODE`: a block unit's forward + backward). Writes
results/checkpoint_cost_<device>.json (or --out). On a GPU machine, as the kit runs:

    run(command="cd benchmarks && python3 checkpoint_cost.py --device cuda --model llama2-7b --seq-len 1024
        --batch 2 --profile h200-sxm-141gb --out $OUT/checkpoint_cost", carry=["benchmarks/wheels"], timeout_s=180)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("none", "selective", "full")


def block_seconds(model_name: str, blocks: int, mode: str, batch: int, seq_len: int, device: str, reps: int) -> float:
    """Median seconds of forward + backward (the loss a sum of the logits) of `model_name` with `blocks` blocks,
    every block checkpointed as `mode`, parameters in bf16 on a GPU (fp32 on the CPU)."""
    from autoplan.models.config import get_config
    from autoplan.models.zoo import build_model
    from autoplan.run.ac import apply_ac
    from autoplan.run.data import vocab_size_of
    from cost_models.options import CHECKPOINT_MODES

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(get_config(model_name, n_layers=blocks), device=device).to(dtype)
    layers = (getattr(model, "layers", None) or getattr(model, "blocks", None)
              or getattr(getattr(model, "transformer", None), "h", None))
    if layers is None:
        raise SystemExit(f"{model_name}: no .layers, .blocks or .transformer.h to checkpoint")
    for layer in layers:
        apply_ac(layer, CHECKPOINT_MODES[mode])
    ids = torch.randint(0, vocab_size_of(model), (batch, seq_len), device=device)
    times = []
    for rep in range(reps + 3):  # three warm-ups
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        out = model(ids)
        (out.logits if hasattr(out, "logits") else out).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if rep >= 3:
            times.append(time.perf_counter() - began)
        model.zero_grad(set_to_none=True)
    del model
    return statistics.median(times)


def predicted_block_s(model_name: str, mode: str, batch: int, seq_len: int, profile: str) -> float:
    """The step model's forward + backward of one block unit of `model_name` checkpointed as `mode` (the
    estimate of every unit sharded, 8 GPUs), seconds: its ops, its recompute and, selectively checkpointed,
    what the profile charges its ops for the policy's dispatch mode (FsdpOverhead.selective_*_s_per_op; in the
    unit's overhead, with FSDP2's own, which a block timed without FSDP does not pay)."""
    import autoplan
    from autoplan.api.traced import TracedModel
    from cost_models.option_cost import working_ops
    from cost_models.options import CHECKPOINT_MODES, PRECISIONS

    traced = TracedModel(model_name, seq_len=seq_len)  # traced once: the estimate's and the block's ops below
    estimate = autoplan.estimate(traced, "shard", checkpoint=mode, profile=profile, batch_size=batch, gpus=8)
    blocks = [u for u in estimate.units if u.module.split(".")[-1].isdigit()]
    unit = blocks[len(blocks) // 2]
    seconds = unit.predicted.fwd_s + unit.predicted.bwd_s
    fsdp = autoplan.load_profile(profile).fsdp
    per_op = fsdp.selective_fwd_s_per_op + fsdp.selective_bwd_s_per_op
    if not CHECKPOINT_MODES[mode].recompute.keeps_outputs or not per_op:
        return seconds
    tables = traced.cache(PRECISIONS[estimate.training.dtype].compute_dtype, "block")
    ops = {op.name: op for op in tables.trace_1.ops}
    [block] = [u for u in tables.units if u.path == unit.module]
    return seconds + per_op * working_ops([ops[name] for name in block.ops])


def mode_row(model_name: str, mode: str, blocks: int, batch: int, seq_len: int, device: str, reps: int,
             profile: str | None = None) -> dict:
    """`mode`'s seconds per block (`blocks` blocks timed against one, so the embedding and the head drop out), the
    two timings, and with `profile` the step model's figure for the same block."""
    many = block_seconds(model_name, blocks, mode, batch, seq_len, device, reps)
    one = block_seconds(model_name, 1, mode, batch, seq_len, device, reps)
    row = {"mode": mode, "per_block_s": (many - one) / (blocks - 1), "model_s": many, "one_block_model_s": one}
    if profile:
        row["predicted_block_s"] = predicted_block_s(model_name, mode, batch, seq_len, profile)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--blocks", type=int, default=4, help="blocks in the timed model (default 4)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true",
                        help="llama-tiny's shapes at 16 tokens: what the checkpointing costs the host alone")
    parser.add_argument("--profile", help="a profile to predict the same block with (name or path)")
    parser.add_argument("--out", help="results file name under benchmarks/results (default checkpoint_cost_<device>)")
    args = parser.parse_args()
    from gpu_truth import ensure_packages

    print(f"packages: {ensure_packages()}")  # a GPU machine may lack pydantic and ortools: the carried wheels
    from common import write_results

    if args.blocks < 2:
        parser.error("--blocks must be at least 2 (one block's time is taken off)")
    model, batch, seq = ("llama-tiny", 1, 16) if args.tiny else (args.model, args.batch, args.seq_len)
    rows = [mode_row(model, mode, args.blocks, batch, seq, args.device, args.reps, args.profile) for mode in MODES]
    none = rows[0]["per_block_s"]
    print(f"{model}, micro-batch {batch} x {seq} tokens, {args.device}, {args.blocks} blocks against 1, median of "
          f"{args.reps}:")
    for row in rows:
        predicted = row.get("predicted_block_s")
        print(f"  {row['mode']:<10} {row['per_block_s'] * 1e3:8.3f} ms per block ({row['per_block_s'] / none:.2f} x "
              f"none)" + (f"; predicted {predicted * 1e3:.3f} ms ({row['per_block_s'] / predicted - 1:+.0%} measured)"
                          if predicted else ""), flush=True)
    name = args.out or f"checkpoint_cost_{args.device}" + ("_tiny" if args.tiny else "")
    path = write_results(name, {"model": model, "micro_batch": batch, "seq_len": seq, "device": args.device,
                                "torch": torch.__version__, "blocks": args.blocks, "rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
