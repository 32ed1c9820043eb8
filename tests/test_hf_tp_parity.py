"""Tensor parallelism for Hugging Face layouts (autoplan.models.tp_layout): the Llama family's q/k/v/o and
gate/up/down projections (Llama, Qwen2 with its biases, Gemma-2 with its soft-capped eager attention),
GPT-NeoX's head-by-head fused q/k/v, Falcon's by key/value group (with biases), Phi-3's fused q-then-k-then-v
and gate-then-up projections (with grouped-query attention: sections of unequal widths), and mixtures of
experts (the zoo's moe-tiny; Mixtral; Qwen2-MoE with its shared expert and the shared expert's gate) with their
experts split by width, searched at degree 2 and applied with parallelize_module on the model's own module
names, train on two gloo ranks as one process does on the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan.models.hf import build_hf_model
from autoplan.errors import CheckpointError
from autoplan.models.tp_layout import recognise
from autoplan.run.tp import check_resume_degree
from cost_models.tensor_parallel import TpRole

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
    "falcon": dict(model_type="falcon", architectures=["FalconForCausalLM"], new_decoder_architecture=True,
                   num_kv_heads=2, parallel_attn=True, bias=True, alibi=False, **BASE),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], num_key_value_heads=2, pad_token_id=0, **BASE),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **BASE),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=False, **BASE),
}
MOE = ("mixtral", "qwen2_moe", "moe_zoo", "moe_zoo_ckpt")  # traced in bf16 (torch's meta _grouped_mm: no fp32)
ZOO = {"moe_zoo": "moe-tiny", "moe_zoo_ckpt": "moe-tiny"}  # the zoo's experts (8 of 96, top 2), beside transformers'
CHECKPOINTED = ("moe_zoo_ckpt",)  # every block and experts unit fully checkpointed: the experts' hooks run again


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    for name in [*FAMILIES, *ZOO]:
        (root / name).mkdir()
        if name in ZOO:
            (root / name / "zoo").write_text(ZOO[name])
        else:
            (root / name / "config.json").write_text(json.dumps(FAMILIES[name]))
        plan = autoplan.search(ZOO.get(name, f"hf:{root / name}"), "1GB", gpus=2, seq_len=32, profile="cpu-gloo-2",
                               tp=2, sequence_parallel="off", strategy="shard", batch_size=2,
                               dtype="bf16-mixed" if name in MOE else "fp32")
        plan.training.dtype = "fp32"  # the layout is the same at any precision; the parity is exact in fp32
        for unit in plan.units[1:] if name in CHECKPOINTED else ():
            unit.checkpoint = "full"
        plan.save(root / name / "plan.json")
    out = tmp_path_factory.mktemp("hf_tp_out") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
         str(TESTS_DIR / "hf_tp_parity_worker.py"), str(root), str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", [*FAMILIES, *ZOO])
def test_a_tensor_parallel_plan_trains_as_one_process(results, family):
    result = results[family]
    assert "error" not in result, result.get("error")
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert result["max_param_diff"] < 5e-5
    assert result["tp_split"] == result["layout_split"] >= 2 * 4  # every split parameter is a DTensor on "tp"
    blocks = {layout for module, layout in result["units"].items() if "layers." in module or ".h." in module}
    assert blocks == {"megatron"}


def test_the_experts_and_the_fused_sections_are_split_as_torchtitan_splits_them(results):
    mixtral, phi3 = results["mixtral"], results["phi3"]
    # each expert split by width on every rank: gate_up by rows (section by section), down by columns
    assert mixtral["local_shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == [4, 128, 64]
    assert mixtral["local_shapes"]["model.layers.0.mlp.experts.down_proj"] == [4, 64, 64]
    assert mixtral["local_shapes"]["model.layers.0.mlp.gate.weight"] == [4, 64]  # the router stays whole
    # Phi-3's q (4 heads of 16), k and v (2 heads each): each rank holds 2 q heads, 1 k head and 1 v head
    assert phi3["local_shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == [64, 64]
    assert phi3["units"]["model.layers.0"] == "megatron"


def test_falcon_is_split_by_key_value_group(tmp_path):
    """Falcon's fused q/k/v holds each key/value group's q heads, k and v together (the new decoder
    architecture), so whole groups go to each rank: a plain split by rows (its parity: the family above)."""
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["falcon"]))
    layout = recognise(build_hf_model(tmp_path).module, 2, False)
    assert layout.roles["transformer.h.0.self_attention.query_key_value"] is TpRole.COLWISE
    assert layout.split_params["transformer.h.0.self_attention.dense.weight"] == 1
    assert not layout.fused


@pytest.mark.parametrize(("config", "message"), [
    (dict(model_type="falcon", architectures=["FalconForCausalLM"], multi_query=True, **BASE),
     r"1 key/value heads \(grouped- or multi-query attention\) do not divide"),
    (dict(model_type="falcon", architectures=["FalconForCausalLM"], multi_query=False, alibi=True, **BASE),
     r"ALiBi"),
])
def test_layouts_that_cannot_be_split_say_why(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(autoplan.UsageError, match=message):
        autoplan.search(f"hf:{tmp_path}", "1GB", gpus=2, seq_len=32, tp=2)


def test_a_checkpoint_of_reordered_fused_rows_resumes_at_its_own_degree_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["phi3"]))
    model = build_hf_model(tmp_path).module
    check_resume_degree(model, 2, 2, "ckpt/step-3")  # the same order
    with pytest.raises(CheckpointError, match=r"saved at tensor-parallel degree 2, and its fused projections "
                                              r"\(model.layers.0.self_attn.qkv_proj.weight and 3 more\)"):
        check_resume_degree(model, 2, 1, "ckpt/step-3")
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["llama"]))
    check_resume_degree(build_hf_model(tmp_path).module, 2, 1, "ckpt/step-3")  # nothing fused: DCP reshards


def test_experts_split_by_width_and_by_expert_at_once_are_refused():
    with pytest.raises(autoplan.UsageError, match=r"tensor parallelism splits the experts by width, and expert "
                                                  r"parallelism \(2-way\) by expert: both at once is not built"):
        autoplan.search("moe-tiny", "1GB", gpus=4, seq_len=32, profile="cpu-gloo-2", tp=2, ep=2,
                        sequence_parallel="off")
