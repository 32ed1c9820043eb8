"""Measured, published FSDP training runs: the rows `benchmarks/published.py` predicts.

Each row is one run as its source reports it (the figure is tokens per second per GPU, read from the
document, file and commit named in SOURCES, at the line or table given), and the same configuration
in autoplan's terms: the zoo model whose shapes match (the source's model configuration), the world and
node size, micro-batch, accumulation, sequence, precision and checkpointing. Where the source leaves
something unsaid (the network between nodes, mostly), `assumed` says what is taken and why. `fits`:
whether the run ran (a run the source says ran out of memory is a row with fits=False and no figure).

Rows are split before any fitting: `held_out` rows are never used to fit a figure of the time model
(benchmarks/published.py --fit), so their error measures the model on runs it was not fitted to: the
multi-node rows of llm-foundry, its A100 40GB rows and every fms-fsdp row (another framework, another
network, hybrid sharding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SOURCES", "PublishedRun", "RUNS", "llm_foundry_mpt"]

SOURCES = {
    "torchtitan": "pytorch/torchtitan, docs/performance.md at 157a12c562288b3bccb077003a97f18a4ca657aa (64 x A100 80GB, "
                  "FSDP2, bf16 parameters with fp32 reduction, AdamW; configs: train_configs/*.toml, policy: "
                  "torchtitan/parallelisms/parallelize_llama.py, same commit)",
    "llm-foundry": "mosaicml/llm-foundry, scripts/train/benchmarking/README.md at 495218376830947dce625efabc4d86be7c47cc45 "
                   "(MPT models, FSDP FULL_SHARD, flash attention; model shapes: scripts/train/yamls/pretrain/mpt-*.yaml)",
    "fms-fsdp": "foundation-model-stack/fms-fsdp, README.md at 4ffb9bdfa30e957e339ccfbb617a589fd07c495e (Llama 2 shapes, "
                "FSDP1 with SDPA, no torch.compile, bf16 parameters and reduction (fms_fsdp/policies/mixed_precision.py "
                "bfSixteen), seq 4096 (fms_fsdp/config/training.py), model shapes fms_fsdp/utils/config_utils.py)",
}

GB = 1e9
# fms-fsdp's clusters, as its README's column headings give them: the network between nodes per node
# ("A100 80G 128 GPUs with 400Gbps", "H100 96 GPUs with 800 Gbps"); what a NIC delivers of its line rate:
# 46 of 50 GB/s for a 400 Gb/s NIC ("For NDR @ 400Gbps you should see 46-48GB/s per NIC", NVIDIA/nccl-tests
# issue #290, AddyLaddy (NVIDIA))
NIC_EFFICIENCY = 46 / 50
FMS_A100_NETWORK = (1, 400e9 / 8 * NIC_EFFICIENCY)
FMS_H100_NETWORK = (2, 400e9 / 8 * NIC_EFFICIENCY)


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: str  # a SOURCES key
    where: str  # table and line (or row) in the source
    model: str  # autoplan's zoo spec of the same shapes
    published_model: str
    gpus: int
    gpus_per_node: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    precision: str  # autoplan's precision
    published_precision: str
    checkpoint: str  # autoplan's checkpoint mode ("none", "selective_op", "full") or "every_other_block"
    published_checkpoint: str
    hardware: str
    profile: str
    tokens_s_gpu: float | None  # the published figure; None for a run that did not fit
    fits: bool = True
    strategy: str = "shard"
    network: tuple[int, float] | None = None  # (NICs per node, bytes/s each delivers) where the source gives it
    fallback_profile: str = ""  # the shipped profile an older autoplan uses where it lacks `profile`
    held_out: bool = False
    assumed: str = ""
    published_mfu: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)


def llm_foundry_mpt(size: str, seq_len: int) -> str:
    """An MPT model of llm-foundry's benchmark yamls in the zoo's GPT-2 family: MPT's defaults (learned
    positions, biases, LayerNorm, GELU MLP x4, tied embeddings) are GPT-2's layout; e.g. mpt-7b gives
    6,658,859,008 parameters at seq 2048 in both, the table's NumParams."""
    layers, heads, width = {"1b": (24, 16, 2048), "3b": (32, 20, 2560), "7b": (32, 32, 4096), "13b": (40, 40, 5120),
                            "30b": (48, 56, 7168), "70b": (80, 64, 8192)}[size]
    return (f"gpt2[n_layers={layers},n_heads={heads},d_model={width},vocab_size=50368,max_seq_len={seq_len}]")


