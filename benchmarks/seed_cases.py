"""The founding documents' memory cases, planned and estimated: what autoplan predicts beside what the
FSDP guide measured (../shared/seeds/fsdp-sharding-guide.md, 8 x A100-80GB, Hugging Face Llama-2,
pure bf16, AdamW, sequence 1024, units of about 100M parameters).

    python benchmarks/seed_cases.py            # prints one row per case; about a minute

The guide's "valley" is what stays allocated after a step (parameters, gradients, optimizer states);
autoplan's is the same categories at its optimizer-step point. The guide wraps units by parameter
count (100M), which for Llama-2 is close to autoplan's `--granularity fine` (attention and MLP
apart); the rows use it. The guide ran Hugging Face's LlamaForCausalLM; autoplan's zoo Llama is
traced in its place (see `autoplan models` for what it follows).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import autoplan

GB = 1e9
A100 = "a100-sxm4-80gb"
H100 = "h100-sxm-80gb"
SEVEN_B = dict(gpus=8, dtype="bf16", seq_len=1024, batch_size=10, profile=A100, granularity="fine")
SEVENTY_B = dict(gpus=8, dtype="bf16", seq_len=1024, batch_size=2, profile=A100, granularity="fine")


def _estimate_row(name: str, model: str, measured: tuple[float, float] | None, **fields) -> dict:
    est = autoplan.estimate(model, "shard", **fields)
    p = est.predicted
    return {"case": name, "valley_gb": est.model_state_bytes / GB, "peak_gb": p.peak_mem_bytes / GB,
            "host_per_node_gb": p.host_mem_per_node_bytes / GB, "step_s": p.step_time_s,
            "measured_valley_gb": measured[0] if measured else None,
            "measured_peak_gb": measured[1] if measured else None}


def _search_row(name: str, model: str, mem: str, **fields) -> dict:
    start = time.perf_counter()
    plan = autoplan.search(model, mem, **fields)
    wall = time.perf_counter() - start
    labels = [u.label for u in plan.units]
    counts = {label: labels.count(label) for label in dict.fromkeys(labels)}
    p = plan.predicted
    return {"case": name, "peak_gb": p.peak_mem_bytes / GB, "host_per_node_gb": p.host_mem_per_node_bytes / GB,
            "step_s": p.step_time_s, "tokens_s_per_gpu": p.throughput_tokens_s / plan.cluster.world_size,
            "decisions": counts, "solver_s": plan.solver_wall_time_s, "search_s": wall}


def cases() -> list[dict]:
    rows = [
        _estimate_row("llama2-7b 8xA100 mb10, all shard", "llama2-7b", (8.0, 74.0), **SEVEN_B),
        _estimate_row("llama2-7b 8xA100 mb10, all shard+offload", "llama2-7b", (1.4, 68.7), offload=True, **SEVEN_B),
        _estimate_row("llama2-70b 8xA100 mb2, all shard+offload", "llama2-70b", (0.3, 72.3), offload=True,
                      **SEVENTY_B),
        _search_row("llama2-70b 8xA100 mb2, search under 80GB", "llama2-70b", "80GB", **SEVENTY_B),
        _search_row("llama3-405b 8x8 H100 seq 4096 mb1, search under 80GB", "llama3-405b", "80GB", nodes=8,
                    gpus_per_node=8, seq_len=4096, batch_size=1, profile=H100),
        _search_row("gpt2-1.5b 8xA100, search under 8GB (README)", "gpt2-1.5b", "8GB"),
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = parser.parse_args(argv)
    rows = cases()
    for row in rows:
        if "measured_peak_gb" in row:
            measured = (f"guide measured {row['measured_valley_gb']:.1f} / {row['measured_peak_gb']:.1f} GB "
                        f"(peak {100 * (row['peak_gb'] / row['measured_peak_gb'] - 1):+.1f}%)")
            print(f"{row['case']:<58} valley/peak {row['valley_gb']:5.2f} / {row['peak_gb']:5.2f} GB; "
                  f"host {row['host_per_node_gb']:6.1f} GB/node; {measured}")
        else:
            decisions = ", ".join(f"{n} x {label}" for label, n in row["decisions"].items())
            print(f"{row['case']:<58} peak {row['peak_gb']:5.2f} GB; host {row['host_per_node_gb']:6.1f} GB/node; "
                  f"step {row['step_s']:.2f} s, {row['tokens_s_per_gpu']:,.0f} tokens/s/GPU; solver "
                  f"{row['solver_s']:.2f} s\n    {decisions}")
    if args.json:
        with tempfile.NamedTemporaryFile("w", dir=Path(args.json).resolve().parent, delete=False) as tmp:
            json.dump(rows, tmp, indent=2)
        Path(tmp.name).replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
