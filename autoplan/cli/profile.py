"""`autoplan profile` (measure this machine into a device profile) and `autoplan profiles` (list the
shipped and local ones). `register(subparsers)` adds both to the main parser; the work is done by
autoplan.profiling and autoplan.profiles, printing happens here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoplan.cli.args import positive_int
from autoplan.errors import AutoplanError, UsageError

PROFILE_EXAMPLES = """examples:
  autoplan profile                                   # CPU + gloo, 2 processes, default models
  autoplan profile --device cuda --nproc 8           # this GPU node, NCCL
  autoplan profile --model gpt2 llama-tiny --micro-batch 1 2 -o profiles/mine.json
  autoplan profile --quick --no-cache                # rough, seconds: a smoke test of the machinery
  autoplan search --model gpt2 --gpus 2 --mem 4GB --profile cpu-gloo-2   # then plan with it
"""

PROFILES_EXAMPLES = """examples:
  autoplan profiles
  AUTOPLAN_PROFILE_DIR=./my-profiles autoplan profiles
"""


def register(subparsers) -> None:
    """Add the `profile` and `profiles` subcommands to an argparse subparsers object."""
    from autoplan.profiling.run import DEFAULT_DTYPES, DEFAULT_MODELS
    from autoplan.tracing.counting import DTYPES

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
                        help="processes (ranks) for the collectives, at least 2 (default 2)")
    parser.add_argument("--model", nargs="+", metavar="NAME",
                        help=f"zoo models whose ops to time (default: {default_models})")
    parser.add_argument("--micro-batch", nargs="+", type=positive_int, metavar="N",
                        help="micro-batch sizes for --model (default 1 2: the sizes search traces at)")
    parser.add_argument("--seq-len", type=positive_int, help="sequence length (default: each model's context)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), metavar="DTYPE",
                        help=f"compute dtypes to time ops in (default {' '.join(DEFAULT_DTYPES)})")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads per rank (default: cores / nproc, what each rank of a run gets)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="collective backend (default gloo on cpu, nccl on cuda)")
    parser.add_argument("--name", help="profile name (default <device>-<backend>-<nproc>, e.g. cpu-gloo-2)")
    parser.add_argument("-o", "--out", help="profile file to write (default: the local profile dir, "
                                            "~/.autoplan/profiles or $AUTOPLAN_PROFILE_DIR, as NAME.json)")
    parser.add_argument("--cache-dir", type=Path, help="measurement cache (default ~/.cache/autoplan or "
                                                       "$AUTOPLAN_CACHE_DIR)")
    parser.add_argument("--no-cache", action="store_true", help="measure everything again; read and write no cache")
    parser.add_argument("--quick", action="store_true",
                        help="rough and fast: gpt2-tiny at micro-batch 1, one sweep block, 3 repeats, 3 message "
                             "sizes, one short overlap trial")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_profile, subparser=parser)

    listing = subparsers.add_parser(
        "profiles", help="list the shipped and local device profiles",
        description="Shipped profiles (datasheets, and measured ones that come with autoplan) and local ones "
                    "(written by `autoplan profile`), with where each came from. A local profile overrides a "
                    "shipped one of the same name.",
        epilog=PROFILES_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listing.set_defaults(handler=run_profiles, subparser=listing)


def settings_from_args(args: argparse.Namespace):
    """ProfileSettings for the parsed command line; UsageError for combinations that make no sense."""
    from autoplan.models.zoo import UnknownModelError, get_config
    from autoplan.profiling import ProfileSettings
    from autoplan.profiling.cache import default_cache_dir
    from autoplan.profiling.timing import Repeats

    if args.micro_batch and not args.model:
        raise UsageError("--micro-batch applies to --model; name the models too")
    if args.no_cache and args.cache_dir:
        raise UsageError("--no-cache and --cache-dir contradict each other; give one")
    settings = ProfileSettings(device=args.device, nproc=args.nproc, seq_len=args.seq_len, threads=args.threads,
                               backend=args.backend, name=args.name, progress=not args.no_progress)
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
    settings.cache_dir = None if args.no_cache else (args.cache_dir or default_cache_dir())
    if args.quick:
        settings.models = settings.models if args.model else {"gpt2-tiny": (1,)}
        settings.dtypes = settings.dtypes if args.dtype else ("fp32",)
        settings.sweep = ((128, 256),)
        settings.comm_sizes_bytes = (4 << 10, 256 << 10, 4 << 20)
        settings.repeats = Repeats(warmup=1, min_repeats=3, max_repeats=5, min_time_s=0.0)
        settings.overlap_phase_s, settings.overlap_trials, settings.comm_rounds = 0.1, 1, 1
        settings.calibration_rounds = 1
    return settings


def run_profile(args: argparse.Namespace) -> int:
    from autoplan.profile_store import local_profile_dir, save_profile
    from autoplan.profiling import measure_profile

    settings = settings_from_args(args)
    try:
        result = measure_profile(settings)
    except KeyboardInterrupt:
        where = f"cached in {settings.cache_dir}" if settings.cache_dir else "lost (--no-cache)"
        print(f"\ninterrupted: the measurements so far are {where}; run the same command again to resume",
              file=sys.stderr)
        return 130
    out = Path(args.out) if args.out else local_profile_dir() / f"{result.profile.name}.json"
    save_profile(result.profile, out)
    print(format_profile_summary(result))
    print(f"\nprofile {result.profile.name!r} written to {out} in {result.wall_s:.1f} s "
          f"({result.ops_measured} ops measured, {result.ops_remeasured} of them twice, "
          f"{result.ops_cached} from the cache)")
    return 0


def format_profile_summary(result) -> str:
    profile = result.profile
    lines = [f"device {profile.provenance.device_name} ({profile.device_type}), torch {profile.provenance.torch_version}"]
    peaks = ", ".join(f"{dtype} {flops / 1e9:.0f} GFLOP/s" for dtype, flops in profile.peak_flops.items())
    lines.append(f"best matmul: {peaks}; copy bandwidth {profile.mem_bandwidth_bytes_s / 1e9:.1f} GB/s; "
                 f"AdamW {profile.optimizer_bytes_s / 1e9:.1f} GB/s of state; op overhead {profile.op_overhead_s * 1e6:.1f} us")
    lines.append(f"overlap: compute x{profile.overlap.compute_slowdown:.2f}, communication "
                 f"x{profile.overlap.comm_slowdown:.2f} while both run")
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


def profile_listing() -> list[dict]:
    """One row per available profile: name, where it lives, source, device, date (or the error)."""
    from autoplan.profile_store import available_profiles, load_profile, local_profile_dir, shipped_profile_dir

    shipped, local = shipped_profile_dir().resolve(), local_profile_dir().resolve()
    rows = []
    for name, path in available_profiles().items():
        location = "local" if path.resolve().parent == local else "shipped" if path.resolve().parent == shipped else "?"
        row = {"name": name, "location": location, "path": str(path)}
        try:
            profile = load_profile(str(path))
        except AutoplanError as exc:
            row["error"] = str(exc).splitlines()[0]
        else:
            row.update(source=profile.source, device=profile.provenance.device_name or profile.device_type,
                       device_type=profile.device_type, date=(profile.provenance.date or "")[:10],
                       host=profile.provenance.host or "", ops=len(profile.op_times),
                       collectives=len(profile.collectives))
        rows.append(row)
    return rows


def run_profiles(args: argparse.Namespace) -> int:
    from autoplan.profile_store import local_profile_dir

    rows = profile_listing()
    print(f"{'name':<20} {'where':<8} {'source':<10} {'type':<5} {'device':<30} {'date':<10} {'ops':>5} "
          f"{'coll':>5}")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:<20} {row['location']:<8} unreadable: {row['error']}")
            continue
        print(f"{row['name']:<20} {row['location']:<8} {row['source']:<10} {row['device_type']:<5} "
              f"{row['device'][:30]:<30} {row['date'] or '-':<10} {row['ops']:>5} {row['collectives']:>5}")
    print(f"\nlocal profiles live in {local_profile_dir()} (set $AUTOPLAN_PROFILE_DIR to change); "
          "`autoplan profile` writes one there")
    return 0
