"""`autoplan search`: the fastest plan that fits a memory limit, written to a file and printed.

The output path is checked before the search (a search can take a while; its result must not be lost
to a read-only folder). A Hugging Face config path is written relative to the plan file's folder, which
is where `autoplan estimate --plan` and `apply` look for it (`autoplan.models.resolve.plan_hf_path`).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from autoplan.cli.args import user_prints_to_stderr
from autoplan.cli.flags import add_settings_flags, settings_fields, to_flags
from autoplan.cli.pins import add_pin_flag, emit_pins
from autoplan.cli.torchtitan import add_torchtitan_flag, beside, job_header, torchtitan_job
from autoplan.cli.warnings import device_warnings

__all__ = ["register"]

EXAMPLES = """examples:
  autoplan search --model gpt2-1.5b --mem 8GB
  autoplan search --model llama2-70b --mem 80GB --nodes 8 --gpus-per-node 8 --profile h100-sxm-80gb
  autoplan search --model gpt2 --mem 2GB --gpus 2 --seq-len 128 --global-batch 64 -o plan.json
  autoplan search --model mypkg.models:build --seq-len 2048 --mem 40GiB --json
  autoplan search --model gpt2-1.5b --mem 8GB --emit-pins pins.yaml      # the plan's decisions as pins
  autoplan search --model gpt2-1.5b --mem 8GB --pins pins.yaml --pin 'lm_head=replicate'
  autoplan search --model llama2-7b --mem 24GB --gpus 8 --profile h100-sxm-80gb --fit-allocator
  autoplan search --torchtitan llama3_8b.toml --nodes 8 --gpus-per-node 8   # beside a torchtitan job config
"""


def register(subparsers) -> None:
    from autoplan.settings import SearchSettings

    parser = subparsers.add_parser(
        "search", help="find the fastest sharding plan that fits a memory limit",
        description="Trace the model, cost every unit's options and pick, with CP-SAT, the fastest plan "
                    "whose predicted per-GPU peak memory fits --mem. Writes the plan (JSON) and prints it.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(parser, SearchSettings, skip=("pin",))
    add_pin_flag(parser, SearchSettings)
    parser.add_argument("-o", "--out", default="plan.json", help="plan file to write (default plan.json)")
    parser.add_argument("--emit-pins", metavar="FILE", help="also write the plan's decisions as a pins file (YAML; "
                        "JSON if FILE ends in .json), units that agree grouped by ranges: edit it and search again "
                        "with --pins FILE")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    add_torchtitan_flag(parser, " (its samples per step kept), its layout estimated and printed beside the plan")
    parser.add_argument("--fit-allocator", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                        help="CUDA profiles: check the plan by replaying its step (rank 0, fake tensors) through a "
                             "model of torch's caching allocator. auto (the default): when the replay takes less than "
                             "15%% of the search's time, and if the step needs more than --mem less what a GPU was "
                             "measured to need beyond a replay (1%% with expandable segments, 2%% natively), fit it "
                             "(as on); on (or bare --fit-allocator): plan to the replay itself: the live bytes to "
                             "--mem less the headroom, and while the step needs more, the default plan and searches "
                             "between the two (a few seconds to a minute per round, at most 6); off: no replay")
    parser.set_defaults(handler=_run, subparser=parser)


def _hf_relative_to(plan, out: str):
    """The plan with an "hf:PATH" model named relative to the folder of `out` (unchanged where it already is),
    and a note when that folder does not hold the config: a plan's config is read only inside its folder."""
    from autoplan.models.hf import HF_PREFIX

    name = plan.model.name
    if not name.startswith(HF_PREFIX):
        return plan, None
    given = Path(name[len(HF_PREFIX):]).expanduser()
    folder = Path(out).expanduser().absolute().parent
    note = None
    if not given.resolve().is_relative_to(folder.resolve()):
        note = (f"note: the config {given} is outside the plan's folder ({folder}); `autoplan estimate --plan` and "
                f"`apply` read a plan's config only inside its folder, so give them --model {name} (or keep the "
                "config beside the plan)")
    if not given.is_absolute() and (folder / given).resolve() == given.resolve():
        return plan, note
    relative = HF_PREFIX + os.path.relpath(given.resolve(), folder)
    return plan.model_copy(update={"model": plan.model.model_copy(update={"name": relative})}), note


