"""Plans before and after a change: identical apart from wall time?

A refactoring must not move a single decision or predicted byte. This script runs the same
`autoplan search` and `autoplan estimate --json` commands (every zoo model at the README's and the
tests' settings) on a reference revision, checked out into a temporary git worktree, and on the
working tree, and compares the outputs with the solver's wall time taken out.

    python benchmarks/plan_identity.py --ref main~5        # compare with an earlier revision
    python benchmarks/plan_identity.py --ref main --only gpt2-tiny   # a subset (substring match)
    python benchmarks/plan_identity.py --ref main --decisions        # decisions only, not predictions

`--decisions` compares what a plan decides (micro-batch, accumulation, each unit's options) and leaves
the predicted figures out: for a change to the cost model that is meant to move predictions.

A change that prunes more of the search (a tighter bound) keeps the plan but not the record of what was
searched beside it: the solver's micro-batch sweep and meshes (`SEARCH_RECORD`), where a micro-batch or mesh
is listed as pruned rather than with the plan found there, and the size of the solver's model it reports. Such an output is reported as "same plan" with
the first difference in that record, and counts as identical.

Exit 0 when every output is identical (or the same plan), 1 when any differs (the first differing path is
printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (label, argv after `autoplan`): the README's commands, then every zoo model at a setting that plans
CASES: list[tuple[str, list[str]]] = [
    ("readme-gpt2-1.5b", ["search", "--model", "gpt2-1.5b", "--mem", "8GB"]),
    ("readme-llama2-70b-64", ["search", "--model", "llama2-70b", "--mem", "80GB", "--nodes", "8",
                              "--gpus-per-node", "8", "--profile", "h100-sxm-80gb"]),
    ("readme-gpt2-global", ["search", "--model", "gpt2", "--mem", "2GB", "--gpus", "2", "--seq-len", "128",
                            "--global-batch", "64"]),
    ("gpt2-medium", ["search", "--model", "gpt2-medium", "--mem", "6GB", "--seq-len", "1024"]),
    ("gpt2-large", ["search", "--model", "gpt2-large", "--mem", "10GB", "--seq-len", "1024"]),
    ("llama2-7b", ["search", "--model", "llama2-7b", "--mem", "40GB", "--seq-len", "2048"]),
    ("llama2-13b", ["search", "--model", "llama2-13b", "--mem", "60GB", "--seq-len", "2048"]),
    ("llama-1b", ["search", "--model", "llama-1b", "--mem", "16GB", "--seq-len", "2048"]),
    ("llama3-8b", ["search", "--model", "llama3-8b", "--mem", "80GB", "--seq-len", "4096"]),
    ("llama3-405b", ["search", "--model", "llama3-405b", "--mem", "80GB", "--nodes", "8", "--gpus-per-node", "8",
                     "--seq-len", "4096", "--profile", "h100-sxm-80gb"]),
    ("bert-large", ["search", "--model", "bert-large", "--mem", "4GB", "--gpus", "4"]),
    ("gpt2-tiny-cpu", ["search", "--model", "gpt2-tiny", "--mem", "40MB", "--gpus", "2", "--seq-len", "64",
                       "--profile", "cpu-gloo-2"]),
    ("llama-tiny-cpu", ["search", "--model", "llama-tiny", "--mem", "30MB", "--gpus", "2", "--seq-len", "64",
                        "--profile", "cpu-gloo-2"]),
    ("bert-tiny", ["search", "--model", "bert-tiny", "--mem", "60MB", "--gpus", "4", "--seq-len", "64"]),
    ("gpt2-tiny-fine", ["search", "--model", "gpt2-tiny", "--mem", "60MB", "--gpus", "4", "--seq-len", "64",
                        "--granularity", "fine", "--dtype", "fp32", "--optimizer", "sgd"]),
    ("llama-tiny-hybrid", ["search", "--model", "llama-tiny", "--mem", "60MB", "--nodes", "2", "--gpus-per-node", "2",
                           "--seq-len", "64", "--batch-size", "4"]),
    ("gpt2-tiny-strategy", ["search", "--model", "gpt2-tiny", "--mem", "1GB", "--gpus", "2", "--seq-len", "64",
                            "--strategy", "shard", "--checkpoint", "--profile", "cpu-gloo-2"]),
    ("estimate-gpt2-1.5b", ["estimate", "--model", "gpt2-1.5b", "--gpus", "8", "--strategy", "shard", "--checkpoint",
                            "--batch-size", "4", "--json"]),
    ("estimate-llama2-7b", ["estimate", "--model", "llama2-7b", "--gpus", "8", "--strategy", "replicate",
                            "--dtype", "bf16", "--optimizer", "sgd", "--seq-len", "1024", "--json"]),
    # tensor parallelism: fixed degrees, with and without sequence parallelism, and searched with the rest
    ("tp2-llama-tiny-cpu", ["search", "--model", "llama-tiny", "--mem", "30MB", "--gpus", "2", "--seq-len", "64",
                            "--profile", "cpu-gloo-2", "--tp", "2"]),
    ("tp4-sp-llama2-7b", ["search", "--model", "llama2-7b", "--mem", "40GB", "--seq-len", "4096", "--tp", "4",
                          "--sequence-parallel", "on", "--profile", "h100-sxm-80gb"]),
    ("tp-searched-llama3-8b", ["search", "--model", "llama3-8b", "--mem", "40GB", "--seq-len", "8192",
                               "--profile", "h100-sxm-80gb"]),
    ("tp2-fine-llama-1b", ["search", "--model", "llama-1b", "--mem", "16GB", "--seq-len", "2048", "--granularity",
                           "fine", "--tp", "2"]),
    # offload: chosen by the solver where nothing else fits, and asked for with a strategy
    ("offload-llama2-70b-8", ["search", "--model", "llama2-70b", "--mem", "40GB", "--gpus", "8", "--profile",
                              "h100-sxm-80gb", "--seq-len", "2048", "--tp", "1"]),
    ("strategy-offload", ["search", "--model", "gpt2-medium", "--mem", "8GB", "--strategy", "shard", "--offload",
                          "--profile", "h100-sxm-80gb"]),
    # selective checkpointing as a strategy, and pinned searches (a label, fields, a range)
    ("strategy-selective", ["search", "--model", "llama2-7b", "--mem", "40GB", "--strategy", "shard", "--checkpoint",
                            "selective"]),
    ("pinned-fields-llama2-13b", ["search", "--model", "llama2-13b", "--mem", "60GB", "--seq-len", "2048",
                                  "--pin", "layers.*=checkpoint=selective"]),
    ("pinned-range-gpt2-1.5b", ["search", "--model", "gpt2-1.5b", "--mem", "8GB", "--pin",
                                "transformer.h.0-11=shard+ckpt", "--pin", "transformer.h.40-47=checkpoint=none"]),
    # estimates: selective with offload, and a plan file of an earlier case (@plan:LABEL)
    ("estimate-selective-offload", ["estimate", "--model", "llama2-13b", "--gpus", "8", "--strategy", "shard",
                                    "--checkpoint", "selective", "--offload", "--profile", "h100-sxm-80gb", "--json"]),
    ("estimate-plan-gpt2-1.5b", ["estimate", "--plan", "@plan:readme-gpt2-1.5b", "--json"]),
    ("estimate-plan-offload", ["estimate", "--plan", "@plan:offload-llama2-70b-8", "--json"]),
    # pipelines: searched beside the meshes without one (most pruned), and a pipeline degree fixed
    ("pipelines-llama3-405b-256", ["search", "--model", "llama3-405b", "--mem", "80GB", "--nodes", "32",
                                   "--gpus-per-node", "8", "--profile", "h100-sxm-80gb", "--seq-len", "2048"]),
    ("pp4-llama2-70b", ["search", "--model", "llama2-70b", "--mem", "60GB", "--nodes", "4", "--gpus-per-node", "8",
                        "--profile", "h100-sxm-80gb", "--seq-len", "4096", "--pp", "4"]),
]

PLAN_REF = "@plan:"  # an argument naming the plan file of an earlier case

# fields that measure the machine, not the plan
VOLATILE = {"wall_time_s", "timing"}  # timing: plans since its section; wall_time_s: older ones
# the solver's record of what it searched beside the plan: what a tighter bound lists as pruned, and the size of
# the model it reports (b8797e3 on: the model that gave the plan; before it: the last micro-batch solved, which a
# sweep stopped by the memory floor no longer solves)
SEARCH_RECORD = ("micro_batch_sweep", "tp_degrees", "num_variables", "num_constraints")


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def run_cases(tree: Path, out_dir: Path, cases) -> dict[str, dict]:
    """Run every case with `tree`'s code; {label: output without volatile fields}."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    results = {}
    for label, argv in cases:
        plan_file = out_dir / f"{label}.json"
        # "@plan:LABEL": the plan file an earlier case wrote with this tree's code
        args = [str(out_dir / f"{a[len(PLAN_REF):]}.json") if a.startswith(PLAN_REF) else a for a in argv]
        if args[0] == "search":
            args += ["-o", str(plan_file)]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=tree, env=env,
                              capture_output=True, text=True)
        print(f"  {label:<24} exit {done.returncode}  {time.perf_counter() - start:5.1f} s", flush=True)
        if done.returncode != 0:
            results[label] = {"exit": done.returncode, "stderr": done.stderr.strip().splitlines()[-1:]}
            continue
        text = plan_file.read_text() if args[0] == "search" else done.stdout
        results[label] = _strip(json.loads(text))
    return results


