"""Deep stacks (issue 26): how planning time and memory grow with the number of layers of a tiny-width Hugging
Face Llama, and where the time goes; the target is 3000 layers planned in under 60 s.

    python benchmarks/deep_stack.py                         # 100, 300, 1000 layers (about 5 min here)
    python benchmarks/deep_stack.py --layers 3000 --mem-cap-gb 14

Each case writes a config.json (hidden 64, intermediate 128, 4 heads, 2 KV heads, vocabulary 256) and runs, in
a child process under a memory cap (RLIMIT_AS, so that a case that needs more fails with a MemoryError
rather than taking the machine's memory), `autoplan.trace` (building the model on meta and tracing it, the
stack by a few of its blocks: autoplan/tracing/reuse.py), the cost tables' per-model part
(`autoplan.solve.tables.CostTables`), and `autoplan.search` at --mem 1GB on 2 GPUs, sequence 32, each timed.
Printed per case: the phases' seconds, the whole (wall and CPU: on a shared machine the wall time stretches with
the load, and CP-SAT's time limit is wall-clock time), the peak RSS, the solver's status per micro-batch, or the
error that stopped it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = {3000: 60.0}

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import autoplan
from autoplan.solve.tables import CostTables
out = {"import_s": time.perf_counter() - t0}
try:
    t = time.perf_counter()
    traced = autoplan.trace("hf:" + sys.argv[1], seq_len=32)
    out["trace_s"] = time.perf_counter() - t
    out["ops"] = len(traced.traces("bf16").at_1.ops)
    t = time.perf_counter()
    CostTables(traced.module, 32, "bf16", "block", traces=traced.traces("bf16"))
    out["tables_s"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = autoplan.search(traced, "1GB", gpus=2)
    out["search_s"] = time.perf_counter() - t
    out["units"] = len(plan.units)
    out["sweep"] = [f"{e.micro_batch_size}:{e.status.lower()}" for e in plan.solver.micro_batch_sweep]
except BaseException as exc:  # a MemoryError under the cap, the solver's time running out
    out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
out["total_s"] = time.perf_counter() - t0
out["cpu_s"] = sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                               resource.RUSAGE_CHILDREN)))
out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT " + json.dumps(out))
"""


def write_config(folder: Path, layers: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_case(layers: int, cap_gb: float, scratch: Path) -> dict:
    folder = write_config(scratch / f"llama-{layers}", layers)

    def cap():
        limit = int(cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run([sys.executable, "-c", CHILD, str(folder)], cwd=REPO, capture_output=True, text=True,
                          preexec_fn=cap, check=False)  # noqa: PLW1509 - no threads here
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--mem-cap-gb", type=float, default=14.0, help="address-space cap per case (default 14)")
    args = parser.parse_args(argv)
    print(f"{'layers':>6} {'ops':>7} {'trace s':>8} {'tables s':>8} {'search s':>9} {'total s':>8} {'cpu s':>7} "
          f"{'RSS GB':>7}  sweep / error")
    with tempfile.TemporaryDirectory() as scratch:
        for layers in args.layers:
            r = run_case(layers, args.mem_cap_gb, Path(scratch))

            def cell(key, width, fmt="{:.1f}", r=r):
                return (fmt.format(r[key]) if key in r else "-").rjust(width)

            target = f" (target {TARGET_S[layers]:.0f} s)" if layers in TARGET_S else ""
            print(f"{layers:>6} {cell('ops', 7, '{}')} {cell('trace_s', 8)} {cell('tables_s', 8)} "
                  f"{cell('search_s', 9)} {cell('total_s', 8)} {cell('cpu_s', 7)} {cell('peak_rss_gb', 7)}  "
                  f"{' '.join(r.get('sweep', [])) or r.get('error', '')}{target}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
