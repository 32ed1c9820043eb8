"""Mixtures of experts priced from the tokens routed (autoplan.models.moe, autoplan.tracing.flops), their experts
units of their own, and ops no FLOP formula prices listed and refused above the limit."""

import json
import textwrap

import pytest
import torch

import autoplan
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.models.zoo import build_model, get_config

SEQ = 64


def layer_forward_flops(model, seq_len: int = SEQ, block: str = "layers.1.", **settings) -> int:
    traced = autoplan.trace(model, seq_len=seq_len)
    if settings:
        traced.price_for(autoplan.SearchSettings.create(**settings), "cuda")
    return sum(op.fwd_flops for op in traced.traces("bf16").at_1.ops if op.module.startswith(block))


def analytic(name: str, tokens: int = SEQ, capacity_factor: float = 1.0) -> float:
    """One block's forward FLOPs from its config: projections, attention (the full square, as torch's
    FlopCounter counts it), the router, top_k experts per token and the shared experts."""
    c = get_config(name)
    kv = c.kv_heads * c.head_dim
    attention = 2 * tokens * c.d_model * (2 * c.d_model + 2 * kv) + 4 * tokens * tokens * c.d_model
    router = 2 * tokens * c.d_model * c.n_experts
    experts = capacity_factor * c.top_k * 3 * 2 * tokens * c.d_model * c.expert_ffn
    shared = 3 * 2 * tokens * c.d_model * c.expert_ffn * c.n_shared_experts
    return attention + router + experts + shared


@pytest.mark.parametrize("name", ["moe-tiny", "moe-fine-tiny", "mixtral-8x7b"])
def test_a_moe_layer_counts_its_routed_tokens(name):
    seq = 4096 if name == "mixtral-8x7b" else SEQ
    assert layer_forward_flops(name, seq) == pytest.approx(analytic(name, seq), rel=1e-6)


def test_hugging_face_moe_configs_count_their_experts(tmp_path):
    """Qwen2-MoE: 8 experts of 32, top 2, a shared expert of 64 behind a sigmoid gate; Mixtral: 8 of 128, top 2."""
    qwen2 = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)
    mixtral = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                   max_position_embeddings=4096, num_local_experts=8, num_experts_per_tok=2)
    t, d = SEQ, 64
    attention = 2 * t * d * (2 * d + 2 * 32) + 4 * t * t * d
    for config, routed, shared in ((qwen2, 2 * 3 * 2 * t * d * 32, 3 * 2 * t * d * 64 + 2 * t * d),
                                   (mixtral, 2 * 3 * 2 * t * d * 128, 0)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        flops = layer_forward_flops(f"hf:{tmp_path}", block="model.layers.1.")
        assert flops == pytest.approx(attention + 2 * t * d * 8 + routed + shared, rel=1e-6), config["model_type"]


def test_the_capacity_factor_scales_the_expert_matmuls_and_the_plan_says_so():
    flops = layer_forward_flops("moe-tiny", capacity_factor=1.25)
    assert flops == pytest.approx(analytic("moe-tiny", capacity_factor=1.25), rel=1e-6)
    plan = autoplan.search("moe-tiny", "1GB", gpus=2, seq_len=SEQ, capacity_factor=1.25)
    assert plan.model.capacity_factor == 1.25
    assert "expert matmuls priced at capacity factor 1.25" in str(plan)
    with pytest.raises(UsageError, match="`capacity_factor` must be at least 1"):
        autoplan.search("moe-tiny", "1GB", gpus=2, seq_len=SEQ, capacity_factor=0.5)


def test_the_experts_are_a_unit_of_their_own():
    plan = autoplan.search("moe-fine-tiny", "1GB", gpus=2, seq_len=SEQ)
    units = [unit.module for unit in plan.units]
    assert "layers.0.mlp.experts" in units and "layers.1.mlp.experts" in units
    experts = next(unit for unit in plan.units if unit.module == "layers.0.mlp.experts")
    assert set(experts.param_shapes) == {"layers.0.mlp.experts.w1", "layers.0.mlp.experts.w2",
                                         "layers.0.mlp.experts.w3"}


def test_the_zoo_moe_routes_as_a_loop_over_experts_would():
    """The grouped-matmul dispatch equals running each token through its chosen experts one by one."""
    torch.manual_seed(0)
    model = build_model("moe-fine-tiny", device="cpu")
    moe = model.layers[0].mlp
    x = torch.randn(2, 16, 64)
    flat = x.flatten(0, 1)
    weights, experts = moe.router(flat)
    expected = torch.zeros_like(flat)
    e = moe.experts
    for t in range(flat.shape[0]):
        for w, k in zip(weights[t], experts[t]):
            hidden = torch.nn.functional.silu(flat[t] @ e.w1[k].T) * (flat[t] @ e.w3[k].T)
            expected[t] += w * (hidden @ e.w2[k].T)
    torch.testing.assert_close(moe(x), expected.view_as(x) + moe.shared(x), rtol=1e-4, atol=1e-5)


FACTORY = textwrap.dedent('''
    import torch
    from torch import nn

    @torch.library.custom_op("autoplan_test::matmul", mutates_args=())
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    @matmul.register_fake
    def _(a, b):
        return a.new_empty(*a.shape[:-1], b.shape[-1])

    def _backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.T, a.flatten(0, -2).T @ grad.flatten(0, -2)

    matmul.register_autograd(_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 64)
            self.weight = nn.Parameter(torch.zeros(64, 64))
            self.head = nn.Linear(64, 256)

        def forward(self, ids):
            return self.head(matmul(self.emb(ids), self.weight))

    def build():
        return Model()
''')


def test_an_op_no_formula_prices_is_named_and_refused_above_the_limit(tmp_path, monkeypatch, capsys):
    (tmp_path / "custom_mm.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["search", "--model", "custom_mm:build", "--mem", "1GB", "--gpus", "2", "--seq-len", "32"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "autoplan_test.matmul" in err and "--allow-unpriced" in err and not (tmp_path / "plan.json").exists()
    traced = autoplan.trace("custom_mm:build", seq_len=32)  # reading the model is fine; planning it is refused
    with pytest.raises(UsageError, match="autoplan_test.matmul"):
        autoplan.search(traced, "1GB", gpus=2)
    assert main(argv + ["--allow-unpriced"]) == 0
    out = capsys.readouterr().out
    assert "unpriced: autoplan_test.matmul in <root> (1 calls;" in out and "(--allow-unpriced)" in out
    unpriced = json.loads((tmp_path / "plan.json").read_text())["model"]["unpriced"]
    assert unpriced[0]["op"] == "autoplan_test.matmul" and unpriced[0]["flops_guess"] >= 2 * 32 * 64 * 64
