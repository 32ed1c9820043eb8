"""Published, measured FSDP runs beside `autoplan estimate` of the same configuration.

Every row of benchmarks/published_runs.py (torchtitan's A100 runs, llm-foundry's A100 80GB, A100 40GB and
H100 tables, fms-fsdp's A100 and H100 clusters; each with its source) is estimated as the source ran it:
the same model shapes, world and node size, micro-batch and accumulation, sequence, precision and
checkpointing (torchtitan's selective-op policy is autoplan's `selective_op` mode; its selective-layer
runs pin every other block to full checkpointing), on the profile of its GPU, with the source's network
between nodes where it gives one. Printed: the published tokens/s per GPU beside the predicted and the
error, the plan's MFU, whether the run fits, and the error over all rows, the rows the model was fitted on
and the held-out ones.

    python benchmarks/published.py                      # the table, from this tree (about 2 minutes)
    python benchmarks/published.py --ref main           # and the same rows with another revision's code
    python benchmarks/published.py --only tt-           # a subset (id substring)

An older revision lacks some of what the rows need; it runs them with what it has, and the row says so:
a checkpoint mode it does not know as `selective`, a profile it does not ship as the row's fallback, a
precision as `bf16-mixed`. Results go to benchmarks/results/published.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "published.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_runs import RUNS, SOURCES, PublishedRun  # noqa: E402

TARGET_MEDIAN, TARGET_WORST = 0.10, 0.20
FIT = ROOT / "benchmarks" / "results" / "published_fit.json"
GOLDEN = (math.sqrt(5) - 1) / 2
# the profiles one fitted scale serves: the runs of the first are fitted on; the others' parts take it (the same
# architecture and software; no published run of theirs was found)
FAMILIES = {"ampere": ("a100-sxm4-80gb", "a100-sxm4-40gb"),
            "hopper": ("h100-sxm-80gb", "h200-sxm-141gb", "h100-pcie-80gb", "h100-nvl-94gb")}


def _every_other_block(traced) -> list[str]:
    """torchtitan's selective-layer checkpointing as pins: blocks 1, 3, 5, ... fully checkpointed."""
    blocks = sorted({int(name.split(".")[1]) for name, _ in traced.module.named_modules()
                     if name.count(".") == 1 and name.split(".")[1].isdigit()})
    prefix = next(name.split(".")[0] for name, _ in traced.module.named_modules() if name.count(".") == 1
                  and name.split(".")[1].isdigit())
    return [f"{prefix}.{','.join(str(b) for b in blocks if b % 2 == 1)}=shard+ckpt"]


def _profile_variant(name: str, run: PublishedRun, folder: Path, scale: float | None) -> str:
    """A copy of profile `name` with the run's network between nodes (NICs per node x what each delivers) and,
    given a `scale`, that in-step compute scale (fwd, bwd and recompute alike: what --fit tries)."""
    from autoplan.profile_store import load_profile
    from cost_models.comm import ring_factor

    data = load_profile(name).model_dump()
    if run.network:
        nics, per_nic = run.network
        if data.get("topology"):
            data["topology"].update(nics_per_node=nics, nic_bytes_s=per_nic)
        else:  # an older profile: whole-node rings in the inter-node fits, one GPU's share in the link
            data["links"]["inter_node"]["bus_bandwidth_bytes_s"] = nics * per_nic / run.gpus_per_node
            for fit in data["collectives"]:
                if fit["scope"] == "inter_node":
                    fit["beta_s_per_byte"] = ring_factor(fit["collective"], fit["group_size"]) / (nics * per_nic)
    if scale is not None:
        data["fsdp"].update(compute_fwd_scale=scale, compute_bwd_scale=scale, compute_recompute_scale=None)
    data["name"] = f"{name}-{run.id}"
    path = folder / f"{data['name']}.json"
    path.write_text(json.dumps(data))
    return str(path)


