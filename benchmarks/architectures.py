"""The architecture table at real sizes: each family's Hub config.json (written here, nothing downloaded)
planned at sequence 4096 on 8 x H100 (profile h100-sxm-80gb, 80 GB each): tokens/s, the attention kernel
torch would pick, one block's forward FLOPs and activations per sample; and the issue's figures (issue 24):
Mistral-7B with and without its 4096 window, Falcon-7B beside Pythia-6.9B, Mixtral-8x7B's layer FLOPs
beside the analytic count, T5-large and ViT-H/14 planned from the command line.

    python benchmarks/architectures.py             # about 10 minutes here; writes results/architectures.json
    python benchmarks/architectures.py --only falcon-7b pythia-6.9b

OPT-6.7B has a learned table of 2048 positions, so it is planned at 2048; ViT-H/14 has no sequence
(an image of 224 x 224 is 257 patch tokens inside the model), so its throughput is in samples/s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import autoplan
from autoplan.cli.main import main as cli
from autoplan.models.structure import largest_module_list

H100, MEM, SEQ = "h100-sxm-80gb", "80GB", 4096
RESULTS = Path(__file__).with_name("results") / "architectures.json"
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_type": "llama3"}

CONFIGS = {
    "llama-3.1-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         rms_norm_eps=1e-05, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
                       rms_norm_eps=1e-05, tie_word_embeddings=False),
    "qwen2-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=131072, max_window_layers=28, rope_theta=1000000.0,
                     sliding_window=131072, use_sliding_window=False, rms_norm_eps=1e-06, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000, sliding_window=None,
                     use_sliding_window=False, rms_norm_eps=1e-06, tie_word_embeddings=False),
    "gemma-2-9b": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=3584,
                       intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, vocab_size=256000, max_position_embeddings=8192, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, query_pre_attn_scalar=256, sliding_window=4096,
                       hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-06, rope_theta=10000.0),
    "gemma-3-1b": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152,
                       intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, vocab_size=262144, max_position_embeddings=32768, query_pre_attn_scalar=256,
                       sliding_window=512, sliding_window_pattern=6, rope_theta=1000000, rope_local_base_freq=10000,
                       hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-06),
    "phi-3-mini": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                       max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047,
                       rope_theta=10000.0, rms_norm_eps=1e-05, pad_token_id=32000, tie_word_embeddings=False),
    "pythia-6.9b": dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=4096,
                        intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32, vocab_size=50432,
                        max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
                        use_parallel_residual=True, tie_word_embeddings=False),
    "falcon-7b": dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=4544, num_hidden_layers=32,
                      num_attention_heads=71, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                      bias=False, alibi=False, vocab_size=65024, layer_norm_epsilon=1e-05),
    "opt-6.7b": dict(model_type="opt", architectures=["OPTForCausalLM"], hidden_size=4096, ffn_dim=16384,
                     num_hidden_layers=32, num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048,
                     word_embed_proj_dim=4096, do_layer_norm_before=True, dropout=0.1, activation_function="relu"),
    "mixtral-8x7b": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
                         rope_theta=1000000.0, sliding_window=None, rms_norm_eps=1e-05, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          max_position_embeddings=40960, rope_theta=1000000.0, sliding_window=None,
                          use_sliding_window=False, rms_norm_eps=1e-06, tie_word_embeddings=False),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
                             intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                             kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, first_k_dense_replace=1, n_routed_experts=64, n_shared_experts=2,
                             num_experts_per_tok=6, moe_intermediate_size=1408, moe_layer_freq=1, n_group=1,
                             topk_group=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
                             scoring_func="softmax", vocab_size=102400, max_position_embeddings=163840,
                             rope_theta=10000, rms_norm_eps=1e-06, tie_word_embeddings=False),
    "t5-large": dict(model_type="t5", architectures=["T5ForConditionalGeneration"], d_model=1024, d_ff=4096, d_kv=64,
                     num_heads=16, num_layers=24, num_decoder_layers=24, vocab_size=32128, dropout_rate=0.1,
                     feed_forward_proj="relu", relative_attention_num_buckets=32, decoder_start_token_id=0,
                     is_encoder_decoder=True, n_positions=512, layer_norm_epsilon=1e-06),
    "vit-h-14": dict(model_type="vit", architectures=["ViTModel"], hidden_size=1280, num_hidden_layers=32,
                     num_attention_heads=16, intermediate_size=5120, image_size=224, patch_size=14, num_channels=3,
                     qkv_bias=True, hidden_act="gelu", layer_norm_eps=1e-12),
}
SEQ_OF = {"opt-6.7b": 2048, "vit-h-14": None}


def write_configs(root: Path, names) -> dict[str, Path]:
    folders = {}
    for name in names:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        config = CONFIGS[name.removesuffix("-no-window")]
        if name.endswith("-no-window"):
            config = {**config, "sliding_window": None}
        (folder / "config.json").write_text(json.dumps(config))
        folders[name] = folder
    return folders


def row(name: str, folder: Path) -> dict:
    seq = SEQ_OF.get(name.removesuffix("-no-window"), SEQ)
    start = time.perf_counter()
    traced = autoplan.trace(f"hf:{folder}", seq_len=seq)
    plan = autoplan.search(traced, MEM, profile=H100)
    ops = traced.traces("bf16").at_1.ops
    block = f"{largest_module_list(traced.module)}.1"
    mine = [op for op in ops if op.module == block or op.module.startswith(block + ".")]
    p = plan.predicted
    return {"model": name, "seq_len": seq, "params_b": plan.model.n_params / 1e9,
            "tokens_s": p.throughput_tokens_s if seq else None, "samples_s": p.throughput_samples_s,
            "micro_batch": plan.training.micro_batch_size, "attention": list(dict.fromkeys(f"{r.kernel} ({r.detail})"
                                                                                       for r in plan.model.attention)),
            "layer_fwd_tflop": sum(op.fwd_flops for op in mine) / 1e12,
            "layer_activations_gb": sum(op.saved_bytes for op in mine) / 1e9,
            "unpriced": [r.op for r in plan.model.unpriced], "wall_s": time.perf_counter() - start}


def mixtral_analytic(tokens: int = SEQ) -> float:
    """A Mixtral-8x7B layer's forward: q, k, v, o; attention (the full square, as torch counts it); the router;
    two of eight SwiGLU experts per token."""
    d, kv, f = 4096, 8 * 128, 14336
    return (2 * tokens * d * (2 * d + 2 * kv) + 4 * tokens * tokens * d + 2 * tokens * d * 8
            + 2 * 3 * 2 * tokens * d * f)


def cli_header(folder: Path, out: Path) -> list[str]:
    """`autoplan search` from the command line, the lines that give the units."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = cli(["search", "--model", f"hf:{folder}", "--mem", MEM, "--profile", H100, "-o", str(out)]
                   + (["--seq-len", "512"] if "t5" in folder.name else []))
    lines = captured.getvalue().splitlines()
    return [f"exit {code}"] + [line for line in lines if line.startswith(("memory limit", "inputs:", "predicted step"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="these families only")
    args = parser.parse_args()
    names = args.only or list(CONFIGS) + ["mistral-7b-no-window"]
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_configs(Path(tmp), names)
        rows = []
        for name in names:
            rows.append(row(name, folders[name]))
            r = rows[-1]
            speed = f"{r['tokens_s']:,.0f} tokens/s" if r["tokens_s"] else f"{r['samples_s']:,.1f} samples/s"
            print(f"| {name} | {r['params_b']:.2f}B | {r['seq_len'] or '-'} | {speed} | {r['micro_batch']} | "
                  f"{r['layer_fwd_tflop']:.3f} | {r['layer_activations_gb']:.3f} | {'; '.join(r['attention'])} |",
                  flush=True)
        found = {r["model"]: r for r in rows}
        figures = {}
        if {"mistral-7b", "mistral-7b-no-window"} <= set(found):
            a, b = found["mistral-7b"]["tokens_s"], found["mistral-7b-no-window"]["tokens_s"]
            figures["mistral window / no window"] = a / b
        if {"falcon-7b", "pythia-6.9b"} <= set(found):
            figures["falcon-7b / pythia-6.9b tokens/s"] = found["falcon-7b"]["tokens_s"] / found["pythia-6.9b"]["tokens_s"]
        if "mixtral-8x7b" in found:
            figures["mixtral layer forward / analytic"] = found["mixtral-8x7b"]["layer_fwd_tflop"] * 1e12 / mixtral_analytic()
        for name in ("t5-large", "vit-h-14"):
            if name in folders:
                figures[f"{name} from the CLI"] = cli_header(folders[name], Path(tmp) / f"{name}.json")
    for key, value in figures.items():
        print(f"{key}: {value if isinstance(value, list) else f'{value:.4f}'}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "figures": figures}, indent=1) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
