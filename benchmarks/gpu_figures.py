"""The GPU profiles' kernel, network and identity figures, each from a published source: what the time model
needs beyond a datasheet peak (benchmarks/sourced_profiles.py writes them with the rest).

- matmul by shape (cost_models/compute.py): the SM count, and the full-wave efficiency that makes the
  shape model give the published best matmul rate (stas00/ml-engineering's MAMF table) at its shape;
- attention: flash-attention 2's measured forward + backward rates by sequence and head size
  (Dao-AILab/flash-attention's benchmark figures), on the FLOPs a causal kernel computes;
- the SMs NCCL's kernels hold while a collective runs (its CTAs share no SM with compute);
- the topology collectives without a measured curve are priced on (cost_models/comm.py): the node's GPU
  links, its NICs, and NCCL's own latency constants;
- the device identity `search` and `apply` compare with the machine they run on.

Figures for which no measurement of that very device was found are derived from the nearest one, and
their source says how (H100 PCIe and NVL from H100 SXM, H200 from H100 SXM, A100 40GB from A100 80GB).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.compute import matmul_shape_efficiency  # noqa: E402
from cost_models.profile import MatmulShape  # noqa: E402

GB, GiB, MiB = 1e9, 1 << 30, 1 << 20
KEEP = object()  # a figure's value: keep the profile's (its source says why)
FIT = Path(__file__).resolve().parent / "results" / "published_fit.json"  # benchmarks/published.py --fit

DOCS = {
    "fa2-a100": "Dao-AILab/flash-attention, assets/flash2_a100_fwd_bwd_benchmark.png (commit 4f285b35, 2023-07-17): "
                "'Attention forward + backward speed (A100 80GB SXM4)', FlashAttention-2 bars, TFLOPs/s",
    "fa2-h100": "Dao-AILab/flash-attention, assets/flash2_h100_fwd_bwd_benchmark.png (commit 4f285b35, 2023-07-17): "
                "'Attention forward + backward speed (H100 80GB SXM5)', FlashAttention-2 bars, TFLOPs/s",
    "mamf": "stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table' "
            "(BF16 torch matmul, mean of 100 iterations, best shape found)",
    "stas-specs": "stas00/ml-engineering, compute/accelerator/README.md, TFLOPS table (dense) and memory table",
    "stas-clock": "stas00/ml-engineering, compute/accelerator/README.md: A100 SXM 1410 MHz, 108 SMs; H100 SXM "
                  "1830 MHz ('now NVIDIA's official figure'), 132 SMs",
    "stas-pcie": "stas00/ml-engineering, network/README.md: nvbandwidth on 8x H200 with PCIe 5 x16 links, 55.43 GB/s "
                 "host-to-device and 55.06 GB/s device-to-host",
    "h100-pcie": "NVIDIA H100 (PCIe) per NVIDIA LaunchPad's H100 MIG page (docs.nvidia.com/launchpad/ai/h100-mig): "
                 "114 SMs, 80 GB HBM2e, 2 TB/s; TDP 300-350 W (NVIDIA H100 datasheet)",
    "h100-nvl": "NVIDIA H100 datasheet, H100 NVL column: BF16 1,671 TFLOPS with sparsity (835 dense), FP32 60 TFLOPS, "
                "94 GB HBM3, 3.9 TB/s, 350-400 W, NVLink bridge 600 GB/s; 132 SMs (gpu.blog/gpus/nvidia-h100-nvl)",
    "nccl-ctas-a100": "NVIDIA/nccl issue #1225 ('For dgxA100, 12 nvlink and 24 cta for allreduce case'); NCCL CTAs "
                      "hold their SM: 'NCCL CTAs won't share an SM with compute kernels' (NVIDIA/nccl #689, quoted "
                      "in #1656)",
    "nccl-ctas-h100": "NVIDIA developer forum, 'Compute-Communication Overlap Causes Severe GEMM Performance "
                      "Degradation because of Tail Effect' (FSDP on H100, 132 SMs): 'the concurrent ncclAllGather "
                      "kernel launches 24 blocks'; NCCL CTAs hold their SM (NVIDIA/nccl #689, quoted in #1656)",
    "nccl-tuning": "NVIDIA/nccl src/graph/tuning.cc (commit 5067397c), default tuner constants, Simple protocol: "
                   "ring base latency 8.4 us; hardware latency per ring step NVLink 3.4 us, PCI 5.7 us, network 14 us",
    "nccl-412": "NVIDIA/nccl issue #412 (sjeaugey, NVIDIA): '24GB/s inter-node' for one HDR 200 Gb/s NIC",
    "nccl-290": "NVIDIA/nccl-tests issue #290 (AddyLaddy, NVIDIA): 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'",
    "nccl-149": "NVIDIA/nccl-tests issue #149 (sjeaugey, NVIDIA): A100 NVLink rings limited to '~230GB/s'",
    "nccl-326": "NVIDIA/nccl-tests issue #326 (sjeaugey, NVIDIA): '360 GB/s is exactly what we'd expect on H100' for "
                "all_gather_perf bus bandwidth on 8 H100",
    "nccl-272": "NVIDIA/nccl-tests issue #272: all_reduce_perf on 8x H200 (NVLink 4) peaks at 475 GB/s bus bandwidth "
                "(NVLink SHARP; rings as H100's)",
    "nccl-1161": "NVIDIA/nccl issue #1161: all_reduce_perf between two NVLink-bridged H100 PCIe, 1-4 GB: busbw "
                 "115.4-116.3 GB/s",
    "nccl-tests-178": "NVIDIA/nccl-tests issue #178: PCIe A100s whose ring crosses the host ('SYS') drop to 20 GB/s "
                      "all-reduce bus bandwidth (208 GB/s within an NVLink pair)",
    "h200-smi": "nvidia-smi of 8x H200 (public logs found by code search): 'NVIDIA H200 ... 143771MiB', power cap "
                "700W; NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s",
}

# flash-attention 2's forward + backward TFLOPs/s by (head dim, causal) and sequence length, as the bars read
# (a label the legend hides is left out)
FA2 = {
    "a100": {(64, True): [88, 119, 140, 156, 165, 171], (128, True): [99, 133, 155, 173, 182, 189],
             (64, False): [132, None, 162, 171, 175, 176], (128, False): [None, None, 187, 196, 201, 203]},
    "h100": {(64, True): [141, 192, 232, 257, 273, 284], (128, True): [163, 221, 265, 294, 308, 328],
             (64, False): [215, 254, 274, 288, 294, 296], (128, False): [248, None, 320, 326, 335, 338]},
}
FA2_SEQ = [512, 1024, 2048, 4096, 8192, 16384]
NCCL_CTAS = 24  # both sources above
NCCL_LATENCY = {"base_latency_s": 8.4e-6, "nvlink_hop_s": 3.4e-6, "pci_hop_s": 5.7e-6, "inter_hop_s": 14.0e-6}
# (rate, best shape, the measured device's peak and SM count)
A100_MAMF, H100_MAMF = (271.2e12, (1024, 10240, 5120), 312e12, 108), (794.5e12, (2048, 2048, 13312), 989e12, 132)
A100_PCIE_OVER_SXM = 252.9 / 271.2  # MAMF: A100 PCIe 252.9, A100 SXM 271.2 TFLOP/s


def attention_rates(table: str, scale: float = 1.0) -> list[dict]:
    return [{"head_dim": head_dim, "causal": causal, "seq_len": seq, "flops_s": value * 1e12 * scale}
            for (head_dim, causal), values in FA2[table].items() for seq, value in zip(FA2_SEQ, values)
            if value is not None]


def full_wave(mamf: tuple[float, tuple[int, int, int], float, int], scale: float = 1.0) -> float:
    """The full-wave efficiency that gives the published best matmul rate at its shape, on the measured device
    (its peak and SM count), times `scale` for a sibling part."""
    rate, (m, n, k), peak, sm_count = mamf
    shape = MatmulShape(sm_count=sm_count, full_wave_efficiency=1.0)
    return round(min(1.0, rate / peak / matmul_shape_efficiency(m, n, k, shape) * scale), 4)


def topology(intra: str, intra_bus: float, nics: int, nic: float, pair: float | None = None) -> dict:
    hop = NCCL_LATENCY["nvlink_hop_s" if intra == "nvswitch" else "pci_hop_s"]
    return {"intra_node": intra, "intra_bus_bytes_s": intra_bus, "pair_bus_bytes_s": pair, "nics_per_node": nics,
            "nic_bytes_s": nic, "base_latency_s": NCCL_LATENCY["base_latency_s"], "intra_hop_latency_s": hop,
            "inter_hop_latency_s": NCCL_LATENCY["inter_hop_s"]}


def identity(name: str, memory: int, sms: int, clock: float | None, watts: float) -> dict:
    return {"name": name, "memory_bytes": memory, "sm_count": sms, "boost_clock_mhz": clock, "power_limit_w": watts,
            "cpu_model": None, "cpu_cores": None, "cpu_features": []}


def _kernel_rows(sms: int, mamf, mamf_source: str, attention: str, attention_source: str,
                 attention_scale: float = 1.0, mamf_scale: float = 1.0) -> list[tuple[str, object, str]]:
    fwe = full_wave(mamf, mamf_scale)
    return [
        ("matmul", {"sm_count": sms, "tiles": [[256, 128], [128, 256], [128, 128]], "full_wave_efficiency": fwe},
         f"{mamf_source}; the tile and wave model (NVIDIA, 'Matrix Multiplication Background User's Guide', tile "
         f"and wave quantization; cuBLAS tiles 256x128, 128x256, 128x128) gives the MAMF rate at its shape "
         f"{mamf[1]} on {mamf[3]} SMs with a full-wave efficiency of {full_wave(mamf)}"
         + (f", times {mamf_scale:.4f}: {fwe}" if mamf_scale != 1.0 else "")),
        ("attention", attention_rates(attention, attention_scale), attention_source),
        ("overlap.comm_sm_fraction", round(NCCL_CTAS / sms, 4),
         f"{NCCL_CTAS} of {sms} SMs: {DOCS['nccl-ctas-h100' if attention == 'h100' else 'nccl-ctas-a100']}"),
        ("overlap.compute_slowdown", 1.0, "1: compute's slowdown while a collective runs is the SMs its kernels hold "
                                          "(overlap.comm_sm_fraction)"),
        ("overlap.comm_slowdown", 1.0, "1: no published measurement of a collective slowed by concurrent compute"),
    ]


def fitted_scale_rows(name: str) -> list[tuple[str, object, str]]:
    """The in-step compute scale benchmarks/published.py --fit found for the profile's GPU family (none before a
    fit): what the step takes beyond the model's sourced parts (FsdpOverhead.compute_*_scale)."""
    fits = json.loads(FIT.read_text()) if FIT.exists() else {}
    for family, fit in fits.items():
        if name in fit["profiles"]:
            fitted_on = fit["profiles"][0]
            how = (f"fitted: `python benchmarks/published.py --fit` ({FIT.name}), least squares of log(predicted / "
                   f"published tokens/s) over the {len(fit['runs'])} published {family} runs not held out "
                   f"({', '.join(fit['runs'])}; benchmarks/published_runs.py), the held-out runs not used: how much "
                   f"longer a step's ops take than their sourced kernel rates (sustained clocks, real shapes against "
                   f"the best, the framework's own kernels and gaps)"
                   + ("" if name == fitted_on else f"; {fitted_on}'s, the same architecture (no published run of "
                                                   f"this part found)"))
            return [(f"fsdp.{field}", fit["scale"], how) for field in ("compute_fwd_scale", "compute_bwd_scale")] + [
                ("fsdp.compute_recompute_scale", None, "as the backward's (the fit has one scale)"),
                ("fsdp.unit_fwd_s", KEEP, "no published measurement found; kept the earlier value ({old})"),
                ("fsdp.unit_bwd_s", KEEP, "no published measurement found; kept the earlier value ({old})")]
    return []


