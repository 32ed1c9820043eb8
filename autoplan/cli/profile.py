"""`autoplan profile`: measure this machine into a device profile (`autoplan profiles`, which lists them,
is autoplan/cli/profiles.py). `register(subparsers)` adds it to the main parser without importing torch;
the work is done by autoplan.profiling and autoplan.profile_store, printing happens here."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from autoplan.cli.args import positive_int
from autoplan.errors import UsageError

__all__ = ["register", "settings_from_args", "run_profile", "QUICK_TIME"]

# what `--quick` costs, measured on this project's 2-core CPU test machine: 30-40 s, up to a minute while
# other work shares its cores (before the FSDP2 and calibration timing were cut down for it: 60-85 s)
QUICK_TIME = "about half a minute on a 2-core CPU"

PROFILE_EXAMPLES = """examples:
  autoplan profile                                   # CPU + gloo, 2 processes, default models
  autoplan profile --device cuda --nproc 8           # this GPU node, NCCL
  autoplan profile --device cuda --nproc 1           # one GPU: no collectives, links from its datasheet profile
  autoplan profile --model gpt2 llama-tiny --micro-batch 1 2 -o profiles/mine.json
  autoplan profile --quick                           # rough, as cpu-gloo-2-quick: tries the machinery
  autoplan search --model gpt2 --gpus 2 --mem 4GB --profile cpu-gloo-2-local   # then plan with it