def decisions(output: dict) -> dict:
    """What a plan decides (or an estimate's failure), without its predictions."""
    if "units" not in output or "training" not in output:
        return output
    keep = ("module", "sharding", "checkpoint", "offload", "reshard_after_forward")
    return {"training": {k: output["training"][k] for k in ("micro_batch_size", "grad_accum_steps")},
            "units": [{k: unit.get(k) for k in keep} for unit in output["units"]]}


def first_difference(a, b, path="") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}: only in {'after' if key not in a else 'before'}"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="the revision to compare with (default HEAD)")
    parser.add_argument("--only", help="run only the cases whose label contains this")
    parser.add_argument("--decisions", action="store_true", help="compare decisions only, not predictions")
    args = parser.parse_args()
    cases = [case for case in CASES if not args.only or args.only in case[0]]
    with tempfile.TemporaryDirectory(prefix="plan-identity-") as tmp:
        tmp = Path(tmp)
        worktree = tmp / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.ref], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            (tmp / "before").mkdir()
            (tmp / "after").mkdir()
            print(f"reference {args.ref}:")
            before = run_cases(worktree, tmp / "before", cases)
            print("working tree:")
            after = run_cases(ROOT, tmp / "after", cases)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    differing = same_plan = 0
    for label, _ in cases:
        a, b = before[label], after[label]
        found = first_difference(decisions(a), decisions(b)) if args.decisions else first_difference(a, b)
        record = found is not None and first_difference(without_record(a), without_record(b)) is None
        print(f"{label:<24} {'identical' if found is None else ('same plan, search record: ' if record else 'DIFFERS ')}"
              f"{found or ''}")
        differing += found is not None and not record
        same_plan += record
    print(f"{len(cases) - differing} of {len(cases)} identical"
          + (f" ({same_plan} the same plan with a different record of the search)" if same_plan else ""))
    return 1 if differing else 0


def without_record(output: dict) -> dict:
    """The output without the solver's record of what it searched beside the plan (`SEARCH_RECORD`)."""
    if not isinstance(output.get("solver"), dict):
        return output
    return {**output, "solver": {k: v for k, v in output["solver"].items() if k not in SEARCH_RECORD}}


if __name__ == "__main__":
    raise SystemExit(main())