TT, LF, FMS = "torchtitan", "llm-foundry", "fms-fsdp"
TT_NET = "network not stated: DGX A100's 8 x 200 Gb/s InfiniBand (the profile's)"
LF_A100 = "'A100 80GB with 1600 Gbps node-node interconnect (RoCE)': 8 x 200 Gb/s, the profile's"
LF_A100_40 = "'A100 40GB with 1600 Gbps node-node interconnect (RoCE)': 8 x 200 Gb/s, the profile's"
LF_H100 = "network not stated: DGX H100's 8 x 400 Gb/s (the profile's)"
LF_PURE = ("'bf16 | PURE': Composer's pure bf16 (model, gradients and FSDP's reduction in bf16), autoplan's bf16")
LLAMA3_70B = "llama3-8b[n_layers=80,n_heads=64,d_model=8192,ffn_hidden=28672]"
LLAMA2_34B = "llama2-70b[n_layers=48,ffn_hidden=22016]"
SEL_OP = "selective op: torchtitan's policy, every other matmul recomputed"
SEL_LAYER = "selective layer: every 2nd block fully checkpointed (selective_ac_option '2', the config default)"


def _tt(id, model, published, seq, mb, ckpt, published_ckpt, wps, mfu, fits=True, held_out=False, notes=()):
    return PublishedRun(id, TT, f"docs/performance.md, {'Llama 3' if 'llama3' in model else 'Llama 2'} table",
                        model, published, 64, 8, mb, 1, seq, "bf16-mixed", "bf16 params, fp32 reduce (FSDP2 "
                        "MixedPrecisionPolicy)", ckpt, published_ckpt, "64 x A100 80GB", "a100-sxm4-80gb", wps, fits,
                        held_out=held_out, assumed=TT_NET, published_mfu=mfu, notes=notes)


def _lf(id, size, seq, gpus, mb, accum, ac, hardware, profile, line, tps, precision="bf16-mixed", held_out=False,
        assumed="", fallback="", mfu=None):
    published_precision = "amp_bf16 DEFAULT" if precision == "bf16-mixed" else "bf16 PURE"
    return PublishedRun(f"lf-{id}", LF, f"README.md line {line}", llm_foundry_mpt(size, seq), f"MPT-{size}", gpus, 8,
                        mb, accum, seq, precision, published_precision, "full" if ac else "none",
                        "activation checkpointing True (every block)" if ac else "False", hardware, profile, tps,
                        held_out=held_out, fallback_profile=fallback,
                        assumed="; ".join(a for a in (assumed, LF_PURE if precision == "bf16" else "") if a),
                        published_mfu=mfu)


def _fms(id, model, published, gpus, strategy, ckpt, tps, hardware, profile, network, mfu):
    return PublishedRun(f"fms-{id}", FMS, "README.md, 'Training throughput benchmarks' table", model, published,
                        gpus, 8, 2, 1, 4096, "bf16-reduce", "bfSixteen: bf16 params and reduction, fp32 sharded "
                        "parameters", ckpt, "Full AC" if ckpt == "full" else "No AC", hardware, profile, tps,
                        strategy=strategy, network=network, held_out=True, fallback_profile=profile,
                        assumed="400 Gb/s (A100) and 800 Gb/s (H100) taken as per node, 46 of each 50 GB/s "
                              "delivered (nccl-tests #290)", published_mfu=mfu)


