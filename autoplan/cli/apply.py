"""`autoplan apply`: run a plan as a measured training run and print predicted beside measured.

Registered on the `autoplan` command by cli.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from autoplan.cli.flags import to_flags
from autoplan.errors import UsageError
from autoplan.plan.schema import Plan, load_plan
from autoplan.run.apply import DEFAULT_LR, check_model_matches, check_world_size, model_for_plan
from autoplan.run.data import AlpacaTokens, BatchShape, vocab_size_of
from autoplan.run.launch import launch, torchrun_args
from autoplan.run.report import build_report, format_report
from autoplan.run.worker import RunSpec
from autoplan.sizes import parse_mem_bytes

RUN_FAILED_EXIT_CODE = 1

EXAMPLES = """\
examples:
  autoplan apply plan.json                          # train 2 warm-up + 5 timed steps on the plan's world
  autoplan apply plan.json --steps 20 --report r.json
  autoplan apply plan.json --nproc 1                # dry run: the plan's decisions on a smaller world
  autoplan apply plan.json --data alpaca.json       # local Alpaca JSON, tokenised as bytes
  autoplan apply plan.json --model mypkg.models:build   # a plan made from your own model factory
  autoplan apply plan.json --mem-limit plan         # fail like an out-of-memory error above the plan's limit

Ranks are started with torch.distributed.run (nccl on CUDA, gloo on the CPU). Peak memory is
torch.cuda.max_memory_allocated on CUDA, and the bytes of live tensors on the CPU (autoplan.memtrack).
"""


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "apply",
        help="run a plan as a measured training run (torchrun + FSDP2)",
        description="Train a few steps with a plan under torch.distributed.run and print the planner's "
                    "predictions beside the measured step time, throughput, peak memory and losses.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan", help="plan file written by `autoplan search`")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start (default: the plan's world size); fewer is a dry run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up (default 5)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="warm-up steps, trained and measured for memory but not timed (default 2)")
    parser.add_argument("--data", default=None, metavar="ALPACA_JSON",
                        help="local Alpaca-format JSON file to train on (default: synthetic tokens)")
    parser.add_argument("--report", default=None, metavar="PATH", help="write the predicted/measured record as JSON")
    parser.add_argument("--model", default=None, metavar="PACKAGE.MODULE:FACTORY",
                        help="model factory, required for plans made from one (a plan file never imports code)")
    parser.add_argument("--mem-limit", default=None, metavar="SIZE|plan",
                        help="fail a rank whose memory exceeds SIZE (e.g. 2GB), or the plan's limit with 'plan'; "
                             "on the CPU this counts live tensor bytes, on CUDA it caps the allocator")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"learning rate (default {DEFAULT_LR})")
    parser.add_argument("--seed", type=int, default=0, help="seed for initial weights and synthetic data")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="longest a rank waits for its peers in a collective (default 300)")
    parser.set_defaults(handler=lambda args: run_apply(args, parser), subparser=parser)
    return parser


def run_apply(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    try:
        plan, spec, nproc = prepare_run(args)
    except UsageError as exc:
        parser.error(to_flags(str(exc), parser))  # other AutoplanErrors (a bad plan file) are reported by cli.main

    backend = "nccl" if spec.device == "cuda" else "gloo"
    print(f"autoplan apply: {args.plan} ({plan.model.name}) on {nproc} rank(s), {spec.device} + {backend}, "
          f"{spec.warmup_steps} warm-up + {spec.steps} timed steps", flush=True)
    if spec.dry_run:
        print(f"autoplan apply: DRY RUN on {nproc} of the plan's {plan.cluster.world_size} ranks", flush=True)
    print("autoplan apply: launching torchrun " + " ".join(torchrun_args(Path("<run_spec.json>"), nproc)), flush=True)

    launched = launch(spec, nproc)
    report = build_report(plan, args.plan, spec, nproc, launched)
    print(format_report(report))
    if args.report:
        report.save(args.report)
        print(f"autoplan apply: report written to {args.report}")
    if report.status != "ok":
        print("autoplan apply: the run failed:", file=sys.stderr)
        for message in report.failures:
            print(f"  {message}", file=sys.stderr)
        return RUN_FAILED_EXIT_CODE
    for message in report.failures:  # all ranks finished; a teardown hiccup is only worth a note
        print(f"autoplan apply: note: {message}", file=sys.stderr)
    return 0


def prepare_run(args: argparse.Namespace) -> tuple[Plan, RunSpec, int]:
    """Everything checked before any rank starts: plan file, model, world size, data, limit."""
    plan = load_plan(args.plan)
    model = model_for_plan(plan, args.model)
    check_model_matches(model, plan)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    planned = plan.cluster.world_size
    nproc = planned if args.nproc is None else args.nproc
    if nproc > planned:
        raise UsageError(f"--nproc {nproc} is more ranks than the plan's world of {planned}; "
                         f"re-run `autoplan search --gpus {nproc}` for that world")
    check_world_size(nproc, plan, dry_run=True)
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise UsageError(
            f"the plan needs {nproc} GPUs and this machine has {torch.cuda.device_count()}; run it on a machine "
            f"with {nproc}, or as a dry run with --nproc {torch.cuda.device_count()}"
        )

    if args.data is not None:
        shape = BatchShape(plan.training.micro_batch_size, plan.training.grad_accum_steps, nproc, plan.training.seq_len)
        AlpacaTokens(args.data, vocab_size_of(model)).global_batch(0, shape)  # raises UsageError when unusable

    mem_limit_bytes = None
    if args.mem_limit is not None:
        mem_limit_bytes = plan.cluster.mem_limit_bytes if args.mem_limit == "plan" else parse_mem_bytes(args.mem_limit)

    spec = RunSpec(
        plan_path=str(Path(args.plan).resolve()), run_dir="", device=device, steps=args.steps, warmup_steps=args.warmup,
        dry_run=nproc < planned, seed=args.seed, lr=args.lr, data_path=args.data and str(Path(args.data).resolve()), model_factory=args.model,
        mem_limit_bytes=mem_limit_bytes, timeout_s=args.timeout,
    )
    return plan, spec, nproc
