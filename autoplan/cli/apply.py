"""`autoplan apply`: run a plan as a measured training run and print predicted beside measured.

Registered on the `autoplan` command by cli.py. The checks and the run's outline are
autoplan.run.prepare's, the launch autoplan.run.launch's; this module holds the flags and the printing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoplan.cli.flags import to_flags
from autoplan.errors import AutoplanError, UsageError
from autoplan.fileio import check_writable
from autoplan.plan.schema import load_plan
from autoplan.run.apply import DEFAULT_LR
from autoplan.run.fake_world import FakeWorldOptions, format_fake_world, run_fake_world
from autoplan.run.launch import DEFAULT_RDZV_TIMEOUT_S, LaunchResult, Nodes, launch, torchrun_args
from autoplan.run.memtrack import allocation_failure
from autoplan.run.prepare import PreparedRun, RunOptions, prepare_run, run_outline
from autoplan.run.procs import exit_status
from autoplan.run.report import build_report, format_report
from autoplan.run.resume import CheckpointFlags
from autoplan.sizes import parse_mem_bytes

__all__ = ["register", "run_apply"]

RUN_FAILED_EXIT_CODE = 1

EXAMPLES = """\
examples:
  autoplan apply plan.json                          # 2 warm-up + 5 timed steps on the plan's world
  autoplan apply plan.json --steps 20 --report r.json
  autoplan apply plan.json --nproc 1                # dry run: the plan's decisions on a smaller world
  autoplan apply plan.json --data alpaca.json       # local Alpaca JSON, tokenised as bytes
  autoplan apply plan.json --model mypkg.models:build   # a plan made from your own model factory
  autoplan apply plan.json --mem-limit plan         # fail like an out-of-memory error above the plan's limit
  autoplan apply plan64.json --fake-world           # this process as rank 0 of the plan's world (no torchrun)
  autoplan apply plan.json --save ckpt --save-every 100   # sharded checkpoints in ckpt/step-<N>
  autoplan apply other-plan.json --resume ckpt      # carry on from ckpt's latest step, under another plan
  # two nodes: the same line on each, with its own --node-rank; the report is printed on node 0
  autoplan apply plan.json --nnodes 2 --node-rank 0 --rdzv-endpoint node0.cluster:29500

What runs: --warmup steps (trained, not timed: the first steps allocate memory and warm up), then
--steps timed steps, whose median is the measured step time. On the CPU peak memory is counted by a
live-tensor tracker that watches every op and slows the steps it watches, so there the --steps steps
are measured for memory and --steps more "untracked" steps, with the tracker off, are timed: a CPU run
trains warmup + 2 x steps steps. Before it starts, the run says so and estimates how long it takes
from the plan's predicted step time.