def extra_figures() -> dict[str, list[tuple[str, object, str]]]:
    """profile -> [(field path, value, source)] for the figures this module adds to the GPU profiles."""
    a100_net = ("topology", topology("nvswitch", 230 * GB, 8, 24 * GB),
                f"NVSwitch ring bus bandwidth 230 GB/s ({DOCS['nccl-149']}); 8 HDR NICs per node (NVIDIA DGX A100) at "
                f"24 GB/s each ({DOCS['nccl-412']}); latencies: {DOCS['nccl-tuning']}")
    h100_net = ("topology", topology("nvswitch", 360 * GB, 8, 46 * GB),
                f"NVSwitch ring bus bandwidth 360 GB/s ({DOCS['nccl-326']}); 8 NDR NICs per node (NVIDIA DGX H100) at "
                f"46 GB/s each ({DOCS['nccl-290']}); latencies: {DOCS['nccl-tuning']}")
    pcie_net = ("topology", topology("pcie", 20 * GB, 8, 46 * GB),
                f"a ring across PCIe cards crosses the host: 20 GB/s ({DOCS['nccl-tests-178']}, measured on A100 PCIe; "
                f"no 8x H100 PCIe measurement found, the host path is the same); NICs: assumed as DGX H100's, 8 x 46 "
                f"GB/s ({DOCS['nccl-290']}); latencies: {DOCS['nccl-tuning']}")
    nvl_net = ("topology", topology("nvlink_pairs", 20 * GB, 8, 46 * GB, pair=116 * GB),
               f"NVLink-bridged pairs: 116 GB/s within a pair ({DOCS['nccl-1161']}); a ring beyond the pair crosses the "
               f"host: 20 GB/s ({DOCS['nccl-tests-178']}); NICs assumed as DGX H100's ({DOCS['nccl-290']}); "
               f"latencies: {DOCS['nccl-tuning']}")
    a100 = _kernel_rows(108, A100_MAMF, f"{DOCS['mamf']}: A100 SXM 271.2 TFLOP/s at 1024x10240x5120",
                        "a100", DOCS["fa2-a100"])
    h100 = _kernel_rows(132, H100_MAMF, f"{DOCS['mamf']}: H100 SXM 794.5 TFLOP/s at 2048x2048x13312 "
                        "('H200 is the same')", "h100", DOCS["fa2-h100"])
    pcie_note = (f"no MAMF measurement of H100 PCIe/NVL found: H100 SXM's ({DOCS['mamf']}: 794.5 at 2048x2048x13312) "
                 f"times A100 PCIe's over A100 SXM's (252.9 / 271.2, the same table), the power-limited card's loss")
    return {
        "a100-sxm4-80gb": [("identity", identity("NVIDIA A100-SXM4-80GB", 80 * GiB, 108, 1410, 400),
                            f"{DOCS['stas-clock']}; 400 W: NVIDIA A100 datasheet (SXM)"), *a100, a100_net],
        "a100-sxm4-40gb": [("identity", identity("NVIDIA A100-SXM4-40GB", 40 * GiB, 108, 1410, 400),
                            f"{DOCS['stas-clock']}; 400 W: NVIDIA A100 datasheet (SXM)"), *a100, a100_net],
        "h100-sxm-80gb": [("identity", identity("NVIDIA H100 80GB HBM3", 80 * GiB, 132, 1830, 700),
                           f"{DOCS['stas-clock']}; 700 W: NVIDIA H100 datasheet (SXM)"), *h100, h100_net],
        "h200-sxm-141gb": [("identity", identity("NVIDIA H200", 143771 * MiB, 132, 1830, 700),
                            f"{DOCS['h200-smi']}; SMs and clock as H100 SXM ({DOCS['stas-clock']}; 'H200 is the same "
                            f"as H100' in the TFLOPS table)"), *h100, h100_net],
        "h100-pcie-80gb": [("identity", identity("NVIDIA H100 PCIe", 80 * GiB, 114, None, 350), DOCS["h100-pcie"]),
                           *_kernel_rows(114, H100_MAMF, pcie_note, "h100",
                                         f"{DOCS['fa2-h100']}, scaled by the peak (756 / 989 TFLOP/s): no H100 PCIe "
                                         f"measurement found", 756 / 989, A100_PCIE_OVER_SXM), pcie_net],
        "h100-nvl-94gb": [("identity", identity("NVIDIA H100 NVL", int(94 * GB), 132, None, 400), DOCS["h100-nvl"]),
                          *_kernel_rows(132, H100_MAMF, pcie_note, "h100",
                                        f"{DOCS['fa2-h100']}, scaled by the peak (835 / 989 TFLOP/s): no H100 NVL "
                                        f"measurement found", 835 / 989, A100_PCIE_OVER_SXM), nvl_net],
    }


