"""Tensor parallelism for Hugging Face layouts (autoplan.models.tp_layout): the Llama family's q/k/v/o and
gate/up/down projections (Llama, Qwen2 with its biases, Gemma-2 with its soft-capped eager attention) and
GPT-NeoX's head-by-head fused q/k/v, searched at degree 2 and applied with parallelize_module on the model's own
module names, train on two gloo ranks as one process does on the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan

TESTS_DIR = Path(__file__).parent
REPO_ROOT = TESTS_DIR.parent
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("transformers")

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=2, **BASE),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=2, **BASE),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_key_value_heads=2, head_dim=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                   sliding_window=16, **BASE),
    "gpt_neox": dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], rotary_pct=0.25,
                     use_parallel_residual=True, **{**BASE, "intermediate_size": 256}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    for name, config in FAMILIES.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        plan = autoplan.search(f"hf:{root / name}", "1GB", gpus=2, seq_len=32, profile="cpu-gloo-2", tp=2,
                               sequence_parallel="off", strategy="shard", batch_size=2, dtype="fp32")
        plan.save(root / name / "plan.json")
    out = tmp_path_factory.mktemp("hf_tp_out") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
         str(TESTS_DIR / "hf_tp_parity_worker.py"), str(root), str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tensor_parallel_plan_trains_as_one_process(results, family):
    result = results[family]
    assert "error" not in result, result.get("error")
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert result["max_param_diff"] < 5e-5
    assert result["tp_split"] >= 2 * 6  # every block's projections split over the tensor-parallel group
    assert {layout for module, layout in result["units"].items() if ".layers." in module} == {"megatron"}


def test_layouts_that_cannot_be_split_say_why(tmp_path):
    phi3 = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], num_key_value_heads=4, pad_token_id=0, **BASE)
    (tmp_path / "config.json").write_text(json.dumps(phi3))
    with pytest.raises(autoplan.UsageError, match=r"fused matrix \(qkv_proj\)"):
        autoplan.search(f"hf:{tmp_path}", "1GB", gpus=2, seq_len=32, tp=2)
