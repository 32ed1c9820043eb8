import dataclasses
import json
import textwrap

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import autoplan
from autoplan.models.factory import load_factory
from autoplan.models.zoo import (
    ALIASES,
    PRESETS,
    ModelConfig,
    UnknownModelError,
    build_model,
    count_params,
    get_config,
    model_names,
)

TINY = ["gpt2-tiny", "llama-tiny", "bert-tiny"]
CAUSAL_TINY = ["gpt2-tiny", "llama-tiny"]

# Published parameter counts (tied embeddings counted once).
PUBLISHED_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,  # Meta-Llama-3-70B
    "llama-1b": 1_235_814_400,  # Llama-3.2-1B
    "bert-large": 335_174_458,  # HF BertForMaskedLM, bert-large-uncased
}


def materialise(name: str, seed: int = 0) -> nn.Module:
    model = build_model(name)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def random_ids(config: ModelConfig, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=gen)


def tied_pair(model: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    family = model.config.family
    if family == "gpt2":
        return model.transformer.wte.weight, model.lm_head.weight
    if family == "llama":
        return model.tok_embeddings.weight, model.lm_head.weight
    return model.embeddings.word_embeddings.weight, model.mlm_head.decoder.weight


# --------------------------------------------------------------------------- #
# Presets and configs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name,expected", PUBLISHED_COUNTS.items())
def test_published_param_counts(name, expected):
    model = build_model(name)
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) == expected


def test_llama3_405b_is_about_405b():
    assert count_params(build_model("llama3-405b")) == pytest.approx(405.8e9, rel=1e-3)


def test_all_presets_build_on_meta():
    for name in PRESETS:
        model = build_model(name)
        assert model.config == PRESETS[name]
        assert count_params(model) > 0


def test_aliases():
    assert get_config("gpt2-1.5b") is PRESETS["gpt2-xl"]
    assert get_config("GPT2-XL") is PRESETS["gpt2-xl"]
    for alias, target in ALIASES.items():
        assert target in PRESETS
        assert alias not in PRESETS
        assert get_config(alias) == PRESETS[target]
    assert count_params(build_model("gpt2-1.5b")) == PUBLISHED_COUNTS["gpt2-xl"]


def test_model_names_in_table_order_with_aliases_marked():
    names = model_names()
    plain = [n for n in names if "(" not in n]
    assert plain == list(PRESETS)
    assert "gpt2-1.5b (= gpt2-xl)" in names
    assert names.index("gpt2-1.5b (= gpt2-xl)") == names.index("gpt2-xl") + 1


def test_unknown_name_lists_names_and_factory_form():
    with pytest.raises(UnknownModelError) as info:
        get_config("gpt5-mega")
    message = str(info.value)
    assert "gpt5-mega" in message
    for name in PRESETS:
        assert name in message
    assert "gpt2-1.5b" in message
    assert "package.module:factory" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownModelError):
        build_model("gpt5-mega")


def test_overrides():
    config = get_config("gpt2", n_layers=2, max_seq_len=256)
    assert (config.n_layers, config.max_seq_len, config.d_model) == (2, 256, 768)
    assert PRESETS["gpt2"].n_layers == 12  # presets untouched
    # A family-default MLP size follows an overridden d_model.
    assert get_config("gpt2", d_model=1024, n_heads=16).ffn_dim == 4096


def test_config_round_trips_through_json():
    for config in PRESETS.values():
        data = json.loads(json.dumps(dataclasses.asdict(config)))
        assert ModelConfig(**data) == config
        assert ModelConfig.from_dict(config.to_dict()) == config


def test_family_defaults():
    assert PRESETS["gpt2"].tie_embeddings is True
    assert PRESETS["llama2-7b"].tie_embeddings is False
    assert PRESETS["bert-large"].tie_embeddings is True
    assert PRESETS["llama-1b"].tie_embeddings is True
    assert PRESETS["bert-large"].norm_eps == 1e-12
    assert PRESETS["llama2-70b"].kv_heads == 8
    assert PRESETS["llama2-7b"].kv_heads == 32
    assert PRESETS["bert-large"].ffn_dim == 4096


def test_llama_ffn_dim_follows_meta_formula():
    def llama(d_model, **kw):
        return ModelConfig("llama", 1, d_model // 128, d_model, vocab_size=32000, max_seq_len=16, **kw)

    assert llama(4096).ffn_dim == 11008  # llama2-7b
    assert llama(5120).ffn_dim == 13824  # llama2-13b
    assert llama(8192, ffn_dim_multiplier=1.3, multiple_of=4096).ffn_dim == 28672  # llama2-70b
    assert llama(4096, ffn_dim_multiplier=1.3, multiple_of=1024).ffn_dim == 14336  # llama3-8b
    assert llama(4096, ffn_hidden=1000).ffn_dim == 1000


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(family="mamba"),
        dict(d_model=65),
        dict(n_kv_heads=3),
        dict(n_layers=0),
    ],
)
def test_invalid_configs_raise(kwargs):
    base = dict(family="llama", n_layers=2, n_heads=4, d_model=64, vocab_size=100, max_seq_len=32)
    with pytest.raises(ValueError):
        ModelConfig(**{**base, **kwargs})


