"""The architecture table: fifteen Hugging Face families at small widths (config fields as their Hub
config.json files spell them), each priced as it runs. Per family:
- one block's forward FLOPs within 2% of a count written here from the config (projections, attention as
  torch's FlopCounter counts it, the MLP or the experts routed);
- one block's activations (the bytes its forward keeps for the backward) within 2% of a real CPU step of
  the same model, run with the attention `apply` runs (autoplan.run.attention) and measured with
  saved_tensors_hooks, each storage counted once for the block that saved it first, as the tracer does;
- the attention kernel named for each attention call (on CUDA, torch's pick).
"""

import json

import pytest
import torch

import autoplan
from autoplan.models.hf import build_hf_model
from autoplan.run.attention import planned_attention

pytest.importorskip("transformers")

SEQ = 64
D, F, H, HD = 64, 128, 4, 16  # width, MLP width, heads, head size


def _llama_like(model_type, architecture, **extra):
    return {**dict(model_type=model_type, architectures=[architecture], hidden_size=D, intermediate_size=F,
                   num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=2, vocab_size=256,
                   max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False), **extra}


CONFIGS = {
    "llama-3.1": _llama_like("llama", "LlamaForCausalLM", rope_theta=500000.0, rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}),
    "mistral": _llama_like("mistral", "MistralForCausalLM", sliding_window=4096),
    "qwen2": _llama_like("qwen2", "Qwen2ForCausalLM", sliding_window=131072, use_sliding_window=False,
                         max_window_layers=2),
    "qwen3": _llama_like("qwen3", "Qwen3ForCausalLM", head_dim=HD, sliding_window=None, use_sliding_window=False),
    "gemma-2": _llama_like("gemma2", "Gemma2ForCausalLM", head_dim=HD, attn_logit_softcapping=50.0,
                           final_logit_softcapping=30.0, query_pre_attn_scalar=HD, sliding_window=4096,
                           hidden_activation="gelu_pytorch_tanh"),
    "gemma-3": _llama_like("gemma3_text", "Gemma3ForCausalLM", head_dim=HD, num_key_value_heads=1, num_hidden_layers=6,
                           sliding_window=16, query_pre_attn_scalar=HD, rope_local_base_freq=10000,
                           hidden_activation="gelu_pytorch_tanh"),
    "phi-3": _llama_like("phi3", "Phi3ForCausalLM", num_key_value_heads=H, sliding_window=2047,
                         original_max_position_embeddings=4096, pad_token_id=0),
    "gpt-neox": dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=D,
                     intermediate_size=4 * D, num_hidden_layers=2, num_attention_heads=H, vocab_size=256,
                     max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True),
    "falcon": dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=D, num_hidden_layers=2,
                   num_attention_heads=H, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                   bias=False, alibi=False, vocab_size=256),
    "opt": dict(model_type="opt", architectures=["OPTForCausalLM"], hidden_size=D, ffn_dim=4 * D,
                num_hidden_layers=2, num_attention_heads=H, vocab_size=256, max_position_embeddings=128,
                word_embed_proj_dim=D, do_layer_norm_before=True, dropout=0.1, activation_function="relu"),
    "mixtral": _llama_like("mixtral", "MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2,
                           sliding_window=None),
    "qwen3-moe": _llama_like("qwen3_moe", "Qwen3MoeForCausalLM", head_dim=HD, num_experts=16, num_experts_per_tok=4,
                             moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek-v2-lite": _llama_like("deepseek_v2", "DeepseekV2ForCausalLM", num_key_value_heads=H,
                                    num_hidden_layers=3, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
                                    qk_nope_head_dim=HD, qk_rope_head_dim=8, v_head_dim=HD, n_routed_experts=8,
                                    n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=32,
                                    moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy",
                                    norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax"),
    "t5": dict(model_type="t5", architectures=["T5ForConditionalGeneration"], d_model=D, d_ff=F, d_kv=HD, num_heads=H,
               num_layers=2, num_decoder_layers=2, vocab_size=256, dropout_rate=0.1, feed_forward_proj="relu",
               relative_attention_num_buckets=32, decoder_start_token_id=0, is_encoder_decoder=True),
    "vit": dict(model_type="vit", architectures=["ViTForImageClassification"], hidden_size=D, num_hidden_layers=2,
                num_attention_heads=H, intermediate_size=F, image_size=32, patch_size=8, num_channels=3,
                qkv_bias=True, id2label={"0": "a", "1": "b"}),
}

BLOCKS = {"gpt-neox": "gpt_neox.layers.1.", "falcon": "transformer.h.1.", "opt": "model.decoder.layers.1.",
          "t5": "encoder.block.1.", "vit": "vit.layers.1."}


def attention(tokens: int, width: int = H * HD, v_width: int | None = None) -> int:
    """q @ k^T and the weights @ v over the full square, as torch's FlopCounter counts attention."""
    return 2 * tokens * tokens * width + 2 * tokens * tokens * (v_width or width)


def gated_mlp(tokens: int, hidden: int) -> int:
    return 3 * 2 * tokens * D * hidden


def projections(tokens: int, q: int, kv: int, o: int) -> int:
    return 2 * tokens * D * (q + 2 * kv) + 2 * tokens * o * D