A profile measured here is written to the local profile folder as NAME.json. NAME defaults to
<device>-<backend>-<nproc> (cpu-gloo-2), with -quick for --quick; where a shipped profile already has
that name, -local is added (cpu-gloo-2-local), since a shipped name always picks the shipped profile.
"""

def register(subparsers) -> None:
    """Add the `profile` subcommand to an argparse subparsers object."""
    from autoplan.profiling.defaults import DEFAULT_DTYPES, DEFAULT_MODELS
    from cost_models.options import Dtype

    parser = subparsers.add_parser(
        "profile", help="measure this machine's ops and collectives into a device profile",
        description="Time every distinct op of the models' traced graphs (forward and backward) on the device, "
                    "the collectives across --nproc processes, their overlap and the optimizer step; fit "
                    "per-family curves and write a profile `autoplan search --profile` reads. Measurements are "
                    "cached, so an interrupted or repeated run resumes.",
        epilog=PROFILE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default_models = " ".join(f"{m}(mb {','.join(map(str, b))})" for m, b in DEFAULT_MODELS.items())
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to measure (default cpu)")
    parser.add_argument("--nproc", type=positive_int, default=2,
                        help="processes (ranks) for the collectives (default 2); 1 (a one-GPU machine) measures no "
                             "collectives and takes the links of --links-from")
    parser.add_argument("--links-from", metavar="PROFILE",
                        help="with --nproc 1: the profile whose links, collective fits and overlap to use (default: "
                             "the shipped datasheet profile of this device)")
    parser.add_argument("--model", nargs="+", metavar="NAME",
                        help=f"zoo models whose ops to time (default: {default_models})")
    parser.add_argument("--micro-batch", nargs="+", type=positive_int, metavar="N",
                        help="micro-batch sizes for --model (default 1 2: the sizes search traces at)")
    parser.add_argument("--seq-len", type=positive_int, help="sequence length (default: each model's context)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(d.value for d in Dtype), metavar="DTYPE",
                        help=f"compute dtypes to time ops in (default {' '.join(DEFAULT_DTYPES)}; fp32 alone on a CPU "
                             "without bf16 matrix units)")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads per rank (default: cores / nproc, what each rank of a run gets)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="collective backend (default gloo on cpu, nccl on cuda)")
    parser.add_argument("--name", help="profile name (default <device>-<backend>-<nproc>, e.g. cpu-gloo-2; with "
                                       "-quick for --quick, and -local where a shipped profile has that name)")
    parser.add_argument("-o", "--out", help="profile file to write (default: the local profile dir, "
                                            "~/.autoplan/profiles or $AUTOPLAN_PROFILE_DIR, as NAME.json)")
    parser.add_argument("--cache-dir", type=Path, help="measurement cache (default ~/.cache/autoplan or "
                                                       "$AUTOPLAN_CACHE_DIR)")
    parser.add_argument("--no-cache", action="store_true", help="measure everything again; read and write no cache")
    parser.add_argument("--quick", action="store_true",
                        help=f"rough and fast ({QUICK_TIME}): gpt2-tiny at micro-batch 1, one sweep block, "
                             "3 repeats, 3 message sizes, one short overlap trial, calibration steps timed 3 times; "
                             "named <device>-<backend>-<nproc>-quick, so it never takes a full profile's name")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_profile, subparser=parser)


def settings_from_args(args: argparse.Namespace):
    """ProfileSettings for the parsed command line; UsageError for combinations that make no sense."""
    from autoplan.models.zoo import UnknownModelError, get_config
    from autoplan.profiling import ProfileSettings
    from autoplan.profiling.cache import CACHE_DIR_ENV, default_cache_dir

    if args.micro_batch and not args.model:
        raise UsageError("--micro-batch applies to --model; name the models too")
    if args.no_cache and args.cache_dir:
        raise UsageError("--no-cache and --cache-dir contradict each other; give one")
    settings = ProfileSettings(device=args.device, nproc=args.nproc, seq_len=args.seq_len, threads=args.threads,
                               backend=args.backend, name=args.name, progress=not args.no_progress,
                               links_from=args.links_from)
    if args.links_from and args.nproc > 1:
        raise UsageError(f"--links-from applies to --nproc 1; {args.nproc} processes measure their own collectives")
    if args.model:
        from autoplan.models.resolve import parse_zoo_spec

        for name in args.model:
            base, overrides = parse_zoo_spec(name)
            try:
                get_config(base, **overrides)
            except UnknownModelError as exc:
                raise UsageError(str(exc)) from exc
            except (TypeError, ValueError) as exc:
                raise UsageError(f"cannot build {name!r}: {exc}") from exc
        settings.models = {name: tuple(args.micro_batch or (1, 2)) for name in args.model}
    if args.dtype:
        settings.dtypes = tuple(dict.fromkeys(args.dtype))
    elif settings.device == "cpu":
        settings.dtypes = _cpu_dtypes(settings.dtypes)
    settings.cache_dir = None if args.no_cache else (args.cache_dir or default_cache_dir())
    if settings.cache_dir is not None and settings.cache_dir.exists() and not settings.cache_dir.is_dir():
        source = ("--cache-dir" if args.cache_dir else f"${CACHE_DIR_ENV}" if os.environ.get(CACHE_DIR_ENV)
                  else "the default")
        raise UsageError(f"the measurement cache folder {settings.cache_dir} ({source}) is a file, not a folder: "
                         "give a folder (it is created), or --no-cache")
    if args.quick:
        _make_quick(settings, keep_models=bool(args.model), keep_dtypes=bool(args.dtype))
    settings.name = args.name or _default_name(settings, explicit_out=bool(args.out))
    return settings


def _cpu_dtypes(dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """The default dtypes on this CPU: without bf16 matrix units its bf16 ops are emulated, many times slower
    to measure and to train with (`search` says so and offers fp32), so fp32 alone."""
    from autoplan.machine import cpu_identity, has_bf16_matrix_units

    if has_bf16_matrix_units(cpu_identity()):
        return dtypes
    print("autoplan profile: this CPU has no bf16 matrix units (AMX, AVX512-BF16): measuring fp32 ops only "
          "(--dtype bf16 measures bf16 too, emulated and slow)", file=sys.stderr)
    return tuple(d for d in dtypes if d != "bf16") or ("fp32",)


def _make_quick(settings, keep_models: bool, keep_dtypes: bool) -> None:
    from autoplan.profiling.defaults import QUICK
    from autoplan.profiling.timing import Repeats

    settings.quick = True
    for name, value in QUICK.items():
        if (name == "models" and keep_models) or (name == "dtypes" and keep_dtypes):
            continue
        setattr(settings, name, Repeats(**value) if name == "repeats" else dict(value) if name == "models" else value)


def _default_name(settings, explicit_out: bool) -> str:
    """<device>-<backend>-<nproc>[-quick]; written to the local folder under a shipped profile's name, it
    would be hidden by that name (a shipped name always picks the shipped profile), so -local is added."""
    from autoplan.profile_store import is_shipped_name
    from autoplan.profiling.run import default_profile_name

    name = default_profile_name(settings)
    return f"{name}-local" if not explicit_out and is_shipped_name(name) else name


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM ends the measurement as Ctrl-C does: the ranks are stopped, what finished stays cached. The
    KeyboardInterrupt carries the signal's number (`signum`) for the exit status."""
    def interrupt(signum, frame):
        stop = KeyboardInterrupt(signal.Signals(signum).name)
        stop.signum = signum
        raise stop

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _pick(out: Path) -> str:
    """What to give --profile for the profile written to `out`."""
    from autoplan.profile_store import LOCAL_PREFIX, is_shipped_name, local_profile_dir

    if out.suffix == ".json" and out.resolve().parent == local_profile_dir().resolve():
        return f"{LOCAL_PREFIX}{out.stem}" if is_shipped_name(out.stem) else out.stem
    return str(out)