def predict(run: PublishedRun, traced, folder: Path, scale: float | None = None) -> dict:
    """autoplan's estimate of one run, with what this tree's autoplan lacks replaced (and said)."""
    import autoplan
    from autoplan.profile_store import available_profiles
    from cost_models.options import CHECKPOINT_MODES, PRECISIONS

    substituted = []
    profile = run.profile
    if profile not in available_profiles():
        profile = run.fallback_profile
        substituted.append(f"profile {run.profile} -> {profile}")
    if run.network or scale is not None:
        profile = _profile_variant(profile, run, folder, scale)
    checkpoint, pins = run.checkpoint, []
    if checkpoint == "every_other_block":
        checkpoint, pins = "none", _every_other_block(traced)
    if checkpoint not in CHECKPOINT_MODES:
        substituted.append(f"checkpoint {checkpoint} -> selective")
        checkpoint = "selective"
    precision = run.precision
    if precision not in PRECISIONS:
        substituted.append(f"precision {precision} -> bf16-mixed")
        precision = "bf16-mixed"
    estimate = autoplan.estimate(
        traced, run.strategy, checkpoint=checkpoint, gpus=run.gpus, nodes=run.nodes, gpus_per_node=run.gpus_per_node,
        profile=profile, seq_len=run.seq_len, batch_size=run.micro_batch, dtype=precision, pin=pins or None,
        global_batch=run.micro_batch * run.grad_accum * run.gpus, allow_over_device_mem=True)
    predicted = estimate.predicted
    tokens = run.micro_batch * run.grad_accum * run.seq_len
    return {"id": run.id, "step_time_s": predicted.step_time_s, "tokens_s_gpu": tokens / predicted.step_time_s,
            "fits": bool(estimate.fits), "peak_bytes": predicted.peak_mem_bytes,
            "mfu": getattr(predicted, "mfu", None), "substituted": substituted}


