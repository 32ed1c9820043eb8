"""`autoplan estimate`: per-GPU peak memory by category and step time of a fixed strategy or a plan."""

from __future__ import annotations

import argparse
import sys

from autoplan.cli.flags import add_settings_flags, settings_fields, to_flags
from autoplan.cli.pins import add_pin_flag
from autoplan.cli.torchtitan import add_torchtitan_flag, job_header, torchtitan_job
from autoplan.cli.warnings import device_warnings

__all__ = ["register"]

EXAMPLES = """examples:
  autoplan estimate --model gpt2-1.5b --gpus 8 --strategy shard --checkpoint --batch-size 4
  autoplan estimate --model llama3-8b --gpus 8 --strategy replicate --dtype bf16 --optimizer sgd
  autoplan estimate --model hf:./my-llama/config.json --gpus 4 --seq-len 2048 --timeline
  autoplan estimate --model mypkg.models:build --seq-len 512 --strategy shard_keep
  autoplan estimate --plan plan.json            # the plan's decisions, model and settings
  autoplan estimate --plan plan.json --pin 'transformer.h.*=shard+ckpt'   # the plan with those units changed
  autoplan estimate --torchtitan llama3_8b.toml --nodes 8 --gpus-per-node 8   # a torchtitan job config
"""


def register(subparsers) -> None:
    from autoplan.settings import EstimateSettings

    parser = subparsers.add_parser(
        "estimate", help="per-GPU peak memory and step time of a fixed sharding strategy or a plan",
        description="Trace the model and predict, for one fixed strategy (every unit sharded, kept gathered, "
                    "replicated or hybrid; with or without activation checkpointing) or a plan file, the per-GPU "
                    "peak memory broken down into parameters, gradients, optimizer states, activations, gathered "
                    "parameters and temporaries, and the step time.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(parser, EstimateSettings, skip=("pin",))
    add_pin_flag(parser, EstimateSettings)
    add_torchtitan_flag(parser, " and its layout (FSDP/HSDP/DDP, tensor parallelism, activation checkpointing, "
                                "offload)")
    parser.add_argument("--timeline", action="store_true", help="also print memory at every time point of the step")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.set_defaults(handler=_run, subparser=parser)


def _run(args) -> int:
    from autoplan.api.estimate import estimate
    from autoplan.cli.args import user_prints_to_stderr
    from autoplan.settings import EstimateSettings
    from autoplan.sizes import format_bytes

    fields = settings_fields(EstimateSettings, args)
    header = []
    if args.torchtitan:
        job = torchtitan_job(args, fields, estimate=True)
        fields.update(job.estimate_fields())
        header = job_header(job)
    with user_prints_to_stderr(args.json) as stdout:
        result = estimate(settings=EstimateSettings.create(**fields))
    for warning in device_warnings(plan=result):
        print(f"autoplan estimate: warning: {to_flags(warning, args.subparser)}", file=sys.stderr)
    if args.json:
        stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        print("\n".join(header + [result.table(timeline=args.timeline)]))
        c = result.cluster
        if c.mem_limit_bytes > c.device_mem_bytes:
            print(f"note: the limit {format_bytes(c.mem_limit_bytes)} is above the {format_bytes(c.device_mem_bytes)} "
                  f"a {c.profile} device has (--allow-over-device-mem)")
    return 0
