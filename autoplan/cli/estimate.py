"""`autoplan estimate`: per-GPU peak memory by category and step time of a fixed strategy or a plan."""

from __future__ import annotations

import argparse
import sys

from autoplan.sizes import ACCEPTED_FORMS

EXAMPLES = """examples:
  autoplan estimate --model gpt2-1.5b --gpus 8 --strategy shard --checkpoint --batch-size 4
  autoplan estimate --model llama3-8b --gpus 8 --strategy replicate --dtype bf16 --optimizer sgd
  autoplan estimate --model hf:./my-llama/config.json --gpus 4 --seq-len 2048 --timeline
  autoplan estimate --model mypkg.models:build --seq-len 512 --strategy shard_keep
  autoplan estimate --plan plan.json            # the plan's decisions, model and settings
"""


def register(subparsers) -> None:
    from autoplan.api.estimate import STRATEGIES
    from autoplan.cli.args import mem_arg, positive_int
    from autoplan.settings import DEFAULT_MODEL, DTYPES, OPTIMIZERS
    from autoplan.tracing.units import GRANULARITIES

    parser = subparsers.add_parser(
        "estimate", help="per-GPU peak memory and step time of a fixed sharding strategy or a plan",
        description="Trace the model and predict, for one fixed strategy (every unit sharded, kept gathered, "
                    "replicated or hybrid; with or without activation checkpointing) or a plan file, the per-GPU "
                    "peak memory broken down into parameters, gradients, optimizer states, activations, gathered "
                    "parameters and temporaries, and the step time.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help=f"zoo name, hf:path/to/config.json, or package.module:factory "
                                        f"(default: the plan's model, else {DEFAULT_MODEL})")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--strategy", choices=list(STRATEGIES),
                      help="the option every unit takes (default shard): " +
                           "; ".join(f"{name}: {text}" for name, text in STRATEGIES.items()))
    what.add_argument("--plan", help="a plan file from `autoplan search`: estimate its decisions")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing on every unit but the root")
    parser.add_argument("--gpus", type=positive_int, help="total GPUs, the world size (default 8: one node of 8)")
    parser.add_argument("--nodes", type=positive_int, help="number of nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node")
    parser.add_argument("--profile", help="device profile name or path (default a100-sxm4-80gb)")
    parser.add_argument("--batch-size", type=positive_int, help="micro-batch per GPU (default 1)")
    parser.add_argument("--global-batch", type=positive_int,
                        help="samples per optimizer step over all GPUs (gradient accumulation fills the gap)")
    parser.add_argument("--seq-len", type=positive_int, help="sequence length (default: the model's context)")
    parser.add_argument("--dtype", choices=DTYPES, help="training precision (default bf16-mixed)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer (default adamw)")
    parser.add_argument("--granularity", choices=GRANULARITIES, help="unit size (default block)")
    parser.add_argument("--mem", type=mem_arg, help=f"a per-GPU limit to compare with: {ACCEPTED_FORMS} "
                                                     "(default: the profile's device memory)")
    parser.add_argument("--timeline", action="store_true", help="also print memory at every time point of the step")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.set_defaults(handler=_run_estimate)


def _run_estimate(args) -> int:
    from autoplan.api.estimate import estimate
    from autoplan.errors import UsageError

    if args.plan and args.checkpoint:
        raise UsageError("--checkpoint goes with --strategy; a plan says per unit where it checkpoints")
    result = estimate(
        args.model, args.strategy, checkpoint=args.checkpoint, plan=args.plan, mem=args.mem, gpus=args.gpus,
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, profile=args.profile, batch_size=args.batch_size,
        global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer,
        granularity=args.granularity,
    )
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        print(result.table(timeline=args.timeline))
    return 0