Ranks are started with torch.distributed.run (nccl on CUDA, gloo on the CPU). Peak memory is
torch.cuda.max_memory_allocated on CUDA, and the bytes of live tensors on the CPU (autoplan.memtrack).
Each unit runs as its plan record says: its sharding (FSDP2 fully_shard), its checkpoint mode (none;
selective: matmul, attention and collective outputs kept, the rest recomputed; full), and offload
(FSDP2 CPUOffloadPolicy: its parameters, gradients and optimizer states on the host, its optimizer
step there). Offloaded state is reported as host memory beside the device's peak.
Each step prints rank 0's loss on its own micro-batches; the summary's loss is the mean over ranks.
Ctrl-C (SIGINT), SIGTERM or SIGHUP stops every rank and removes the run directory; the command then
exits with 128 + the signal's number (130, 143, 129). torchrun's own log is off unless LOGLEVEL is set.
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
                        help="ranks to start on this node (default: the plan's world size over --nnodes); "
                             "fewer is a dry run")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps measured after the warm-up (default 5): timed on CUDA; on the CPU measured "
                             "for memory, and as many again run untracked and timed")
    parser.add_argument("--warmup", type=int, default=2,
                        help="warm-up steps, trained and measured for memory but not timed (default 2)")
    parser.add_argument("--data", default=None, metavar="ALPACA_JSON",
                        help="local Alpaca-format JSON file to train on (default: synthetic tokens)")
    parser.add_argument("--report", default=None, metavar="PATH",
                        help="write the predicted/measured record as JSON (checked writable before the run)")
    parser.add_argument("--model", default=None, metavar="PACKAGE.MODULE:FACTORY",
                        help="model factory, required for plans made from one (a plan file never imports code)")
    parser.add_argument("--mem-limit", default=None, metavar="SIZE|plan",
                        help="fail a rank whose memory exceeds SIZE (e.g. 2GB), or the plan's limit with 'plan'; "
                             "on the CPU this counts live tensor bytes, on CUDA it caps the allocator")
    parser.add_argument("--fake-world", action="store_true",
                        help="run here, without torchrun, as rank 0 of the plan's world on torch's fake process "
                             "group: real per-rank memory, collectives free (step time is compute only)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"learning rate (default {DEFAULT_LR})")
    parser.add_argument("--seed", type=int, default=0, help="seed for initial weights and synthetic data")
    saving = parser.add_argument_group("checkpoints", "sharded with torch.distributed.checkpoint: a checkpoint saved "
                                       "under one plan resumes under any plan of the same model (other units, "
                                       "sharding, checkpointing or world size)")
    saving.add_argument("--save", default=None, metavar="DIR",
                        help="save the model, optimizer, step and data position in DIR/step-<N> at the end of the run "
                             "(and every --save-every steps)")
    saving.add_argument("--save-every", type=int, default=None, metavar="N",
                        help="with --save: also every N steps (counted across resumed runs)")
    saving.add_argument("--resume", default=None, metavar="DIR",
                        help="start from a checkpoint: a step-<N> folder, or a --save DIR (its latest finished step)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="longest a rank waits for its peers in a collective (default 300)")
    nodes = parser.add_argument_group("several nodes", "torchrun's static rendezvous: run the same command on "
                                      "every node, each with its --node-rank; node 0 prints the report")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes the run spans (default 1)")
    nodes.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0 to nnodes-1 (default 0)")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="an address of node 0 and a free port on it, the same on every node")
    nodes.add_argument("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S, metavar="SECONDS",
                       help="longest a node waits for the others to join before giving up (default "
                            f"{DEFAULT_RDZV_TIMEOUT_S:.0f}); while it waits it says so")
    parser.set_defaults(handler=lambda args: run_apply(args, parser), subparser=parser)
    return parser


def run_apply(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    for flag, value in (("--timeout", args.timeout), ("--rdzv-timeout", args.rdzv_timeout)):
        if not 0 < value < float("inf"):
            parser.error(f"{flag} must be a positive number of seconds, got {value}")
    if args.fake_world:
        return _run_fake_world(args, parser)
    nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_timeout)
    try:
        prepared = prepare_run(args.plan, RunOptions(
            model=args.model, nproc=args.nproc, nodes=nodes, steps=args.steps, warmup=args.warmup, data=args.data,
            report=args.report, mem_limit=args.mem_limit, lr=args.lr, seed=args.seed, timeout=args.timeout,
            checkpoints=CheckpointFlags(args.save, args.save_every, args.resume),
        ))
    except UsageError as exc:
        parser.error(to_flags(str(exc), parser))  # other AutoplanErrors (a bad plan file) are reported by cli.main

    _say_before(prepared, args, parser)
    launched = launch(prepared.spec, prepared.nproc, nodes,
                      say=lambda line: print(f"autoplan apply: {line}", flush=True))
    if launched.rendezvous_error is not None and launched.interrupted is None:
        return _rendezvous_failed(launched, nodes, args)
    if nodes.rank != 0:
        return _node_summary(prepared, launched)
    report = build_report(prepared.plan, args.plan, prepared.spec, prepared.world_size, launched,
                          model=prepared.model, model_note=prepared.model_note, nodes=nodes.count)
    if launched.interrupted is None:
        print(format_report(report))
    if args.report:
        _save_report(report, args.report)
        print(f"autoplan apply: report written to {args.report}" + (" (the run was interrupted)"
                                                                    if launched.interrupted else ""))
    if launched.interrupted is not None:
        done = min((r.steps_done for r in launched.ranks.values() if r is not None), default=0)
        print(f"autoplan apply: interrupted by {launched.interrupted} after {done} step(s): every rank stopped, "
              "the run directory removed", file=sys.stderr)
        return exit_status(launched.interrupted)
    if report.status != "ok":
        if not any(launched.ranks.values()) and launched.launcher_summary:  # no rank said anything itself
            print(launched.launcher_summary, file=sys.stderr)
        print("autoplan apply: the run failed:", file=sys.stderr)
        for message in report.failures:
            print(f"  {message}", file=sys.stderr)
        return RUN_FAILED_EXIT_CODE
    for message in report.failures:  # all ranks finished; a teardown hiccup is only worth a note
        print(f"autoplan apply: note: {message}", file=sys.stderr)
    return 0


def _run_fake_world(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`--fake-world`: rank 0 of the plan's world in this process (autoplan.run.fake_world)."""
    clashing = [flag for flag, given in (("--nproc", args.nproc is not None), ("--data", args.data is not None),
                                         ("--nnodes", args.nnodes != 1), ("--rdzv-endpoint", args.rdzv_endpoint),
                                         ("--save", args.save), ("--save-every", args.save_every),
                                         ("--resume", args.resume))
                if given]
    if clashing:
        parser.error(f"--fake-world runs one process on synthetic tokens; it does not take {', '.join(clashing)}")
    try:
        if args.report:
            check_writable(args.report, "report", param="report", example="report.json",
                           inputs=(("the plan file", args.plan),))
        plan = load_plan(args.plan)
        limit = None if args.mem_limit is None else (plan.cluster.mem_limit_bytes if args.mem_limit == "plan"
                                                     else parse_mem_bytes(args.mem_limit))
        print(f"autoplan apply: {args.plan} as rank 0 of a fake {plan.cluster.world_size}-rank world, in this process "
              "(no torchrun)", flush=True)
        result = run_fake_world(args.plan, steps=args.steps, model=args.model, warmup=args.warmup,
                                options=FakeWorldOptions(seed=args.seed, lr=args.lr, mem_limit_bytes=limit),
                                log=lambda line: print(f"autoplan apply: {line}", flush=True))
    except UsageError as exc:
        parser.error(to_flags(str(exc), parser))
    except Exception as exc:  # the allocator refusing memory is reported as what it refused
        refused = allocation_failure(exc)
        if refused is None:
            raise
        print(f"autoplan apply: the fake-world run failed: out of memory: {refused}", file=sys.stderr)
        return RUN_FAILED_EXIT_CODE
    print(format_fake_world(result))
    if args.report:
        _save_report(result, args.report)
        print(f"autoplan apply: report written to {args.report}")
    return 0


def _rendezvous_failed(launched: LaunchResult, nodes: Nodes, args: argparse.Namespace) -> int:
    """The nodes did not all meet, so nothing ran: one sentence saying so and what would help, no report."""
    print(f"autoplan apply: the {nodes.count} nodes did not all join the rendezvous at {nodes.rdzv_endpoint} within "
          f"{nodes.rdzv_timeout_s:.0f} s (--rdzv-timeout), so nothing ran ({launched.rendezvous_error}). Start "
          "`autoplan apply` with the same plan, --nnodes and --rdzv-endpoint on every node, each with its own "
          "--node-rank (node 0 at that address), or give --rdzv-timeout more seconds"
          + (f"; no report written to {args.report}" if args.report and nodes.rank == 0 else ""), file=sys.stderr)
    return RUN_FAILED_EXIT_CODE


def _save_report(report, path: str) -> None:
    """Write a run report (or a fake-world result) after the run; the table printed above holds its numbers."""
    try:
        report.save(path)
    except OSError as exc:
        raise AutoplanError(f"could not write the report to {path}: {exc.strerror or exc}; the table "
                            "above holds its numbers") from None


def _say_before(prepared: PreparedRun, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What will run, on what, for about how long; warnings that do not stop the run."""
    spec, plan, nodes = prepared.spec, prepared.plan, prepared.nodes
    backend = "nccl" if spec.device == "cuda" else "gloo"
    where = f"{prepared.nproc} rank(s)" + (f" of {prepared.world_size} on node {nodes.rank} of {nodes.count}"
                                            if nodes.count > 1 else "")
    print(f"autoplan apply: {args.plan} ({prepared.model}) on {where}, {spec.device} + {backend}", flush=True)
    for line in run_outline(prepared):
        print(f"autoplan apply: {line}", flush=True)
    for warning in prepared.warnings:
        print(f"autoplan apply: warning: {to_flags(warning, parser)}", flush=True)
    if spec.dry_run:
        print(f"autoplan apply: DRY RUN on {prepared.world_size} of the plan's {plan.cluster.world_size} ranks",
              flush=True)
    if nodes.rank != 0 and args.report:
        print(f"autoplan apply: node 0 writes the report ({args.report} there)", flush=True)
    print("autoplan apply: launching torchrun " + " ".join(torchrun_args(Path("<run_spec.json>"), prepared.nproc,
                                                                          nodes)), flush=True)


def _node_summary(prepared: PreparedRun, launched: LaunchResult) -> int:
    """A node other than node 0: how its own ranks did; the report is node 0's."""
    local = launched.local_ranks or []
    if launched.interrupted is not None:
        print(f"autoplan apply: interrupted by {launched.interrupted}: this node's ranks stopped", file=sys.stderr)
        return exit_status(launched.interrupted)
    failed = [rank for rank in local if launched.ranks.get(rank) is None or launched.ranks[rank].status != "ok"]
    for rank in local:
        result = launched.ranks.get(rank)
        state = "sent nothing" if result is None else f"{result.status} after {result.steps_done} step(s)"
        print(f"autoplan apply: rank {rank} (this node): {state}"
              + (f": {result.error}" if result is not None and result.error else ""),
              file=sys.stderr if rank in failed else sys.stdout)
    print(f"autoplan apply: node {prepared.nodes.rank} done; node 0 prints the predicted-vs-measured report")
    return RUN_FAILED_EXIT_CODE if failed or launched.returncode else 0