def expected_flops(name: str, t: int = SEQ) -> int:
    """One block's forward FLOPs from its config."""
    grouped = projections(t, H * HD, 2 * HD, H * HD) + attention(t)
    if name in ("llama-3.1", "mistral", "qwen2", "qwen3", "gemma-2", "gemma-3"):
        kv = HD if name == "gemma-3" else 2 * HD
        return projections(t, H * HD, kv, H * HD) + attention(t) + gated_mlp(t, F)
    if name == "phi-3":
        return projections(t, D, D, D) + attention(t) + gated_mlp(t, F)
    if name in ("gpt-neox", "opt"):
        return projections(t, D, D, D) + attention(t) + 2 * 2 * t * D * 4 * D
    if name == "falcon":  # fused q, k, v of one key/value head
        return 2 * t * D * (D + 2 * HD) + 2 * t * D * D + attention(t) + 2 * 2 * t * D * 4 * D
    if name == "mixtral":
        return grouped + 2 * t * D * 8 + 2 * gated_mlp(t, F)
    if name == "qwen3-moe":
        return grouped + 2 * t * D * 16 + 4 * gated_mlp(t, 32)
    if name == "deepseek-v2-lite":  # latent attention: q, the compressed kv and its expansion, o; 8 experts, top 2
        qk = HD + 8
        mla = (2 * t * D * H * qk + 2 * t * D * (32 + 8) + 2 * t * 32 * H * (HD + HD) + 2 * t * H * HD * D
               + attention(t, H * qk, H * HD))
        return mla + 2 * t * D * 8 + 2 * gated_mlp(t, 32) + gated_mlp(t, 2 * 32)
    if name == "t5":
        return projections(t, D, D, D) + attention(t) + 2 * 2 * t * D * F
    if name == "vit":
        patches = (32 // 8) ** 2 + 1
        return projections(patches, D, D, D) + attention(patches) + 2 * 2 * patches * D * F
    raise AssertionError(name)


def model_dir(tmp_path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    return f"hf:{folder}"


def block_of(name: str) -> str:
    return BLOCKS.get(name, "model.layers.1.")


def in_block(op, block: str) -> bool:
    return op.module == block.rstrip(".") or op.module.startswith(block)


def traced_ops(model: str, device: str, dtype: str):
    traced = autoplan.trace(model, seq_len=None if "vit" in model else SEQ)
    traced.price_for(None, device)
    return traced, traced.traces(dtype).at_1.ops


def measured_saved_bytes(traced, block: str, plan) -> int:
    """Bytes the block's real CPU forward saves for its backward (bf16), each storage once, first saver."""
    built = build_hf_model(traced.name[3:])
    torch.manual_seed(0)
    model = type(built.module)(built.module.config).to(torch.bfloat16).train()
    inputs = {"input_ids": torch.randint(0, 256, (1, SEQ))}
    if traced.example_inputs is not None:
        inputs = {name: torch.randint(0, 256, t.shape) if not t.dtype.is_floating_point else
                  torch.randn(t.shape, dtype=torch.bfloat16)
                  for name, t in traced.example_inputs.at_batch(1, SEQ, "bf16")[1].items()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owner, seen, inside = {}, set(), [False]
    module = model.get_submodule(block.rstrip("."))
    module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    module.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            if inside[0]:
                owner[key] = storage.nbytes()
        return tensor

    with planned_attention(plan, model, "cpu"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(**inputs)
    del output
    return sum(owner.values())


@pytest.mark.slow  # traces each model twice and runs a CPU step of it: about 4 s a family
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_family_is_priced_as_it_runs(tmp_path, name):
    model = model_dir(tmp_path, name)
    block = block_of(name)
    _, cuda_ops = traced_ops(model, "cuda", "bf16")
    flops = sum(op.fwd_flops for op in cuda_ops if in_block(op, block))
    assert flops == pytest.approx(expected_flops(name), rel=0.02)
    kernels = {op.attention.split(":")[0] for op in cuda_ops if op.attention}
    assert kernels and kernels <= {"flash", "efficient", "math"}
    assert any(op.attention for op in cuda_ops if in_block(op, block))  # the block's kernel is named

    traced, cpu_ops = traced_ops(model, "cpu", "bf16")
    predicted = sum(op.saved_bytes for op in cpu_ops if in_block(op, block))
    plan = autoplan.search(traced, "10GB", gpus=2, profile="cpu-gloo-2", allow_over_device_mem=True)
    assert predicted == pytest.approx(measured_saved_bytes(traced, block, plan), rel=0.02)


def test_the_kernels_torch_would_pick_on_cuda(tmp_path):
    picked = {}
    for name in ("mistral", "gemma-2", "gemma-3", "falcon", "t5", "deepseek-v2-lite"):
        _, ops = traced_ops(model_dir(tmp_path, name), "cuda", "bf16")
        picked[name] = sorted({op.attention for op in ops if op.attention})
    assert picked["mistral"] == ["flash: causal, K/V 2 of 4 heads"]  # a window longer than the sequence
    assert picked["gemma-2"] == ["math: causal, soft-capped, K/V 2 of 4 heads"]  # torch's SDPA has no soft-capping
    assert picked["gemma-3"] == ["efficient: causal, window 16, K/V 1 of 4 heads", "flash: causal, K/V 1 of 4 heads"]
    assert picked["falcon"] == ["flash: causal, K/V 1 of 4 heads"]
    assert "efficient: learned position bias, dropout" in picked["t5"]
    assert picked["deepseek-v2-lite"] == ["efficient: causal"]  # q/k heads of 24, v of 16: no flash