def worker(ids: list[str], out: Path) -> None:
    """Estimate the runs `ids` with the autoplan on sys.path; write their predictions to `out`."""
    import autoplan

    rows, cache = [], {}
    with tempfile.TemporaryDirectory(prefix="published-") as folder:
        for run in (r for r in RUNS if r.id in ids):
            key = (run.model, run.seq_len)
            if key not in cache:
                cache[key] = autoplan.trace(run.model, seq_len=run.seq_len)
            try:
                rows.append(predict(run, cache[key], Path(folder)))
            except Exception as exc:  # a row this tree cannot estimate: recorded, the others go on
                rows.append({"id": run.id, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {run.id:<22} {rows[-1].get('tokens_s_gpu', rows[-1].get('error'))}", file=sys.stderr, flush=True)
    out.write_text(json.dumps(rows))


def fit_scales(runs: list[PublishedRun], out: Path) -> dict:
    """Per GPU family, the in-step compute scale (FsdpOverhead.compute_*_scale) that best fits the family's
    runs not held out: least squares of log(predicted / published), golden-section search over [1, 2]. The
    model's physical parts stay as the profiles source them; the scale holds what none of them prices (see
    benchmarks/RESULTS.md section 15). Written to `out`, which benchmarks/sourced_profiles.py reads."""
    import autoplan

    cache, results = {}, {}
    with tempfile.TemporaryDirectory(prefix="published-fit-") as folder:
        def objective(rows, scale):
            total = 0.0
            for run in rows:
                key = (run.model, run.seq_len)
                if key not in cache:
                    cache[key] = autoplan.trace(run.model, seq_len=run.seq_len)
                total += math.log(predict(run, cache[key], Path(folder), scale)["tokens_s_gpu"] / run.tokens_s_gpu) ** 2
            return total

        for family, profiles in FAMILIES.items():
            rows = [r for r in runs if not r.held_out and r.profile in profiles and r.tokens_s_gpu]
            low, high = 1.0, 2.0
            for _ in range(16):  # golden section: the bracket shrinks to 1.0 x 0.618^16 = 0.0005
                a, b = high - GOLDEN * (high - low), low + GOLDEN * (high - low)
                if objective(rows, a) <= objective(rows, b):
                    high = b
                else:
                    low = a
            scale = round((low + high) / 2, 3)
            results[family] = {"scale": scale, "profiles": list(profiles), "runs": [r.id for r in rows]}
            print(f"{family}: in-step compute scale {scale} from {len(rows)} runs ({', '.join(r.id for r in rows)})",
                  file=sys.stderr, flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def run_tree(tree: Path, ids: list[str]) -> dict[str, dict]:
    """The predictions of `tree`'s code, in a child process that imports autoplan from there."""
    with tempfile.TemporaryDirectory(prefix="published-out-") as scratch:
        out = Path(scratch) / "rows.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree), "--out", str(out),
                   "--ids", ",".join(ids)]
        done = subprocess.run(command, cwd=tree, env={**__import__("os").environ, "PYTHONPATH": str(tree)})
        if done.returncode != 0:
            raise SystemExit(f"published: the estimates with {tree}'s code failed (exit {done.returncode})")
        return {row["id"]: row for row in json.loads(out.read_text())}


def error(run: PublishedRun, row: dict) -> float | None:
    if run.tokens_s_gpu is None or "tokens_s_gpu" not in row:
        return None
    return row["tokens_s_gpu"] / run.tokens_s_gpu - 1


def summary(runs: list[PublishedRun], rows: dict[str, dict], label: str) -> str:
    errors = [abs(e) for run in runs if (e := error(run, rows[run.id])) is not None]
    wrong_fit = [run.id for run in runs if rows[run.id].get("fits") is not None and rows[run.id]["fits"] != run.fits]
    if not errors:
        return f"{label}: no rows"
    return (f"{label}: {len(errors)} rows, |error| median {statistics.median(errors):.1%}, worst {max(errors):.1%}; "
            f"fit disagrees: {', '.join(wrong_fit) or 'none'}")


def table(runs: list[PublishedRun], columns: dict[str, dict[str, dict]]) -> str:
    head = f"{'id':<22} {'model':<18} {'gpus':>4} {'mbxga':>6} {'seq':>5} {'ckpt':<17} {'published':>9}"
    for name in columns:
        head += f" | {name + ' tok/s':>14} {'err':>7} {'MFU':>5} {'fits':>4}"
    lines = [head]
    for run in runs:
        line = (f"{run.id:<22} {run.published_model:<18} {run.gpus:>4} {f'{run.micro_batch}x{run.grad_accum}':>6} "
                f"{run.seq_len:>5} {run.checkpoint:<17} {run.tokens_s_gpu or 'OOM':>9}")
        for rows in columns.values():
            row = rows[run.id]
            if "error" in row:
                line += f" | {'error':>14} {'':>7} {'':>5} {'':>4}"
                continue
            err = error(run, row)
            mfu = f"{row['mfu']:.0%}" if row.get("mfu") is not None else "-"
            fits = ("yes" if row["fits"] else "no") + ("" if row["fits"] == run.fits else "!")
            line += f" | {row['tokens_s_gpu']:>14.0f} {f'{err:+.1%}' if err is not None else '-':>7} {mfu:>5} {fits:>4}"
        lines.append(line + (" *" if any(rows[run.id].get("substituted") for rows in columns.values()) else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="also estimate the rows with this revision's code (a temporary worktree)")
    parser.add_argument("--only", help="only the rows whose id contains this")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--fit", action="store_true", help=f"fit each GPU family's in-step compute scale on the runs "
                        f"not held out, into {FIT.relative_to(ROOT)} (benchmarks/sourced_profiles.py --write takes it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(args.tree))
        worker(args.ids.split(","), args.out)
        return 0
    runs = [run for run in RUNS if not args.only or args.only in run.id]
    if args.fit:
        fit_scales(runs, FIT)
        return 0
    ids = [run.id for run in runs]
    columns: dict[str, dict[str, dict]] = {}
    if args.ref:
        with tempfile.TemporaryDirectory(prefix="published-ref-") as tmp:
            worktree = Path(tmp) / "ref"
            subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.ref], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                print(f"reference {args.ref}:", file=sys.stderr)
                columns[args.ref] = run_tree(worktree, ids)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    print("working tree:", file=sys.stderr)
    columns["now"] = run_tree(ROOT, ids)
    print(table(runs, columns))
    for name, rows in columns.items():
        print(f"\n{name}:")
        print("  " + summary(runs, rows, "all rows"))
        print("  " + summary([r for r in runs if not r.held_out], rows, "fitted on"))
        print("  " + summary([r for r in runs if r.held_out], rows, "held out"))
        for run in runs:
            if rows[run.id].get("substituted"):
                print(f"  * {run.id}: {'; '.join(rows[run.id]['substituted'])}")
    print("\nsources:\n" + "\n".join(f"  {key}: {text}" for key, text in SOURCES.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": [asdict(run) for run in runs], "predictions": columns}, indent=1) + "\n")
    now = columns["now"]
    errors = [abs(e) for run in runs if (e := error(run, now[run.id])) is not None]
    met = (errors and statistics.median(errors) <= TARGET_MEDIAN and max(errors) <= TARGET_WORST
           and all(now[run.id].get("fits") == run.fits for run in runs))
    print(f"\ntarget (median <= {TARGET_MEDIAN:.0%}, worst <= {TARGET_WORST:.0%}, every fit as published): "
          f"{'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
