"""The GPU kit's results (benchmarks/gpu_truth.py) summarised and printed: what the profile measured, the
fake-world memory grid (predicted peak against measured live tensors, CUDA's allocated and reserved
peaks, compute time) and the single-GPU runs. Plain functions over the results dict, so that a results
file brought back from a GPU machine can be read again here: `python benchmarks/gpu_truth_report.py FILE`."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

MB = 1e6


def _stats(values: list[float]) -> dict | None:
    """median and worst |value|, with the signed worst; None for no values."""
    if not values:
        return None
    worst = max(values, key=abs)
    return {"n": len(values), "median_abs": statistics.median(abs(v) for v in values), "worst": worst}


def _allocator_counts(rows: list[dict]) -> dict:
    counts: dict = {}
    for row in rows:
        for conf, run in (row.get("allocator") or {}).items():
            entry = counts.setdefault(conf, {"capped_runs": 0, "ran": 0, "out_of_memory": 0})
            entry["capped_runs"] += 1
            entry["ran"] += run.get("status") == "ran"
            entry["out_of_memory"] += run.get("status") == "out of memory"
    return counts


def summarize(results: dict) -> dict:
    """The numbers a reader wants first: memory error of the grid against the live peak and against CUDA's
    allocated peak, how far reserved runs above allocated, compute-time error, plans measured over their limit."""
    stages = results.get("stages", {})
    summary: dict = {}
    grid = [row for row in stages.get("grid", {}).get("rows", []) if row.get("status") == "ok"]
    if stages.get("grid"):
        summary["grid"] = {
            "runs": len(grid), "not_run": len(stages["grid"]["rows"]) - len(grid),
            "out_of_memory": sum(row.get("status") == "out of memory" for row in stages["grid"]["rows"]),
            "mem_error": _stats([row["mem_error"] for row in grid]),
            "allocated_error": _stats([(row["predicted_peak_bytes"] - row["cuda_max_allocated_bytes"])
                                       / row["cuda_max_allocated_bytes"] for row in grid
                                       if row.get("cuda_max_allocated_bytes")]),
            "reserved_over_allocated": _stats([row["cuda_max_reserved_bytes"] / row["cuda_max_allocated_bytes"] - 1
                                               for row in grid if row.get("cuda_max_allocated_bytes")]),
            "reserved_over_predicted": _stats([row["cuda_max_reserved_bytes"] / row["predicted_peak_bytes"] - 1
                                               for row in grid if row.get("cuda_max_reserved_bytes")]),
            "compute_error": _stats([row["predicted_compute_s"] / row["measured_compute_s"] - 1
                                     for row in grid if row.get("measured_compute_s")]),
            # the same by phase, where the rows have them (the kit since its sixth run)
            "phase_compute_error": {phase: _stats([row["predicted_phase_s"][phase] / row["measured_phase_s"][phase] - 1
                                                   for row in grid if (row.get("measured_phase_s") or {}).get(phase)
                                                   and (row.get("predicted_phase_s") or {}).get(phase)])
                                    for phase in ("forward", "backward", "optimizer")},
            "over_limit": sum(bool(row.get("over_limit")) for row in grid),
            # per allocator configuration: plans run capped at their needed bound, and how many ran there
            "allocator": _allocator_counts(stages["grid"]["rows"]),
        }
    compute = [row for row in stages.get("compute", {}).get("rows", []) if row.get("status") == "ok"]
    if stages.get("compute"):
        summary["compute"] = {"runs": len(compute),
                              "time_error": _stats([row["time_error"] for row in compute if "time_error" in row]),
                              "mem_error": _stats([row["mem_error"] for row in compute if "mem_error" in row])}
    return summary


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.1f}"


def _line(stats: dict | None, what: str) -> str:
    if not stats:
        return f"  {what}: -"
    return (f"  {what}: median |{100 * stats['median_abs']:.1f}%|, worst {100 * stats['worst']:+.1f}% "
            f"({stats['n']} runs)")


def _peak_lines(peak: dict | None) -> list[str]:
    """A missed peak's largest groups of blocks alive at it (autoplan.run.peak_blocks), a line each."""
    if not peak:
        return []
    if "error" in peak:
        return [f"      alive at the peak: not recorded ({peak['error'][:160]})"]
    return [f"      alive at the peak ({_mb(peak['peak_bytes'])} MB recorded, {peak['blocks']} blocks), largest:"] + [
        f"        {_mb(g['bytes']):>9} MB = {g['blocks']} x {_mb(g['block_bytes'])} MB  {g['where'][:150]}"
        for g in peak["groups"][:8]]


