"""Attention priced as the kernel that runs it (cost_models.attention, autoplan.tracing.attention) and run so
by `apply` (autoplan.run.attention), on tiny Hugging Face configs written here and the zoo."""

import json

import pytest
import torch

import autoplan
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.models.hf import build_hf_model
from autoplan.plan.schema import load_plan
from autoplan.run.attention import check_attention, planned_attention
from cost_models.attention import band_share

pytest.importorskip("transformers")

MISTRAL = dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
               max_position_embeddings=4096, sliding_window=None)
FALCON = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
              alibi=False, vocab_size=256)
GEMMA2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
              max_position_embeddings=512, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              query_pre_attn_scalar=16, sliding_window=16)
T5 = dict(model_type="t5", architectures=["T5ForConditionalGeneration"], d_model=64, d_ff=128, d_kv=16, num_heads=4,
          num_layers=2, num_decoder_layers=2, vocab_size=256, dropout_rate=0.0, decoder_start_token_id=0,
          is_encoder_decoder=True)
SEQ = 64


def hf(tmp_path, config: dict, **changes) -> str:
    folder = tmp_path / f"{config['model_type']}-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return f"hf:{folder}"


def attention_ops(model: str, seq_len: int = SEQ, **pricing):
    traced = autoplan.trace(model, seq_len=seq_len)
    if pricing:
        traced.price_for(autoplan.SearchSettings.create(**pricing.get("settings", {})), pricing.get("device", "cuda"))
    return [op for op in traced.traces("bf16").at_1.ops if op.attention]


def test_a_window_as_long_as_the_sequence_plans_as_causal_attention(tmp_path):
    """Mistral-style sliding_window equal to the sequence is causal attention: the same plan as no window."""
    windowed = autoplan.search(hf(tmp_path, MISTRAL, sliding_window=SEQ), "200MB", gpus=2, seq_len=SEQ,
                              fit_to="allocated")
    plain = autoplan.search(hf(tmp_path, MISTRAL), "200MB", gpus=2, seq_len=SEQ, fit_to="allocated")
    # the same attention; transformers' sliding-window cache runs a few tiny ops more (half a percent of this
    # toy's step, 0.02% of Mistral-7B's: benchmarks/RESULTS.md section 14)
    ops = [[(op.fwd_flops, op.bwd_flops, op.saved_bytes)
            for op in attention_ops(hf(tmp_path, MISTRAL, sliding_window=w))] for w in (SEQ, None)]
    assert ops[0] == ops[1]
    assert windowed.predicted.step_time_s == pytest.approx(plain.predicted.step_time_s, rel=0.01)
    assert windowed.predicted.peak_mem_bytes == pytest.approx(plain.predicted.peak_mem_bytes, rel=1e-3)
    assert [(r.kernel, r.detail) for r in windowed.model.attention] == [("flash", "causal, K/V 2 of 4 heads")]


def test_a_shorter_window_is_efficient_by_default_and_a_band_for_flash(tmp_path):
    model = hf(tmp_path, MISTRAL, sliding_window=16)
    default = attention_ops(model)
    assert {op.attention for op in default} == {"efficient: causal, window 16, K/V 2 of 4 heads"}
    flash = attention_ops(model, settings={"attention": "flash"})
    assert {op.attention for op in flash} == {"flash in flash-attn's kernel: causal, window 16, K/V 2 of 4 heads"}
    causal = attention_ops(hf(tmp_path, MISTRAL))
    assert flash[0].fwd_flops == pytest.approx(causal[0].fwd_flops * band_share(SEQ, 16), rel=1e-3)
    assert flash[0].bwd_flops == pytest.approx(causal[0].bwd_flops * band_share(SEQ, 16), rel=1e-3)
    # the efficient kernel saves the window's mask as an additive bias, K and V repeated to 4 heads, and its
    # random-number state (two int64 words)
    mask_bytes, kv_bytes = SEQ * SEQ * 2, 2 * 2 * SEQ * 16 * 2
    assert default[0].saved_bytes - causal[0].saved_bytes == mask_bytes + kv_bytes + 16
    # on the CPU torch's flash kernel takes the mask itself
    cpu = attention_ops(model, device="cpu")
    assert {op.attention for op in cpu} == {"flash: causal, window 16, K/V 2 of 4 heads"}


def test_multi_query_keys_are_priced_unrepeated_as_flash(tmp_path):
    """Falcon passes one K/V head and a causal mask of its own straight to SDPA: flash, no repeat, no mask."""
    ops = attention_ops(hf(tmp_path, FALCON), seq_len=SEQ)
    assert {op.attention for op in ops} == {"flash: causal, K/V 1 of 4 heads"}
    q, kv, out, lse = 4 * SEQ * 16 * 2, SEQ * 16 * 2, 4 * SEQ * 16 * 2, 4 * SEQ * 4
    assert ops[0].saved_bytes <= q + 2 * kv + out + lse  # q may be saved by the projection before it


