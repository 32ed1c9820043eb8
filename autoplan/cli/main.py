"""The `autoplan` command: argparse subcommands; work is done by library functions, printing here."""

from __future__ import annotations

import argparse
import os
import sys
import time

from autoplan.cli import apply as cli_apply
from autoplan.cli import estimate as cli_estimate
from autoplan.cli import profile as cli_profile
from autoplan.cli.args import mem_arg, positive_float, positive_int
from autoplan.errors import AutoplanError, UsageError
from autoplan.sizes import ACCEPTED_FORMS

SEARCH_EXAMPLES = """examples:
  autoplan search --model gpt2-1.5b --mem 8GB
  autoplan search --model llama2-70b --mem 80GB --nodes 8 --gpus-per-node 8 --profile h100-sxm-80gb
  autoplan search --model gpt2 --mem 2GB --gpus 2 --seq-len 128 --global-batch 64 -o plan.json
  autoplan search --model mypkg.models:build --seq-len 2048 --mem 40GiB --json
"""


def _add_search(subparsers) -> None:
    from autoplan.settings import DEFAULT_MODEL, DTYPES, OPTIMIZERS
    from autoplan.tracing.units import GRANULARITIES

    parser = subparsers.add_parser(
        "search", help="find the fastest sharding plan that fits a memory limit",
        description="Trace the model, cost every unit's options and pick, with CP-SAT, the fastest plan "
                    "whose predicted per-GPU peak memory fits --mem. Writes the plan (JSON) and prints it.",
        epilog=SEARCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"zoo name (see `autoplan models`), hf:path/to/config.json (a Hugging Face config, "
                             f"nothing downloaded) or package.module:factory (default {DEFAULT_MODEL})")
    parser.add_argument("--mem", type=mem_arg, default=None,
                        help=f"per-GPU memory limit: {ACCEPTED_FORMS} (default: the profile's device memory)")
    parser.add_argument("--gpus", type=positive_int, help="total GPUs (default 8: one node of 8)")
    parser.add_argument("--nodes", type=positive_int, help="number of nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node")
    parser.add_argument("--profile", help="device profile name or path (see `autoplan profiles`; default a100-sxm4-80gb)")
    parser.add_argument("--seq-len", type=positive_int, help="sequence length (default: the model's context)")
    parser.add_argument("--batch-size", type=positive_int, help="fixed micro-batch per GPU (default: swept)")
    parser.add_argument("--global-batch", type=positive_int,
                        help="samples per optimizer step over all GPUs (gradient accumulation fills the gap)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16-mixed", help="training precision (default bf16-mixed)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (default adamw)")
    parser.add_argument("--granularity", choices=GRANULARITIES, default="block",
                        help="unit size: one per block (default), attention/MLP apart (fine), every module (leaf)")
    parser.add_argument("--strategy", choices=("shard", "shard_keep", "replicate", "hybrid"),
                        help="no solver: every unit takes this sharding (a uniform plan to run or compare)")
    parser.add_argument("--checkpoint", action="store_true", help="with --strategy: checkpoint every block")
    parser.add_argument("--time-limit", type=positive_float, default=10.0, help="solver seconds per micro-batch size")
    parser.add_argument("--headroom", type=float, default=None,
                        help="fraction of --mem kept free against prediction error and run-to-run variation "
                             "(default 0.02: plans fit 98%% of --mem)")
    parser.add_argument("-o", "--out", default="plan.json", help="plan file to write (default plan.json)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    parser.set_defaults(handler=_run_search)


def _run_search(args) -> int:
    from autoplan.api.search import search
    from autoplan.plan.report import format_plan
    from autoplan.profile_store import load_profile
    from autoplan.settings import DEFAULT_PROFILE

    start = time.perf_counter()
    mem = args.mem if args.mem is not None else load_profile(args.profile or DEFAULT_PROFILE).mem_bytes
    if args.checkpoint and not args.strategy:
        raise UsageError("--checkpoint goes with --strategy; without it the solver decides checkpointing per unit")
    plan = search(
        args.model, mem, gpus=args.gpus, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        profile=args.profile, seq_len=args.seq_len, batch_size=args.batch_size, global_batch=args.global_batch,
        dtype=args.dtype, optimizer=args.optimizer, granularity=args.granularity, time_limit_s=args.time_limit,
        strategy=args.strategy, checkpoint=args.checkpoint,
        **({} if args.headroom is None else {"headroom": args.headroom}),
    )
    plan.save(args.out)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        default_cluster = args.gpus is None and args.nodes is None and args.gpus_per_node is None and not args.profile
        print(format_plan(plan, cluster_is_default=default_cluster))
        print(f"plan written to {args.out} ({time.perf_counter() - start:.1f} s)")
    return 0


def _add_models(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the model zoo with parameter counts")
    parser.set_defaults(handler=_run_models)


def _run_models(args) -> int:
    from autoplan.models.zoo import ALIASES, PRESETS, build_model, count_params

    aliases: dict[str, list[str]] = {}
    for alias, target in ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    print(f"{'name':<16} {'parameters':>18}  aliases")
    for name in PRESETS:
        n_params = count_params(build_model(name, device="meta"))
        print(f"{name:<16} {n_params:>18,}  {', '.join(aliases.get(name, []))}")
    print("\nor a factory of your own: --model package.module:factory (returns an nn.Module)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan", description="Cost-model-driven FSDP2 sharding planner for PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_search(subparsers)
    _add_models(subparsers)
    cli_profile.register(subparsers)
    cli_estimate.register(subparsers)
    cli_apply.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except AutoplanError as exc:
        print(f"autoplan {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