def new_profile_figures() -> dict[str, tuple[str, str, list[tuple[str, object, str]]]]:
    """The profiles this module adds: name -> (template profile, device description, its datasheet figures)."""
    h100_specs = f"{DOCS['stas-specs']}"
    h200_collective = ("all_reduce intra_node 8: no published curve for H200; H100's NVLink SHARP curve applies "
                       f"(same NVLink 4 switch; {DOCS['nccl-272']})")
    return {
        "a100-sxm4-40gb": ("a100-sxm4-80gb", "NVIDIA A100 SXM4 40GB", [
            ("device_type", "cuda", "a GPU"),
            ("mem_bytes", 40 * GiB, "NVIDIA A100 datasheet: 40 GB HBM2"),
            ("peak_flops", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
             f"datasheet: {DOCS['stas-specs']}: A100 SXM 312 TFLOP/s BF16/FP16 dense, 19.5 FP32"),
            ("matmul_efficiency", round(271.2 / 312, 4), f"{DOCS['mamf']}: A100 SXM 271.2 of 312 (the 40 and 80 GB "
                                                         "parts share the chip and clock)"),
            ("mem_bandwidth_bytes_s", 1555e9, "NVIDIA A100 datasheet: 1,555 GB/s HBM2 (40 GB)"),
            ("mem_bandwidth_efficiency", round(1310.7 / 1555, 4),
             "pc2/GPUInspector.jl, docs/src/devices/a100_sxm2.md (A100-SXM4-40GB in a DGX-A100): 1310.7 GB/s of 1555"),
            ("host_link.h2d_bytes_s", 24.33 * GiB,
             "pc2/GPUInspector.jl, docs/src/devices/a100_sxm2.md: pinned host<->device 24.33 GiB/s in a DGX-A100"),
            ("host_link.d2h_bytes_s", 24.33 * GiB, "the same pinned figure, both ways"),
            ("host_link.host_mem_bytes", 1 << 40, "NVIDIA DGX A100 datasheet: system memory 1 TB (DGX A100 320GB)")]),
        "h100-pcie-80gb": ("h100-sxm-80gb", "NVIDIA H100 PCIe 80GB", [
            ("device_type", "cuda", "a GPU"),
            ("mem_bytes", 80 * GiB, DOCS["h100-pcie"]),
            ("peak_flops", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}, f"datasheet: {h100_specs}: H100 PCIe 756 "
                                                                            "BF16/FP16 dense, 51 FP32"),
            ("matmul_efficiency", round(794.5 / 989 * A100_PCIE_OVER_SXM, 4), "H100 SXM's MAMF efficiency times A100 "
                                                                             "PCIe's over SXM's (see matmul)"),
            ("mem_bandwidth_bytes_s", 2.0e12, f"{DOCS['h100-pcie']}"),
            ("mem_bandwidth_efficiency", 0.8657, "no published copy measurement: H100 SXM's (Azure ND H100 v5: 2.90 "
                                                 "of 3.35 TB/s)"),
            ("links.intra_node.bus_bandwidth_bytes_s", 20e9, DOCS["nccl-tests-178"]),
            ("collectives", [], "none measured; the topology prices every collective"),
            ("host_link.h2d_bytes_s", 55.43e9, f"PCIe Gen5 x16: {DOCS['stas-pcie']}"),
            ("host_link.d2h_bytes_s", 55.06e9, f"PCIe Gen5 x16: {DOCS['stas-pcie']}"),
            ("host_link.host_mem_bytes", None, "servers vary: give --host-mem")]),
        "h100-nvl-94gb": ("h100-sxm-80gb", "NVIDIA H100 NVL 94GB", [
            ("device_type", "cuda", "a GPU"),
            ("mem_bytes", int(94 * GB), f"{DOCS['h100-nvl']} (decimal GB: the smaller reading)"),
            ("peak_flops", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}, f"datasheet: {DOCS['h100-nvl']}"),
            ("matmul_efficiency", round(794.5 / 989 * A100_PCIE_OVER_SXM, 4), "H100 SXM's MAMF efficiency times A100 "
                                                                             "PCIe's over SXM's (see matmul)"),
            ("mem_bandwidth_bytes_s", 3.9e12, DOCS["h100-nvl"]),
            ("mem_bandwidth_efficiency", 0.8657, "no published copy measurement: H100 SXM's"),
            ("links.intra_node.bus_bandwidth_bytes_s", 20e9, DOCS["nccl-tests-178"]),
            ("collectives", [], "none measured; the topology prices every collective"),
            ("host_link.h2d_bytes_s", 55.43e9, f"PCIe Gen5 x16: {DOCS['stas-pcie']}"),
            ("host_link.d2h_bytes_s", 55.06e9, f"PCIe Gen5 x16: {DOCS['stas-pcie']}"),
            ("host_link.host_mem_bytes", None, "servers vary: give --host-mem")]),
        "h200-sxm-141gb": ("h100-sxm-80gb", "NVIDIA H200 SXM 141GB", [
            ("device_type", "cuda", "a GPU"),
            ("mem_bytes", 143771 * MiB, DOCS["h200-smi"]),
            ("peak_flops", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, f"datasheet: {h100_specs}: H200 SXM 989 "
                                                                            "BF16/FP16 dense, 67 FP32"),
            ("matmul_efficiency", round(794.5 / 989, 4), f"{DOCS['mamf']}: H100 SXM 794.5 of 989, 'H200 is the same'"),
            ("mem_bandwidth_bytes_s", 4.8e12, f"{h100_specs}: H200 SXM HBM3e 4.80 TB/s"),
            ("mem_bandwidth_efficiency", 0.8657, "no published copy measurement: H100 SXM's (Azure ND H100 v5)"),
            ("collectives", KEEP, h200_collective),
            ("host_link.h2d_bytes_s", 55.43e9, DOCS["stas-pcie"]),
            ("host_link.d2h_bytes_s", 55.06e9, DOCS["stas-pcie"]),
            ("host_link.host_mem_bytes", 2 * (1 << 40), "NVIDIA DGX H200 datasheet: 2 TB system memory")]),
    }

