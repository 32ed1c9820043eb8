"""`autoplan profiles`: the shipped and local device profiles, which one each `--profile` name picks, and
where each profile's figures come from.

A plan is only as good as its profile's numbers, so a user should see what stands behind them: a
measured profile's come from this machine, a datasheet profile's achievable figures from published
measurements, each named with its document and number in `provenance.sources`. The listing counts them;
`autoplan profiles NAME` (or `--verbose`, every profile) prints each figure's value and source.
`register(subparsers)` adds the subcommand without importing torch; printing happens here, reading is
autoplan.profile_store's."""

from __future__ import annotations

import argparse
import textwrap

from autoplan.errors import AutoplanError

__all__ = ["register", "run_profiles", "profile_listing", "format_sources"]

PROFILES_EXAMPLES = """examples:
  autoplan profiles
  autoplan profiles a100-sxm4-80gb                   # each figure of one profile, with its source
  autoplan profiles --verbose                        # the same for every profile
  AUTOPLAN_PROFILE_DIR=./my-profiles autoplan profiles
  autoplan search --model gpt2 --gpus 2 --mem 4GB --profile local:cpu-gloo-2   # a local one a shipped name hides
"""
SOURCE_WIDTH = 100  # wrap each source to this width under its figure


def register(subparsers) -> None:
    listing = subparsers.add_parser(
        "profiles", help="list the shipped and local device profiles and their figures' sources",
        description="Shipped profiles (datasheets with achievable figures from published measurements, and measured "
                    "ones that come with autoplan) and local ones (written by `autoplan profile`), with where each "
                    "came from, under the name that picks each with --profile. A shipped profile's name always picks "
                    "the shipped profile (a name means the same profile on every machine); a local profile of the "
                    "same name is listed as local:NAME, which picks it, as does its path. The sources column counts "
                    "the figures whose source the profile names; NAME or --verbose prints them.",
        epilog=PROFILES_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listing.add_argument("name", nargs="?", metavar="NAME",
                         help="one profile (a name, local:NAME or a path): each figure's value and source")
    listing.add_argument("-v", "--verbose", action="store_true",
                         help="after the listing, every profile's figures with their sources")
    listing.set_defaults(handler=run_profiles, subparser=listing)


def profile_listing() -> list[dict]:
    """One row per profile file: the name that picks it, where it lives, source, device, date, how many
    figures name their source (or the error), and a note where a shipped and a local profile share a name."""
    from autoplan.profile_store import LOCAL_PREFIX, load_profile, profile_entries

    entries = profile_entries()
    hidden = {entry.name for entry in entries if entry.shadowed}
    rows = []
    for entry in entries:
        row = {"name": entry.pick, "location": entry.location, "path": str(entry.path), "note": ""}
        if entry.shadowed:
            row["note"] = f"{entry.name} picks the shipped one"
        elif entry.name in hidden:
            row["note"] = f"a local one is {LOCAL_PREFIX}{entry.name}"
        try:
            profile = load_profile(str(entry.path))
        except AutoplanError as exc:
            row["error"] = str(exc).splitlines()[0]
        else:
            quick = bool(profile.provenance.settings.get("quick"))
            row.update(source="quick" if quick else profile.source,
                       device=profile.provenance.device_name or profile.device_type,
                       device_type=profile.device_type, date=(profile.provenance.date or "")[:10],
                       host=profile.provenance.host or "", ops=len(profile.op_times),
                       collectives=len(profile.collectives), sources=len(profile.provenance.sources))
        rows.append(row)
    return rows


def _value(path: str, value) -> str:
    """A figure's value as a reader takes it in: GB/s, microseconds, percent, bytes."""
    from autoplan.sizes import format_bytes

    if value is None:
        return "none"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, list) and path == "attention":  # measured rates: the range over its shapes
        rates = [rate["flops_s"] for rate in value]
        return f"{len(value)} shapes, {min(rates) / 1e12:.0f}-{max(rates) / 1e12:.0f} TFLOP/s" if rates else "none"
    if isinstance(value, list):  # collective fits: alpha and the bus bandwidth their beta holds
        from cost_models.comm import ring_factor

        return "; ".join(f"{f['collective']} x{f['group_size']} {f['scope']}: {f['alpha_s'] * 1e6:.1f} us, bus "
                         f"{ring_factor(f['collective'], f['group_size']) / max(f['beta_s_per_byte'], 1e-30) / 1e9:.1f}"
                         " GB/s" for f in value) or "none"
    if isinstance(value, dict):
        if path == "peak_flops":
            return ", ".join(f"{dtype} {flops / 1e12:.1f} TFLOP/s" for dtype, flops in value.items())
        return ", ".join(f"{k} {_value(k, v)}" for k, v in value.items()
                         if v is not None and not isinstance(v, (dict, list)))
    if path.endswith("bytes_s"):
        return f"{value / 1e9:.2f} GB/s"
    if path.endswith("_s"):
        return f"{value * 1e6:.1f} us"
    if path.endswith("efficiency"):
        return f"{value:.1%}"
    if path.endswith("bytes"):
        return format_bytes(value)
    return f"{value:g}"


def format_sources(profile) -> str:
    """Every figure of `profile` whose source it names: the figure, its value, the source wrapped below."""
    from autoplan.profile_store import sourced_figures

    lines = [f"{profile.name} ({profile.source}, {profile.provenance.device_name or profile.device_type})",
             textwrap.fill(profile.provenance.description, SOURCE_WIDTH, initial_indent="  ", subsequent_indent="  ")]
    figures = sourced_figures(profile)
    if not figures:
        lines.append("  no figure names its source (a profile measured before sources were recorded, or a "
                     "hand-written one): see the description above")
    for path, value, source in figures:
        lines.append(f"  {path}: {_value(path, value)}")
        lines.append(textwrap.fill(source, SOURCE_WIDTH, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def run_profiles(args: argparse.Namespace) -> int:
    from autoplan.profile_store import PRECEDENCE_RULE, load_profile, local_profile_dir

    if args.name:
        print(format_sources(load_profile(args.name)))
        return 0
    rows = profile_listing()
    width = max([len("name (--profile)")] + [len(row["name"]) for row in rows])
    print(f"{'name (--profile)':<{width}} {'where':<8} {'source':<10} {'type':<5} {'device':<30} {'date':<10} "
          f"{'ops':>5} {'coll':>5} {'sources':>7}  note")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:<{width}} {row['location']:<8} unreadable: {row['error']}")
            continue
        print(f"{row['name']:<{width}} {row['location']:<8} {row['source']:<10} {row['device_type']:<5} "
              f"{row['device'][:30]:<30} {row['date'] or '-':<10} {row['ops']:>5} {row['collectives']:>5} "
              f"{row['sources'] or '-':>7}  {row['note']}".rstrip())
    print(f"\n--profile NAME: {PRECEDENCE_RULE}.")
    print(f"local profiles live in {local_profile_dir()} (set $AUTOPLAN_PROFILE_DIR to change); "
          "`autoplan profile` writes one there")
    if args.verbose:
        for row in rows:
            if "error" not in row:
                print("\n" + format_sources(load_profile(row["path"])))
    else:
        print("sources: the figures whose source a profile names; `autoplan profiles NAME` prints them with their "
              "values, --verbose every profile's")
    return 0