def run_profile(args: argparse.Namespace) -> int:
    from autoplan.fileio import check_writable
    from autoplan.profile_store import LOCAL_PREFIX, local_profile_dir, save_profile
    from autoplan.profiling import measure_profile

    settings = settings_from_args(args)
    out = Path(args.out).expanduser() if args.out else local_profile_dir() / f"{settings.name}.json"
    check_writable(out, "profile file")
    try:
        with _terminate_as_interrupt():
            result = measure_profile(settings)
    except KeyboardInterrupt as exc:
        where = f"cached in {settings.cache_dir}" if settings.cache_dir else "lost (--no-cache)"
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"\ninterrupted by {signal.Signals(signum).name}: the measurements finished so far are {where}; run the "
              "same command again to resume", file=sys.stderr)
        return 128 + int(signum)
    save_profile(result.profile, out)
    print(format_profile_summary(result))
    print(f"\nprofile {result.profile.name!r} written to {out} in {result.wall_s:.1f} s "
          f"({result.ops_measured} ops measured, {result.ops_remeasured} of them twice, "
          f"{result.ops_cached} from the cache; {result.rank_items_measured} of {result.rank_items} measurements on "
          f"the ranks measured, the rest from the cache)")
    pick = _pick(out)
    if pick.startswith(LOCAL_PREFIX):
        name = pick[len(LOCAL_PREFIX):]
        print(f"note: a shipped profile is named {name!r} too, and `--profile {name}` keeps picking that one")
    if settings.quick:
        print("note: a quick profile is rough (few repeats, one tiny model): for trying the machinery, not for "
              "planning; `autoplan profile` without --quick measures a full one")
    print(f"plan with it: autoplan search ... --profile {pick}")
    return 0


def format_profile_summary(result) -> str:
    profile = result.profile
    lines = [f"device {profile.provenance.device_name} ({profile.device_type}), torch {profile.provenance.torch_version}"]
    peaks = ", ".join(f"{dtype} {flops / 1e9:.0f} GFLOP/s" for dtype, flops in profile.peak_flops.items())
    lines.append(f"best matmul: {peaks}; copy bandwidth {profile.mem_bandwidth_bytes_s / 1e9:.1f} GB/s; "
                 f"AdamW {profile.optimizer_bytes_s / 1e9:.1f} GB/s of state; op overhead {profile.op_overhead_s * 1e6:.1f} us")
    lines.append(f"overlap: compute x{profile.overlap.compute_slowdown:.2f}, communication "
                 f"x{profile.overlap.comm_slowdown:.2f} while both run")
    if profile.host_link is not None:
        host = profile.host_link
        lines.append(f"host link: {host.h2d_bytes_s / 1e9:.1f} GB/s to the device, {host.d2h_bytes_s / 1e9:.1f} GB/s "
                     f"back, {'alongside' if host.overlaps_compute else 'not alongside'} compute; host AdamW "
                     f"{host.cpu_optimizer_bytes_s / 1e9:.1f} GB/s of state with {host.cpu_threads} threads")
    lines.append("")
    lines.append(f"{'op fit':<34} {'dir':<4} {'dtype':<5} {'points':>6} {'intercept':>10} {'rate':>14} "
                 f"{'held-out err (median/max)':>26}")
    for report in result.op_fits:
        fit = report.fit
        rate = 1.0 / fit.s_per_unit if fit.s_per_unit > 0 else float("inf")
        unit = "GFLOP/s" if fit.work == "flops" else "GB/s"
        lines.append(f"{fit.family[:34]:<34} {fit.direction:<4} {fit.dtype or 'any':<5} {report.points:>6} "
                     f"{fit.intercept_s * 1e6:>8.1f}us {rate / 1e9:>6.1f} {unit:<7} {_errors(report):>26}")
    lines.append("")
    lines.append(f"{'collective':<16} {'group':>5} {'points':>6} {'latency':>10} {'bandwidth':>12} "
                 f"{'held-out err (median/max)':>26}")
    for report in result.collective_fits:
        fit = report.fit
        bandwidth = 1.0 / fit.beta_s_per_byte if fit.beta_s_per_byte > 0 else float("inf")
        lines.append(f"{fit.collective:<16} {fit.group_size:>5} {report.points:>6} {fit.alpha_s * 1e6:>8.1f}us "
                     f"{bandwidth / 1e9:>7.2f} GB/s {_errors(report):>26}")
    return "\n".join(lines)


def _errors(report) -> str:
    if report.heldout_median_rel_err is None:
        return "-"
    return f"{report.heldout_median_rel_err:.0%} / {report.heldout_max_rel_err:.0%}"