def test_gqa_only_for_llama():
    with pytest.raises(ValueError):
        get_config("gpt2-tiny", n_kv_heads=2)


# --------------------------------------------------------------------------- #
# Structure
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "name,path",
    [("gpt2-tiny", "transformer.h"), ("llama-tiny", "layers"), ("bert-tiny", "encoder.layer")],
)
def test_blocks_are_a_module_list_with_attn_and_mlp(name, path):
    model = build_model(name)
    assert type(model).block_list_path == path
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList)
    assert len(blocks) == model.config.n_layers
    for block in blocks:
        assert isinstance(block.attn, nn.Module)
        assert isinstance(block.mlp, nn.Module)


def test_rope_frequencies_are_a_non_persistent_buffer():
    model = build_model("llama-tiny")
    assert [name for name, _ in model.named_buffers()] == ["inv_freq"]  # as Hugging Face's
    assert "inv_freq" not in model.state_dict() and "inv_freq" not in dict(model.named_parameters())
    assert model.inv_freq.shape == (model.config.head_dim // 2,)


# --------------------------------------------------------------------------- #
# Tracing
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", TINY)
def test_symbolic_trace_on_meta(name):
    graph_module = torch.fx.symbolic_trace(build_model(name))
    targets = {node.target for node in graph_module.graph.nodes if node.op == "call_function"}
    assert F.scaled_dot_product_attention in targets


@pytest.mark.parametrize("name", ["gpt2-xl", "llama2-70b", "bert-large"])
def test_symbolic_trace_full_size_on_meta(name):
    torch.fx.symbolic_trace(build_model(name))


@pytest.mark.parametrize("name", TINY)
def test_traced_module_matches_eager(name):
    model = materialise(name)
    traced = torch.fx.symbolic_trace(model)
    ids = random_ids(model.config, seq=11)
    with torch.no_grad():
        torch.testing.assert_close(traced(ids), model(ids))


# --------------------------------------------------------------------------- #
# Materialised tiny models
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name):
    model = materialise(name)
    config = model.config
    ids = random_ids(config, seq=config.max_seq_len)
    logits = model(ids)
    assert logits.shape == (2, config.max_seq_len, config.vocab_size)
    assert logits.dtype == torch.float32
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
    assert torch.isfinite(loss)
    # Freshly initialised logits are near uniform.
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 1.0
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname


@pytest.mark.parametrize("name", TINY)
def test_tied_weight_is_one_parameter(name):
    for model in (build_model(name), materialise(name)):
        embedding, head = tied_pair(model)
        if model.config.tie_embeddings:
            assert embedding is head
        else:
            assert embedding is not head
    untied = build_model(get_config("gpt2-tiny", tie_embeddings=False))
    embedding, head = tied_pair(untied)
    assert embedding is not head
    assert count_params(untied) == count_params(build_model("gpt2-tiny")) + embedding.numel()


def test_llama_tiny_untied_and_tied_variants():
    untied = build_model("llama-tiny")
    tied = build_model(get_config("llama-tiny", tie_embeddings=True))
    assert count_params(untied) - count_params(tied) == 512 * 64


