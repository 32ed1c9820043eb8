"""Deep stacks (issue 26): how planning time and memory grow with the number of layers of a tiny-width Hugging
Face Llama, through the CLI; the target is 3000 layers planned in under 60 s.

    python benchmarks/deep_stack.py                          # 300, 1000, 3000 layers (about 5 min here)
    python benchmarks/deep_stack.py --layers 3000 --ref main # ... and the same commands on main, side by side

Each case writes a config.json (hidden 64, intermediate 128, 4 heads, 2 KV heads, vocabulary 256) and runs

    autoplan search --model hf:DIR/config.json --mem 1GB --gpus 2 --seq-len 32 -o plan.json

as a user would, in a child process under a memory cap (RLIMIT_AS, so that a case that needs more fails with a
MemoryError rather than taking the machine's memory) and with a trace cache of its own (a cold cache: the
model's first command). Printed per case: the CPU seconds of the command (user + system, its children
included: on a shared machine the wall time stretches with the load, the CPU time much less), its wall time,
its peak RSS, the solver's status per micro-batch, or the error that stopped it. With --ref, each case runs on
that revision too (checked out in a temporary git worktree, with this environment's packages), one after the
other, and the line says whether both wrote the same plan (its decisions, predictions and baselines).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = {3000: 60.0}
COMPARED = ("units", "predicted", "baselines", "training", "cluster")  # what "the same plan" compares


def write_config(folder: Path, layers: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_case(layers: int, tree: Path, cap_gb: float, scratch: Path, label: str) -> dict:
    """The CLI's search of the `layers`-deep stack with `tree`'s autoplan: CPU and wall seconds, peak RSS, the plan."""
    folder = write_config(scratch / f"llama-{layers}", layers)
    out = scratch / f"plan-{layers}-{label}.json"
    env = dict(os.environ, PYTHONPATH=str(tree), AUTOPLAN_CACHE_DIR=str(scratch / f"cache-{layers}-{label}"))
    argv = [sys.executable, "-m", "autoplan", "search", "--model", f"hf:{folder / 'config.json'}", "--mem", "1GB",
            "--gpus", "2", "--seq-len", "32", "-o", str(out)]

    def cap():
        limit = int(cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with open(scratch / f"log-{layers}-{label}.txt", "w+") as log:
        start = time.perf_counter()
        child = subprocess.Popen(argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,  # noqa: S603
                                 preexec_fn=cap)  # noqa: PLW1509 - no threads here
        _, status, usage = os.wait4(child.pid, 0)  # this child's own usage (its children included once reaped)
        child.returncode = os.waitstatus_to_exitcode(status)
        result = {"wall_s": time.perf_counter() - start, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "peak_rss_gb": usage.ru_maxrss / 2**20, "rc": child.returncode}
        log.seek(0)
        lines = [line for line in log.read().splitlines() if not line.startswith("autoplan: mesh")]
    if child.returncode != 0 or not out.is_file():
        result["error"] = f"exit {child.returncode}: {lines[-1] if lines else ''}"[:300]
        return result
    plan = json.loads(out.read_text())
    result["sweep"] = [f"{e['micro_batch_size']}:{e['status'].lower()}" for e in plan["solver"]["micro_batch_sweep"]]
    result["samples_s"] = plan["predicted"]["throughput_samples_s"]
    result["plan"] = {key: plan.get(key) for key in COMPARED}
    return result


def _line(layers: int, label: str, r: dict) -> str:
    def cell(key, width, fmt="{:.1f}"):
        return (fmt.format(r[key]) if key in r else "-").rjust(width)

    target = f" (target {TARGET_S[layers]:.0f} s)" if layers in TARGET_S else ""
    return (f"{layers:>6} {label:>10} {cell('cpu_s', 7)} {cell('wall_s', 7)} {cell('peak_rss_gb', 7, '{:.2f}')} "
            f"{cell('samples_s', 9)}  {' '.join(r.get('sweep', [])) or r.get('error', '')}{target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[300, 1000, 3000])
    parser.add_argument("--ref", help="also run each case on this revision (a temporary git worktree)")
    parser.add_argument("--mem-cap-gb", type=float, default=14.0, help="address-space cap per case (default 14)")
    args = parser.parse_args(argv)
    print(f"{'layers':>6} {'revision':>10} {'cpu s':>7} {'wall s':>7} {'RSS GB':>7} {'samples/s':>9}  sweep / error",
          flush=True)
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        trees = [("this", REPO)]
        if args.ref:
            ref = scratch / "ref"
            subprocess.run(["git", "worktree", "add", "--detach", str(ref), args.ref], cwd=REPO, check=True,
                           capture_output=True)
            trees.append((args.ref, ref))
        try:
            for layers in args.layers:
                results = {}
                for label, tree in trees:
                    results[label] = run_case(layers, tree, args.mem_cap_gb, scratch, label.replace("/", "_"))
                    print(_line(layers, label, results[label]), flush=True)
                if len(results) == 2:
                    mine, theirs = results.values()
                    same = "plan" in mine and mine.get("plan") == theirs.get("plan")
                    ratio = f"{theirs['cpu_s'] / mine['cpu_s']:.2f}x fewer CPU s" if mine.get("cpu_s") else ""
                    print(f"{'':>6} {'':>10} {ratio}; {'the same plan' if same else 'plans differ'}", flush=True)
        finally:
            if args.ref:
                subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "ref")], cwd=REPO,
                               capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