def test_math_saves_the_scores_and_an_impossible_kernel_is_refused(tmp_path, capsys, monkeypatch):
    model = hf(tmp_path, MISTRAL)
    short, long = (sum(op.saved_bytes for op in attention_ops(model, n, settings={"attention": "math"}))
                   for n in (32, 64))
    assert long / short > 2.5  # the S x S scores; flash's grow linearly
    flash_short, flash_long = (sum(op.saved_bytes for op in attention_ops(model, n)) for n in (32, 64))
    assert flash_long == 2 * flash_short
    with pytest.raises(UsageError, match=r"attention in module 'encoder.block.0.layer.0.SelfAttention': flash "
                                         r"attention cannot run this call \(learned position bias\): flash kernels"):
        autoplan.search(hf(tmp_path, T5), "1GB", gpus=2, seq_len=32, attention="flash")
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", hf(tmp_path, T5), "--mem", "1GB", "--gpus", "2", "--seq-len", "32",
                 "--attention", "flash"]) == 2
    assert "--attention" in capsys.readouterr().err and not (tmp_path / "plan.json").exists()


def test_the_plan_records_the_kernels_and_the_report_names_them(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", hf(tmp_path, GEMMA2), "--mem", "1GB", "--gpus", "2", "--seq-len", "32",
                 "--attention", "eager"]) == 0
    out = capsys.readouterr().out
    assert "attention (math, asked): math (causal, window 16, soft-capped, K/V 2 of 4 heads) in model.layers.0." in out
    data = json.loads((tmp_path / "plan.json").read_text())["model"]
    assert data["attention_request"] == "math"
    assert [row["modules"] for row in data["attention"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    plan = autoplan.search("llama-tiny", "1GB", gpus=2, seq_len=64, attention="sdpa")  # sdpa: torch's pick
    assert plan.model.attention_request is None
    assert [(r.modules, r.count, r.kernel) for r in plan.model.attention] == [("layers.0-1.attn", 2, "flash")]


@pytest.mark.parametrize("config, changes", [
    (MISTRAL, {"sliding_window": 16}), (MISTRAL, {"sliding_window": SEQ}), (FALCON, {}), (GEMMA2, {}), (T5, {}),
])
@pytest.mark.parametrize("request_", [None, "math"])
def test_apply_s_kernels_compute_the_model_s_own_attention(tmp_path, config, changes, request_):
    """The same logits under the plan's kernels (masks skipped, windows and soft-capping as arguments, K and V
    unrepeated) as under transformers' own attention, on the CPU."""
    built = build_hf_model(hf(tmp_path, config, **changes)[3:])
    torch.manual_seed(0)
    model = type(built.module)(built.module.config).float().eval()  # on the CPU, initialised as transformers does
    ids = torch.randint(0, 256, (2, SEQ))
    inputs = {"input_ids": ids, **({"decoder_input_ids": ids[:, :16]} if config is T5 else {})}
    expected = model(**inputs).logits
    plan = autoplan.search(hf(tmp_path, config, **changes), "1GB", gpus=2, seq_len=SEQ, profile="cpu-gloo-2",
                           attention=request_, allow_over_device_mem=True)
    with planned_attention(plan, model, "cpu"):
        got = model(**inputs).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_apply_runs_a_cuda_kernel_s_calls_on_the_cpu_or_refuses(tmp_path, monkeypatch, capsys):
    """A plan for CUDA runs on the CPU with torch's flash kernel given the planned kernel's inputs; a learned
    bias (T5's position bias on the efficient kernel) cannot be, and apply says so before any rank starts."""
    model = hf(tmp_path, MISTRAL, sliding_window=16)
    plan = autoplan.search(model, "1GB", gpus=2, seq_len=SEQ)  # the default A100 profile: efficient
    check_attention(plan, "cpu")
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", hf(tmp_path, T5), "--mem", "1GB", "--gpus", "2", "--seq-len", "32",
                 "-o", "plan.json"]) == 0
    with pytest.raises(UsageError, match=r"as the efficient kernel; on the cpu torch's flash kernel would stand in "
                                         r"for it, and it takes no bias that needs a gradient"):
        check_attention(load_plan(tmp_path / "plan.json"), "cpu")
    with pytest.raises(SystemExit) as exited:  # apply's usage errors go through its parser
        main(["apply", "plan.json", "--nproc", "1"])
    assert exited.value.code == 2 and "learned position bias" in capsys.readouterr().err


def test_a_checkpointed_recompute_in_another_thread_runs_the_forward_s_executor():
    """On CUDA autograd runs the backward, and a checkpointed unit's recomputed forward, in a thread of its own,
    which sees none of the forward's context variables: the recompute must still run the executor in force
    (else torch picks its own kernel, cuDNN where the forward ran flash, and checkpoint refuses the recompute)."""
    import threading

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from autoplan.models.attention import SDPA, attention_executor, patched_sdpa

    calls = []

    def executor(site, call):
        calls.append(site.causal)
        return SDPA(call.query, call.key, call.value, is_causal=site.causal)

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with patched_sdpa(), attention_executor(executor):
        out = checkpoint(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), q, use_reentrant=False)
        backward = threading.Thread(target=lambda: out.sum().backward())
        backward.start()
        backward.join()
    assert calls == [True, True]  # the forward and its recompute
    assert q.grad is not None
