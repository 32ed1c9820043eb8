"""The shipped GPU profiles' achievable figures, each read from a published measurement, and their sources.

A datasheet peak is not what a GPU reaches: a large bf16 matmul runs at 80-87% of it, an HBM copy at
79-87%, NCCL's bus bandwidth at what the links give after protocol overhead. This script holds the
published numbers (documents, tables, the figures quoted from them), derives the profile figures from
them (efficiency = achieved / datasheet peak; alpha-beta fits of published nccl-tests curves with the
same fit `autoplan profile` uses, autoplan/profiling/fit.py), prints old beside new with the source, and
with --write puts them and their sources (`provenance.sources`) into profiles/*.json. A figure for which
no published measurement was found keeps its old value, and its source says so.

    python benchmarks/sourced_profiles.py            # the table: figure, old, new, source; fit errors
    python benchmarks/sourced_profiles.py --write    # update profiles/*.json

Scope of the inter-node figures: a DGX-style node of 8 GPUs with one NIC per GPU (rail-optimised).
A collective whose ring spans whole nodes (FSDP's all-gather and reduce-scatter over the world) crosses
nodes through all 8 NICs at once, so its bus bandwidth is the node's aggregate (NVIDIA measures 192 GB/s
all-reduce bus bandwidth between DGX A100s with 8x200 Gb/s, against 22 GB/s in the old profile: the issue's
"too pessimistic"); a group of one rank per node (HSDP's replica all-reduce, 8 such groups side by side)
gets one NIC each. The schema keys collectives by (collective, group size, scope) only, so the aggregate
goes into the all-gather and reduce-scatter fits (always whole-node rings) and the per-NIC rate stays in
`links.inter_node`, which prices the inter-node all-reduce: right for HSDP's replica groups, pessimistic
(8x) for a replicate-only (DDP) plan across nodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_figures import KEEP, extra_figures, fitted_scale_rows, new_profile_figures  # noqa: E402

from autoplan.profile_store import save_profile  # noqa: E402
from autoplan.profiling.fit import fit_affine, relative_errors  # noqa: E402
from cost_models.comm import ring_factor  # noqa: E402
from cost_models.profile import DeviceProfile  # noqa: E402

PROFILES = ROOT / "profiles"
GB = 1e9
GiB = 1 << 30
TiB = 1 << 40

# --- published documents (cited by key) -----------------------------------------------------------------
DOCS = {
    "mamf": "stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
            "table' (BF16, torch matmul, mean of 100 iterations, best shape found)",
    "azure-a100": "Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md (8x A100-SXM4-80GB, CUDA 12.5, "
                  "NCCL 2.18.5)",
    "azure-h100": "Azure/AI-benchmarking-guide, 'Azure Results/ND_H100_v5_results.md' (8x H100 80GB HBM3, CUDA 12.6, "
                  "NCCL 2.18.5)",
    "gpuinspector-v100": "pc2/GPUInspector.jl, docs/src/devices/v100_sxm2.md (Tesla V100-SXM2-32GB, CUDA 11.6)",
    "gpuinspector-a100": "pc2/GPUInspector.jl, docs/src/devices/a100_sxm2.md (A100-SXM4-40GB in a DGX-A100)",
    "markidis": "Markidis et al., 'NVIDIA Tensor Core Programmability, Performance & Precision', IPDPSW 2018",
    "nccl-812": "NVIDIA/nccl issue #812, comment by AddyLaddy (NVIDIA), 2023-03-31",
    "nccl-412": "NVIDIA/nccl issue #412, comment by sjeaugey (NVIDIA), 2023-04-24",
    "nccl-tests-149": "NVIDIA/nccl-tests issue #149, comment by sjeaugey (NVIDIA), 2023-07-05",
    "nccl-tests-212": "NVIDIA/nccl-tests issue #212, comment by sjeaugey (NVIDIA), 2024-05-06",
    "nccl-tests-326": "NVIDIA/nccl-tests issue #326, comment by sjeaugey (NVIDIA), 2025-06-24",
    "nccl-tests-290": "NVIDIA/nccl-tests issue #290, comment by AddyLaddy (NVIDIA), 2025-03-03",
    "nvbandwidth-53": "NVIDIA/nvbandwidth issue #53 (8x A100-SXM4-80GB, PCIe 4.0, nvbandwidth v0.8)",
    "busbw": "NVIDIA/nccl-tests doc/PERFORMANCE.md: bus bandwidth is defined so that it compares with the "
             "hardware's link bandwidth whatever the collective and number of ranks",
    "dgx-a100": "NVIDIA DGX A100 datasheet: system memory 1 TB (DGX A100 320GB) or 2 TB (DGX A100 640GB, the "
                "80 GB GPUs); 2x AMD EPYC 7742, 128 cores",
    "dgx-h100": "NVIDIA DGX H100 datasheet: system memory 2 TB; 2x Xeon Platinum 8480C, 112 cores",
    "dgx1": "NVIDIA DGX-1 (V100) specifications: system memory 512 GB DDR4 (as listed in run.ai's DGX guide, "
            "www.run.ai/guides/nvidia-a100/nvidia-dgx)",
}

# published nccl-tests all-reduce bus bandwidth (GB/s, in-place) on one 8-GPU node, by message size
# 2**10 .. 2**33 bytes (the documents label them 1K, 2K, ..., 65K, 132K, ..., 8G)
ALL_REDUCE_8GPU = {
    "azure-a100": [0.04, 0.08, 0.17, 0.33, 0.67, 1.37, 2.70, 5.15, 10.11, 19.24, 36.22, 53.54, 71.43, 89.99,
                   109.22, 132.77, 166.63, 174.18, 213.87, 221.58, 228.10, 230.22, 230.48, 231.58],
    "azure-h100": [0.07, 0.14, 0.27, 0.53, 0.95, 1.71, 2.72, 5.40, 10.86, 21.35, 43.70, 81.93, 128.73, 172.13,
                   234.45, 295.53, 361.78, 400.61, 423.38, 438.46, 466.35, 472.36, 475.54, 478.87],
}
FIT_FROM_BYTES = 4 << 20  # fit the curve from 4 MiB up: FSDP units' collectives are MBs to GBs
NODE_GPUS = 8  # the DGX node the inter-node figures describe (8 GPUs, 8 NICs)

CPU_ADAMW_ASSUMED = ("assumption, no published figure found for torch's AdamW on a DGX host: the one-thread rate "
                     "`autoplan profile` measured on this project's CPU machine (profiles/cpu-gloo-2.json, "
                     "optimizer_bytes_s 10.9 GB/s of state); a DGX host gives each of its 8 ranks 14-16 cores, "
                     "so this is a lower bound; `autoplan profile --device cuda` measures it "
                     "(autoplan/profiling/host_link.py)")
CPU_ADAMW_BYTES_S = 10946417501.368807  # profiles/cpu-gloo-2.json optimizer_bytes_s
NOT_FOUND = "no published measurement found; kept the earlier value ({old})"
HALF_ALPHA = ("half the intra-node all-reduce fit's alpha (a ring all-reduce is a reduce-scatter followed by an "
              "all-gather; on H100 the all-reduce runs NVLink SHARP, so there it is an approximation)")
DESCRIPTION = ("{device} datasheet peaks (peak_flops, mem_bandwidth_bytes_s, mem_bytes) with achievable figures read "
               "from published measurements: efficiencies, NCCL bus bandwidths and collective fits, the host link; "
               "provenance.sources names the document and number behind each (benchmarks/sourced_profiles.py "
               "derives them). Figures no published measurement was found for keep their earlier order-of-magnitude "
               "defaults, and their sources say so.")


@dataclass(frozen=True)
class Curve:
    doc: str
    collective: str
    group: int

    def points(self) -> list[tuple[float, float]]:
        """(message bytes, seconds) from the published bus bandwidth: time = bytes / algbw, algbw = busbw / factor."""
        factor = ring_factor(self.collective, self.group)
        return [(2.0 ** (10 + i), 2.0 ** (10 + i) * factor / (busbw * GB))
                for i, busbw in enumerate(ALL_REDUCE_8GPU[self.doc])]

    def fit(self) -> dict:
        points = [p for p in self.points() if p[0] >= FIT_FROM_BYTES]
        work, seconds = [p[0] for p in points], [p[1] for p in points]
        fit = fit_affine(work, seconds)
        errors = relative_errors(fit, work, seconds)
        return {"alpha_s": fit.intercept, "beta_s_per_byte": fit.slope,
                "bus_bandwidth_bytes_s": ring_factor(self.collective, self.group) / fit.slope,
                "median_err": statistics.median(errors), "max_err": max(errors), "points": len(points)}

    def source(self) -> str:
        fit = self.fit()
        largest = ALL_REDUCE_8GPU[self.doc][-1]
        return (f"fit (autoplan/profiling/fit.py) of the published {self.collective} bus bandwidth curve in "
                f"{DOCS[self.doc]}, {fit['points']} sizes from {FIT_FROM_BYTES >> 20} MiB to 8 GiB (peak "
                f"{largest} GB/s at 8G): alpha {fit['alpha_s'] * 1e6:.1f} us, bus bandwidth "
                f"{fit['bus_bandwidth_bytes_s'] / GB:.1f} GB/s; the fit is off the published points by "
                f"{fit['median_err']:.0%} median, {fit['max_err']:.0%} worst")


def figures() -> dict[str, list[tuple[str, object, str]]]:
    """profile -> [(field path, new value, source)]; a value of KEEP keeps the old one (source says why)."""
    a100_ar, h100_ar = Curve("azure-a100", "all_reduce", 8), Curve("azure-h100", "all_reduce", 8)
    keep = {field: (KEEP, NOT_FOUND) for field in ("op_overhead_s", "overlap", "fsdp", "optimizer_tensor_s")}
    return {
        "a100-sxm4-80gb": [
            ("peak_flops", KEEP, "datasheet: NVIDIA A100 datasheet, 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32"),
            ("matmul_efficiency", round(271.2 / 312, 4),
             f"{DOCS['mamf']}: NVIDIA A100 SXM 271.2 TFLOP/s of 312 (86.9%), shape 1024x10240x5120, torch "
             f"2.6.0+cu126; {DOCS['azure-a100']}: cuBLASLt FP16 8192^3 253.7 TFLOP/s (81%)"),
            ("mem_bandwidth_bytes_s", KEEP, "datasheet: 2039 GB/s HBM2e"),
            ("mem_bandwidth_efficiency", round(1.61e12 / 2.039e12, 4),
             f"{DOCS['azure-a100']}: HBM bandwidth, Copy 1.61 TB/s of 2.039 (79%); "
             f"{DOCS['gpuinspector-a100']}: 1310.7 GB/s of 1555 on the 40 GB part (84%)"),
            ("links.intra_node.bus_bandwidth_bytes_s", 230 * GB,
             f"'The total effective bandwidth should therefore be 240GB/s on A100, but some other bottlenecks on the "
             f"GPUs limits it to ~230GB/s' ({DOCS['nccl-tests-149']}); {DOCS['azure-a100']}: all-reduce bus "
             f"bandwidth 231.58 GB/s at 8 GB"),
            ("links.intra_node.latency_s", round(a100_ar.fit()["alpha_s"] / 2, 7),
             f"no published all-gather/reduce-scatter curve found: {HALF_ALPHA}"),
            ("links.inter_node.bus_bandwidth_bytes_s", 24 * GB,
             f"one HDR 200 Gb/s NIC: 'you should get ~160GB/s intra-node and 24GB/s inter-node' for one HDR NIC "
             f"({DOCS['nccl-412']}); what each of HSDP's replica groups (one rank per node) gets"),
            ("links.inter_node.latency_s", round(a100_ar.fit()["alpha_s"], 7),
             "no published multi-node curve found: the alpha of the intra-node all-reduce fit"),
            ("collectives", [{"collective": "all_reduce", "group_size": 8, "scope": "intra_node",
                              "alpha_s": a100_ar.fit()["alpha_s"], "beta_s_per_byte": a100_ar.fit()["beta_s_per_byte"]}],
             f"all_reduce intra_node 8: {a100_ar.source()}. Every other collective from the topology "
             f"(benchmarks/gpu_figures.py)"),
            ("host_link.h2d_bytes_s", 26.28 * GB,
             f"{DOCS['azure-a100']}: nvbandwidth Host to Device 26.28 GB/s (PCIe Gen4 x16); "
             f"{DOCS['gpuinspector-a100']}: pinned host<->device 24.33 GiB/s (26.1 GB/s) in a DGX-A100"),
            ("host_link.d2h_bytes_s", 25 * GB,
             f"{DOCS['nvbandwidth-53']}: unidirectional device-to-host ~25 GB/s (Azure's 6.27 GB/s reading in "
             f"{DOCS['azure-a100']} is taken as an outlier)"),
            ("host_link.overlaps_compute", True,
             f"copies run on copy engines beside kernels: 'Concurrent copy and kernel execution: Yes with 3 copy "
             f"engine(s)' ({DOCS['gpuinspector-a100']})"),
            ("host_link.cpu_optimizer_bytes_s", CPU_ADAMW_BYTES_S, CPU_ADAMW_ASSUMED),
            ("host_link.cpu_threads", 1, "the thread count of the assumed rate above"),
            ("host_link.host_mem_bytes", 2 * TiB, DOCS["dgx-a100"]),
            *[(field, *rest) for field, rest in keep.items()],
        ],
        "h100-sxm-80gb": [
            ("peak_flops", KEEP, "datasheet: NVIDIA H100 SXM5 datasheet, 989 TFLOP/s dense BF16/FP16, 67 TFLOP/s FP32"),
            ("matmul_efficiency", round(794.5 / 989, 4),
             f"{DOCS['mamf']}: NVIDIA H100 SXM 794.5 TFLOP/s of 989 (80.3%), shape 2048x2048x13312, torch "
             f"2.7.0+cu126"),
            ("mem_bandwidth_bytes_s", KEEP, "datasheet: 3.35 TB/s HBM3"),
            ("mem_bandwidth_efficiency", round(2.90e12 / 3.35e12, 4),
             f"{DOCS['azure-h100']}: HBM bandwidth, Copy 2.90 TB/s of 3.35 (87%)"),
            ("links.intra_node.bus_bandwidth_bytes_s", 360 * GB,
             f"'360 GB/s is exactly what we'd expect on H100' for all_gather_perf/all_reduce_perf bus bandwidth on 8 "
             f"H100 ({DOCS['nccl-tests-326']}); 'NCCL can get an effective NVLink bandwidth of 370GB/s, which you "
             f"can observe as BusBw when running non-allreduce operations' ({DOCS['nccl-tests-212']})"),
            ("links.intra_node.latency_s", round(h100_ar.fit()["alpha_s"] / 2, 7),
             f"no published all-gather/reduce-scatter curve found: {HALF_ALPHA}"),
            ("links.inter_node.bus_bandwidth_bytes_s", 46 * GB,
             f"one NDR 400 Gb/s NIC: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC' ({DOCS['nccl-tests-290']})"
             f"; what each of HSDP's replica groups (one rank per node) gets"),
            ("links.inter_node.latency_s", round(h100_ar.fit()["alpha_s"], 7),
             "no published multi-node curve found: the alpha of the intra-node all-reduce fit"),
            ("collectives", [{"collective": "all_reduce", "group_size": 8, "scope": "intra_node",
                              "alpha_s": h100_ar.fit()["alpha_s"], "beta_s_per_byte": h100_ar.fit()["beta_s_per_byte"]}],
             f"all_reduce intra_node 8: {h100_ar.source()} (NVLink SHARP: 'On 8 GPUs, you should reach a peak busBw "
             f"of ~480GB/s', {DOCS['nccl-tests-212']}). Every other collective from the topology (benchmarks/gpu_figures.py)"),
            ("host_link.h2d_bytes_s", 51 * GB, f"{DOCS['azure-h100']}: nvbandwidth Host to Device 51 GB/s (PCIe Gen5 x16)"),
            ("host_link.d2h_bytes_s", 52 * GB, f"{DOCS['azure-h100']}: nvbandwidth Device to Host 52 GB/s"),
            ("host_link.overlaps_compute", True,
             "copies run on copy engines beside kernels (nvbandwidth's CE copies above); no published overlap "
             "measurement found"),
            ("host_link.cpu_optimizer_bytes_s", CPU_ADAMW_BYTES_S, CPU_ADAMW_ASSUMED),
            ("host_link.cpu_threads", 1, "the thread count of the assumed rate above"),
            ("host_link.host_mem_bytes", 2 * TiB, DOCS["dgx-h100"]),
            *[(field, *rest) for field, rest in keep.items()],
        ],
        "v100-sxm2-32gb": [
            ("peak_flops", KEEP, "datasheet: NVIDIA V100 SXM2 datasheet, 125 TFLOP/s FP16 tensor core, 15.7 TFLOP/s "
                                 "FP32; no native BF16 (taken at the FP32 rate)"),
            ("matmul_efficiency", round(83 / 125, 4),
             f"{DOCS['markidis']}: 'NVIDIA Tensor Cores can deliver up to 83 Tflops/s in mixed precision on a Tesla "
             f"V100' (cuBLAS GEMM) of 125 (66%); one efficiency for every dtype: the FP16 tensor-core one"),
            ("mem_bandwidth_bytes_s", KEEP, "datasheet: 900 GB/s HBM2"),
            ("mem_bandwidth_efficiency", round(775.57e9 / 900e9, 4),
             f"{DOCS['gpuinspector-v100']}: memory_bandwidth 722.31 GiB/s (775.6 GB/s) of 900 (86%)"),
            ("links.intra_node.bus_bandwidth_bytes_s", KEEP, NOT_FOUND),
            ("links.intra_node.latency_s", KEEP, NOT_FOUND),
            ("links.inter_node.bus_bandwidth_bytes_s", KEEP, NOT_FOUND),
            ("links.inter_node.latency_s", KEEP, NOT_FOUND),
            ("collectives", KEEP, NOT_FOUND),
            ("host_link.h2d_bytes_s", 12.14 * GiB,
             f"{DOCS['gpuinspector-v100']}: Host (pinned) <-> Device 12.14 GiB/s (13.0 GB/s; PCIe Gen3 x16)"),
            ("host_link.d2h_bytes_s", 12.14 * GiB, f"{DOCS['gpuinspector-v100']}: the same pinned figure, both ways"),
            ("host_link.overlaps_compute", True,
             f"'Concurrent copy and kernel execution: Yes with 6 copy engine(s)' ({DOCS['gpuinspector-v100']})"),
            ("host_link.cpu_optimizer_bytes_s", CPU_ADAMW_BYTES_S, CPU_ADAMW_ASSUMED.replace("14-16", "5")),
            ("host_link.cpu_threads", 1, "the thread count of the assumed rate above"),
            ("host_link.host_mem_bytes", 512 * GiB, DOCS["dgx1"]),
            *[(field, *rest) for field, rest in keep.items()],
        ],
    }


def cpu_host_link(profile: dict) -> list[tuple[str, object, str]]:
    """The measured CPU profile's host link: the "device" is the host, so a copy is a memcpy."""
    threads = profile["provenance"]["settings"].get("threads_per_rank") or 1
    return [
        ("host_link.h2d_bytes_s", profile["mem_bandwidth_bytes_s"] / 2,
         "a memcpy on the host: this profile's measured copy bandwidth (mem_bandwidth_bytes_s, which counts each "
         "byte read and written) halved to bytes moved"),
        ("host_link.d2h_bytes_s", profile["mem_bandwidth_bytes_s"] / 2, "as h2d: a memcpy"),
        ("host_link.overlaps_compute", False, "a CPU device runs no copy beside its compute"),
        ("host_link.cpu_optimizer_bytes_s", profile["optimizer_bytes_s"],
         "this profile's measured AdamW rate (optimizer_bytes_s): the optimizer already runs on the host"),
        ("host_link.cpu_threads", threads, "this profile's threads per rank (provenance.settings.threads_per_rank)"),
        ("host_link.host_mem_bytes", None, "left to the search: it takes this machine's memory"),
    ]