@pytest.mark.parametrize("name", TINY)
def test_init_weights_is_deterministic_and_follows_scheme(name):
    a, b = materialise(name, seed=3), materialise(name, seed=3)
    for (name_a, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name_a
    for module in a.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
        if isinstance(module, nn.Linear) and module.bias is not None:
            assert torch.equal(module.bias, torch.zeros_like(module.bias))
    embedding, _ = tied_pair(a)
    assert embedding.std().item() == pytest.approx(0.02, rel=0.1)
    c = materialise(name, seed=4)
    assert not torch.equal(tied_pair(a)[0], tied_pair(c)[0])


def test_init_weights_recomputes_rope_buffers():
    model = materialise("llama-tiny")
    reference = build_model("llama-tiny", device="cpu")
    torch.testing.assert_close(model.inv_freq, reference.inv_freq)
    assert model.inv_freq[0] == 1 and model.inv_freq.diff().lt(0).all()


def test_llama_saves_what_hugging_face_llama_saves(tmp_path):
    """The zoo's Llama and transformers' LlamaForCausalLM of one config save the same bytes for backward
    (per op kind, block 0, traced in bf16); nn.RMSNorm would save 8 bytes an element to their 6."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=352,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)))
    zoo = "llama-tiny[d_model=128,n_heads=4,n_kv_heads=2,ffn_hidden=352,vocab_size=512,max_seq_len=256,n_layers=2]"

    def saved(model: str, block: str) -> dict[str, int]:
        trace = autoplan.trace(model, seq_len=256).traces("bf16").at_2
        kinds: dict[str, int] = {}
        for op in trace.ops:
            if op.module.startswith(block) and op.saved_bytes:
                kind = {"LlamaRMSNorm": "RMSNorm", "SiLUActivation": "silu"}.get(op.kind, op.kind)
                kinds[kind] = kinds.get(kind, 0) + op.saved_bytes
        return kinds

    ours, theirs = saved(zoo, "layers.0"), saved(f"hf:{tmp_path}", "model.layers.0")
    assert ours == theirs
    # two norms of micro-batch 2 x 256 tokens x 128: 6 bytes an element and the fp32 reciprocal RMS per token
    assert ours["RMSNorm"] == 2 * (2 * 256 * 128 * 6 + 2 * 256 * 4)


def test_build_on_cpu_is_initialised():
    torch.manual_seed(0)
    model = build_model("gpt2-tiny", device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.transformer.ln_f.weight, torch.ones(64))
    assert model.transformer.wte.weight is model.lm_head.weight


@pytest.mark.parametrize("name", CAUSAL_TINY)
def test_causal_models_ignore_future_tokens(name):
    model = materialise(name)
    ids = random_ids(model.config, batch=1, seq=12)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_bert_is_bidirectional():
    model = materialise("bert-tiny")
    ids = random_ids(model.config, batch=1, seq=12)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, 0], model(changed)[:, 0])


def test_llama_gqa_matches_full_heads_when_kv_weights_repeated():
    # A GQA model equals a full-head model whose k/v projections repeat each kv head.
    gqa = materialise("llama-tiny")
    full = build_model(get_config("llama-tiny", n_kv_heads=None), device="cpu")
    state = dict(gqa.state_dict())
    n_rep = gqa.config.n_heads // gqa.config.kv_heads
    head_dim = gqa.config.head_dim
    for key, value in state.items():
        if key.endswith("attn.wk.weight") or key.endswith("attn.wv.weight"):
            state[key] = value.unflatten(0, (-1, head_dim)).repeat_interleave(n_rep, dim=0).flatten(0, 1)
    full.load_state_dict(state)
    ids = random_ids(gqa.config, seq=10)
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), full(ids))


# --------------------------------------------------------------------------- #
# load_factory / count_params
# --------------------------------------------------------------------------- #


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "zoo_factories_for_test.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            def make():
                return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

            def not_a_module():
                return 42

            class Builders:
                @staticmethod
                def small():
                    return nn.Linear(3, 3)

            CONSTANT = 7
            """
        )
    )
    (tmp_path / "zoo_broken_for_test.py").write_text("import surely_not_a_real_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "zoo_factories_for_test"


def test_load_factory(factory_module):
    model = load_factory(f"{factory_module}:make")
    assert isinstance(model, nn.Sequential)
    assert count_params(model) == 4 * 8 + 8 + 8 * 2 + 2
    assert isinstance(load_factory(f"{factory_module}:Builders.small"), nn.Linear)


def test_load_factory_on_meta(factory_module):
    model = load_factory(f"{factory_module}:make", device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_load_factory_missing_module(factory_module):
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_abc'"):
        load_factory("no_such_module_abc:make")
    with pytest.raises(ValueError, match="cannot import module"):
        load_factory(f"{factory_module}.sub:make")


def test_load_factory_keeps_import_errors_inside_the_module(factory_module):
    with pytest.raises(ModuleNotFoundError, match="surely_not_a_real_package_xyz"):
        load_factory("zoo_broken_for_test:make")


def test_load_factory_missing_attribute(factory_module):
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_factory(f"{factory_module}:nope")


def test_load_factory_not_callable_or_not_module(factory_module):
    with pytest.raises(ValueError, match="not callable"):
        load_factory(f"{factory_module}:CONSTANT")
    with pytest.raises(ValueError, match="returned int, not a torch.nn.Module"):
        load_factory(f"{factory_module}:not_a_module")


@pytest.mark.parametrize("spec", ["just_a_module", ":make", "module:", ""])
def test_load_factory_bad_spec(spec):
    with pytest.raises(ValueError, match="package.module:factory"):
        load_factory(spec)


def test_count_params_counts_tied_once():
    model = build_model("gpt2-tiny")
    total_with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert total_with_duplicates - count_params(model) == model.transformer.wte.weight.numel()


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_configs_parameter_count_is_its_models(name):
    # `autoplan models` lists ModelConfig.n_params without building a module; the built model must agree
    config = get_config(name)
    assert config.n_params == count_params(build_model(config))
    flipped = dataclasses.replace(config, tie_embeddings=not config.tie_embeddings, n_layers=3)
    assert flipped.n_params == count_params(build_model(flipped))