def format_results(results: dict) -> str:
    lines = ["autoplan GPU truth kit"]
    for run in results.get("runs", []):
        lines.append(f"  run {run['date']}: {run['device_name']} ({run['device']}), torch {run['torch']}, python "
                     f"{run['python']}, stages {','.join(run['stages'])}{' (quick)' if run['quick'] else ''}; "
                     f"packages: {run['packages']}")
    stages = results.get("stages", {})
    if "profile" in stages:
        p = stages["profile"]
        lines += ["", f"== profile: {p['status']} ({p['command']})"]
        if p["status"] == "ok":
            host = p["host_link"]
            flops = ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in p["peak_flops"].items())
            lines += [f"  {p['name']} in {p['wall_s']:.0f} s, written to {p['path']}; links from {p['links_from']}",
                      f"  best matmul: {flops}; copy {p['mem_bandwidth_bytes_s'] / 1e9:.1f} GB/s (read + write); "
                      f"AdamW {p['optimizer_bytes_s'] / 1e9:.1f} GB/s of state; {p['op_times']} ops, "
                      f"{p['op_fits']} fits",
                      f"  host link: {host['h2d_bytes_s'] / 1e9:.2f} GB/s to the device, "
                      f"{host['d2h_bytes_s'] / 1e9:.2f} back, overlaps compute: {host['overlaps_compute']}; host AdamW "
                      f"{host['cpu_optimizer_bytes_s'] / 1e9:.2f} GB/s with {host['cpu_threads']} threads",
                      f"  calibration fit, worst relative error: {p['calibration_fit_max_rel_err']}",
                      f"  selective checkpoint per working op: {p['fsdp'].get('selective_fwd_s_per_op', 0) * 1e6:.1f} "
                      f"us forward, {p['fsdp'].get('selective_bwd_s_per_op', 0) * 1e6:.1f} us backward (llama's "
                      f"block: 24 ops)"]
        else:
            lines.append("  " + (p.get("stderr_tail") or p.get("note") or "").strip().replace("\n", "\n  ")[-1500:])
    if "grid" in stages:
        grid = stages["grid"]
        lines += ["", f"== fake-world memory grid: rank 0 of {grid['world_size']} ranks, plans costed with "
                      f"{grid['profile']} (MB = 1e6 bytes; err = predicted / measured - 1)",
                  f"  {'model':<10} {'seq':>5} {'mb':>3} {'plan':<15} {'pred MB':>9} {'live MB':>9} {'err':>7} "
                  f"{'alloc MB':>9} {'err':>7} {'reserv MB':>9} {'res/alloc':>9} {'compute ms':>11} {'meas ms':>8}"]
        for r in grid["rows"]:
            head = f"  {r['model']:<10} {r['seq_len']:>5} {r['micro_batch']:>3} {r['plan']:<15}"
            for conf, run in (r.get("allocator") or {}).items():  # capped at the plan's needed bound under conf
                lines.append(f"{head} {conf}: {run.get('status')} capped at the needed bound "
                             f"{_mb(run.get('needed_bound_bytes'))} MB (reserved {_mb(run.get('reserved'))} MB, allocated "
                             f"{_mb(run.get('allocated'))} MB; reserved bound {_mb(run.get('predicted_reserved_bytes'))} MB)")
            if r.get("status") != "ok":
                lines.append(f"{head} {r.get('status')}" + (f": {r['note'][:120]}" if r.get("note") else ""))
                continue
            alloc, reserved = r.get("cuda_max_allocated_bytes"), r.get("cuda_max_reserved_bytes")
            alloc_err = (r["predicted_peak_bytes"] - alloc) / alloc if alloc else None
            lines.append(f"{head} {_mb(r['predicted_peak_bytes']):>9} {_mb(r['measured_peak_bytes']):>9} "
                         f"{_pct(r['mem_error']):>7} {_mb(alloc):>9} {_pct(alloc_err):>7} {_mb(reserved):>9} "
                         f"{reserved / alloc if alloc else float('nan'):>9.3f} {r['predicted_compute_s'] * 1e3:>11.1f} "
                         f"{r['measured_compute_s'] * 1e3:>8.1f}" + ("  OVER LIMIT" if r["over_limit"] else "")
                         + (f"  [{', '.join(r.get('decisions', []))}]" if r["plan"] == "autoplan" else ""))
            lines += _peak_lines(r.get("peak_blocks"))
    if "compute" in stages:
        lines += ["", "== single-GPU runs (`autoplan apply`, one rank), plans costed with "
                      f"{stages['compute']['profile']}",
                  f"  {'model':<10} {'seq':>5} {'mb':>3} {'pred step ms':>12} {'meas ms':>9} {'err':>7} {'pred MB':>9} "
                  f"{'meas MB':>9} {'err':>7}"]
        for r in stages["compute"]["rows"]:
            head = f"  {r['model']:<10} {r['seq_len']:>5} {r['micro_batch']:>3}"
            if r.get("status") != "ok":
                lines.append(f"{head} {r.get('status')}" + (f": {r['note'][:160]}" if r.get("note") else ""))
                continue
            lines.append(f"{head} {r['predicted_step_s'] * 1e3:>12.1f} {r['measured_step_s'] * 1e3:>9.1f} "
                         f"{_pct(r.get('time_error')):>7} {_mb(r['predicted_peak_bytes']):>9} "
                         f"{_mb(r['measured_peak_bytes']):>9} {_pct(r.get('mem_error')):>7}")
    if "checkpoint" in stages:
        c = stages["checkpoint"]
        lines += ["", f"== a block under each checkpoint mode: {c['model']}, micro-batch {c['micro_batch']} x "
                      f"{c['seq_len']} tokens, forward + backward, no FSDP ({c['blocks']} blocks against 1), beside "
                      f"{c['profile']}'s step model",
                  f"  {'mode':<10} {'meas ms':>9} {'pred ms':>9} {'err':>7}"]
        for r in c["rows"]:
            if r.get("status") != "ok":
                lines.append(f"  {r['mode']:<10} {r.get('status')}" + (f": {r['note'][:160]}" if r.get("note") else ""))
                continue
            error = (r["predicted_block_s"] - r["per_block_s"]) / r["per_block_s"] if r["per_block_s"] > 0 else None
            lines.append(f"  {r['mode']:<10} {r['per_block_s'] * 1e3:>9.2f} {r['predicted_block_s'] * 1e3:>9.2f} "
                         f"{_pct(error):>7}")
    summary = results.get("summary", {})
    if "grid" in summary:
        g = summary["grid"]
        lines += ["", f"summary, grid: {g['runs']} runs ({g['not_run']} not run, {g['out_of_memory']} out of memory), "
                      f"{g['over_limit']} measured over the plan's limit",
                  _line(g["mem_error"], "peak, predicted against live tensors"),
                  _line(g["allocated_error"], "peak, predicted against CUDA max_memory_allocated"),
                  _line(g["reserved_over_allocated"], "CUDA max_memory_reserved above max_memory_allocated"),
                  _line(g["reserved_over_predicted"], "CUDA max_memory_reserved above the predicted peak"),
                  _line(g["compute_error"], "compute time (collectives free), predicted against measured")]
        lines += [_line(stats, f"  in the {phase}") for phase, stats in (g.get("phase_compute_error") or {}).items()
                  if stats]
        for conf, n in g.get("allocator", {}).items():
            lines.append(f"  {conf}: {n['ran']} of {n['capped_runs']} plans ran capped at their needed bound "
                         f"({n['out_of_memory']} out of memory)")
    if "compute" in summary:
        c = summary["compute"]
        lines += [f"summary, single-GPU runs: {c['runs']} runs",
                  _line(c["time_error"], "step time, predicted against measured"),
                  _line(c["mem_error"], "peak, predicted against measured")]
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_results(json.loads(Path(sys.argv[1]).read_text())))