def _estimate_of(job, fields: dict):
    """The torchtitan config's own layout, estimated on the search's cluster and limit."""
    from autoplan.api.estimate import estimate
    from autoplan.settings import EstimateSettings

    cluster = {name: fields.get(name) for name in ("gpus", "nodes", "gpus_per_node", "profile", "host_mem", "mem",
                                                   "allow_over_device_mem")}
    return estimate(settings=EstimateSettings.create(**cluster, **job.estimate_fields()))


def _search(settings, fit_allocator: str):
    """The plan, checked or fitted by replaying its step through the caching allocator model as `fit_allocator`
    says (CUDA profiles; see the flag's help)."""
    from autoplan.api.search import search
    from autoplan.profile_store import load_profile
    from autoplan.settings import DEFAULT_PROFILE
    from autoplan.sizes import format_bytes

    def say(line: str) -> None:
        print(f"autoplan search: {line}", file=sys.stderr, flush=True)

    cuda = load_profile(settings.profile or DEFAULT_PROFILE).device_type == "cuda"
    if fit_allocator == "on" or not cuda:
        if fit_allocator == "on":
            from autoplan.run.allocator_fit import search_fitting_allocator

            return search_fitting_allocator(settings, say=say)[0]
        return search(settings=settings)
    start, cpu_start = time.perf_counter(), _cpu_s()
    plan = search(settings=settings)
    if fit_allocator == "off" or settings.fit_to == "allocated":  # live bytes alone, as asked
        return plan
    from autoplan.run.allocator_check import AUTO_REPLAY_SHARE, replay_within

    replayed = replay_within(plan, AUTO_REPLAY_SHARE * (time.perf_counter() - start),
                             AUTO_REPLAY_SHARE * (_cpu_s() - cpu_start))
    if replayed is None:
        return plan
    from autoplan.run.allocator_fit import search_fitting_allocator

    from cost_models.allocator_replay import replay_room

    room = replay_room(plan.cluster.mem_limit_bytes, plan.cluster.expandable_segments)
    if replayed.needed_bytes > room:  # what a GPU needs beyond a replay (GPU_REPLAY_ERROR) left free
        say(f"the replayed step needs {format_bytes(replayed.needed_bytes)}, more than {format_bytes(room)} (the "
            "limit less what a GPU was measured to need beyond a replay): fitting the plan to the replay")
        return search_fitting_allocator(settings, say=say, default=(plan, replayed))[0]
    return plan.model_copy(update={"predicted": plan.predicted.model_copy(
        update={"allocator_needed_bytes": replayed.needed_bytes})})


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (a search's forked workers)."""
    usage = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _run(args) -> int:
    from autoplan.fileio import check_writable
    from autoplan.plan.report import format_plan
    from autoplan.settings import SearchSettings

    start = time.perf_counter()
    fields = settings_fields(SearchSettings, args)
    job = None
    if args.torchtitan:
        job = torchtitan_job(args, fields, estimate=False)
        fields.update(job.search_fields())
    settings = SearchSettings.create(**fields)
    check_writable(args.out, "plan file", param="out", example="plan.json",
                   inputs=(("the `pins` file", getattr(args, "pins", None)), ("the `emit_pins` file", args.emit_pins)))
    if args.emit_pins:
        check_writable(args.emit_pins, "pins file", param="emit_pins", example="pins.yaml")
    with user_prints_to_stderr(args.json) as stdout:
        found = _search(settings, args.fit_allocator)
        theirs = None if job is None else _estimate_of(job, fields)
    for warning in device_warnings(plan=found):
        print(f"autoplan search: warning: {to_flags(warning, args.subparser)}", file=sys.stderr)
    plan, note = _hf_relative_to(found, args.out)
    plan.save(args.out)
    if note:
        print(f"autoplan search: {note}", file=sys.stderr)
    if args.emit_pins:
        emit_pins(plan, args.emit_pins, args.out)
    if args.json:
        stdout.write(plan.to_json())
    else:
        print(to_flags(format_plan(plan, cluster_is_default=settings.cluster_is_default), args.subparser))
        if plan.pins:
            print(f"pins: {', '.join(f'{p.pattern}: {p.decision}' for p in plan.pins)}")
        if job is not None:
            print("\n".join(["", *job_header(job), beside(job, theirs, plan)]))
        print(f"plan written to {args.out} ({time.perf_counter() - start:.1f} s)"
              + (f"; its decisions as pins to {args.emit_pins}" if args.emit_pins else ""))
    return 0