def cpu_identity(profile: dict) -> list[tuple[str, object, str]]:
    """The measured CPU profile's device as its provenance recorded it; its CPU features were not recorded
    when it was measured (`autoplan profile` records them since)."""
    return [("identity", {"name": profile["provenance"]["device_name"], "memory_bytes": None, "sm_count": None,
                          "boost_clock_mhz": None, "power_limit_w": None,
                          "cpu_model": profile["provenance"]["device_name"], "cpu_cores": None, "cpu_features": []},
             "provenance.device_name of the measurement; its CPU features were not recorded then (issue 25: it had "
             "bf16 matrix units); `autoplan profile` records them")]


def _get(profile: dict, path: str):
    node = profile
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(profile: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = profile
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _short(value) -> str:
    if isinstance(value, list):
        return f"{len(value)} fits"
    if isinstance(value, dict):
        return "as before"
    if isinstance(value, float) and value >= 1e6:
        return f"{value / GB:.2f}e9" if value < 1e13 else f"{value:.3g}"
    return "-" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the figures and sources into profiles/*.json")
    args = parser.parse_args()
    table = figures()
    cpu = json.loads((PROFILES / "cpu-gloo-2.json").read_text())
    table["cpu-gloo-2"] = cpu_host_link(cpu) + cpu_identity(cpu)
    devices = {"a100-sxm4-80gb": "NVIDIA A100 SXM4 80GB", "h100-sxm-80gb": "NVIDIA H100 SXM5 80GB",
               "v100-sxm2-32gb": "NVIDIA V100 SXM2 32GB"}
    templates = {}
    for name, (template, device, rows) in new_profile_figures().items():  # the template's figures, then its own
        table[name], devices[name], templates[name] = list(table[template]) + rows, device, template
    for name, rows in extra_figures().items():  # overlap's and fsdp's parts are sourced there: no "kept" rows
        fitted = fitted_scale_rows(name)
        table[name] = [row for row in table[name] if row[0] != "overlap" and not (fitted and row[0] == "fsdp")]
        table[name] += rows + fitted
    print(f"{'profile':<16} {'figure':<40} {'old':>12} {'new':>12}  source")
    for name, rows in table.items():
        path = PROFILES / f"{name}.json"
        profile = json.loads((path if path.exists() else PROFILES / f"{templates[name]}.json").read_text())
        profile["name"] = name
        sources = profile["provenance"].setdefault("sources", {})
        if name in devices:
            profile["provenance"]["description"] = DESCRIPTION.format(device=devices[name])
            identity = {field: value for field, value, _ in rows}.get("identity")
            if identity:
                profile["provenance"]["device_name"] = identity["name"]
        for field, value, source in rows:
            old = _get(profile, field)
            source = source.format(old=_short(old))
            print(f"{name:<16} {field:<40} {_short(old):>12} {_short(old if value is KEEP else value):>12}  "
                  f"{source[:160]}")
            if value is not KEEP:
                _set(profile, field, value)
            sources[field] = source
            if "." in field:  # a part sourced on its own: the whole's old source no longer speaks for it
                sources.pop(field.split(".")[0], None)
        if args.write:  # validated, and written as `autoplan profile` writes profiles
            save_profile(DeviceProfile.model_validate(profile), path)
    if args.write:
        print(f"\nwritten: {', '.join(f'profiles/{name}.json' for name in table)}")


if __name__ == "__main__":
    main()