RUNS: list[PublishedRun] = [
    _tt("tt-l3-8b-selop", "llama3-8b", "Llama 3 8B", 8192, 1, "selective_op", SEL_OP, 2973, 0.582),
    _tt("tt-l3-8b-sellayer", "llama3-8b", "Llama 3 8B", 8192, 1, "every_other_block", SEL_LAYER, 2904, 0.568),
    _tt("tt-l3-70b-full", LLAMA3_70B, "Llama 3 70B", 8192, 1, "full", "full", 331, 0.517),
    _tt("tt-l2-13b-none", "llama2-13b", "Llama 2 13B", 4096, 2, "none", "no", 2162, 0.611),
    _tt("tt-l2-13b-sellayer", "llama2-13b", "Llama 2 13B", 4096, 2, "every_other_block", SEL_LAYER, 1914, 0.541),
    _tt("tt-l2-13b-selop", "llama2-13b", "Llama 2 13B", 4096, 2, "selective_op", SEL_OP, 1904, 0.538),
    _tt("tt-l2-70b-selop", "llama2-70b", "Llama 2 70B", 4096, 1, "selective_op", SEL_OP, 355, 0.508),
    _tt("tt-l2-70b-full", "llama2-70b", "Llama 2 70B", 4096, 2, "full", "full", 353, 0.505),
    _tt("tt-l2-70b-selop-mb2", "llama2-70b", "Llama 2 70B", 4096, 2, "selective_op", SEL_OP, None, None, fits=False,
        notes=("footnote 1: 'the 70B training with local batch size 2 will cause an OOM error when selective "
               "activation checkpointing is used'",)),
    _lf("a100-1b", "1b", 2048, 8, 14, 4, False, "8 x A100 80GB", "a100-sxm4-80gb", 199, 20513, mfu=0.5986),
    _lf("a100-3b", "3b", 2048, 8, 10, 2, False, "8 x A100 80GB", "a100-sxm4-80gb", 191, 10811, mfu=0.6211),
    _lf("a100-7b", "7b", 2048, 8, 6, 2, False, "8 x A100 80GB", "a100-sxm4-80gb", 184, 4641, mfu=0.6423),
    _lf("a100-13b", "13b", 2048, 8, 2, 3, False, "8 x A100 80GB", "a100-sxm4-80gb", 177, 2262, mfu=0.5957),
    _lf("a100-30b", "30b", 2048, 8, 3, 21, True, "8 x A100 80GB", "a100-sxm4-80gb", 170, 916, mfu=0.553),
    _lf("a100-7b-8k", "7b", 8192, 8, 8, 2, True, "8 x A100 80GB", "a100-sxm4-80gb", 182, 3206, mfu=0.5447),
    _lf("a100-70b-64", "70b", 2048, 64, 8, 4, True, "64 x A100 80GB (8 nodes)", "a100-sxm4-80gb", 166, 410,
        precision="bf16", held_out=True, assumed=LF_A100, mfu=0.5333),
    _lf("h100-1b", "1b", 2048, 8, 14, 1, False, "8 x H100 80GB", "h100-sxm-80gb", 138, 45455, mfu=0.4182),
    _lf("h100-7b", "7b", 2048, 8, 6, 1, False, "8 x H100 80GB", "h100-sxm-80gb", 118, 10643, mfu=0.4644),
    _lf("h100-13b", "13b", 2048, 8, 2, 1, False, "8 x H100 80GB", "h100-sxm-80gb", 112, 4792, mfu=0.3979),
    _lf("h100-30b", "30b", 2048, 8, 3, 21, True, "8 x H100 80GB", "h100-sxm-80gb", 104, 2002, mfu=0.3811),
    _lf("h100-70b-64", "70b", 2048, 64, 8, 4, True, "64 x H100 80GB (8 nodes)", "h100-sxm-80gb", 98, 1039,
        held_out=True, assumed=LF_H100, mfu=0.4257),
    _lf("a100-40-3b", "3b", 2048, 8, 5, 8, False, "8 x A100 40GB", "a100-sxm4-40gb", 263, 10065, precision="bf16",
        held_out=True, fallback="a100-sxm4-80gb", mfu=0.5782),
    _lf("a100-40-7b", "7b", 2048, 8, 12, 4, True, "8 x A100 40GB", "a100-sxm4-40gb", 252, 3679, precision="bf16",
        held_out=True, fallback="a100-sxm4-80gb", mfu=0.5092),
    _lf("a100-40-13b-128", "13b", 2048, 128, 16, 1, True, "128 x A100 40GB (16 nodes)", "a100-sxm4-40gb", 238, 1972,
        precision="bf16", held_out=True, assumed=LF_A100_40, fallback="a100-sxm4-80gb", mfu=0.5193),
    _fms("a100-7b-hsdp", "llama2-7b", "Llama 2 7B", 128, "hybrid", "none", 3700, "128 x A100 80GB (16 nodes)",
         "a100-sxm4-80gb", FMS_A100_NETWORK, 0.57),
    _fms("a100-34b", LLAMA2_34B, "34B (fms config)", 128, "shard", "full", 700, "128 x A100 80GB (16 nodes)",
         "a100-sxm4-80gb", FMS_A100_NETWORK, 0.47),
    _fms("a100-70b", "llama2-70b", "Llama 2 70B", 128, "shard", "full", 370, "128 x A100 80GB (16 nodes)",
         "a100-sxm4-80gb", FMS_A100_NETWORK, 0.50),
    _fms("h100-7b-hsdp", "llama2-7b", "Llama 2 7B", 96, "hybrid", "none", 7500, "96 x H100 80GB (12 nodes)",
         "h100-sxm-80gb", FMS_H100_NETWORK, 0.37),
    _fms("h100-34b", LLAMA2_34B, "34B (fms config)", 96, "shard", "full", 1550, "96 x H100 80GB (12 nodes)",
         "h100-sxm-80gb", FMS_H100_NETWORK, 0.32),
    _fms("h100-70b", "llama2-70b", "Llama 2 70B", 96, "shard", "full", 800, "96 x H100 80GB (12 nodes)",
         "h100-sxm-80gb", FMS_H100_NETWORK, 0.34),
]
