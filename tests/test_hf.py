"""Hugging Face models from tiny local config.json files (written here; nothing is downloaded)."""

import json
import os
import re

import pytest

import autoplan
import autoplan.models.hf
from autoplan.cli.main import main
from autoplan.errors import UsageError

pytest.importorskip("transformers")

CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                 bos_token_id=0, eos_token_id=0),
    "bert": dict(model_type="bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=128),
}
BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h", "bert": "bert.encoder.layer"}


def write_config(directory, name, **changes):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**CONFIGS[name], **changes}))
    return directory


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: write_config(root / name, name) for name in CONFIGS}


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_search_plans_a_local_hf_config_with_the_fallback_tracer(configs, name):
    plan = autoplan.search(f"hf:{configs[name]}", "40MB", gpus=2, seq_len=32, fit_to="allocated")
    assert plan.model.tracer == "dispatch"  # torch.fx cannot trace current transformers models
    paths = [unit.module for unit in plan.units]
    assert f"{BLOCKS[name]}.0" in paths and f"{BLOCKS[name]}.1" in paths
    assert plan.predicted.peak_mem_bytes <= 40e6
    assert "traced by dispatch" in str(plan)


def test_the_context_length_is_the_default_sequence_length(configs):
    traced = autoplan.trace(f"hf:{configs['llama'] / 'config.json'}")  # the file itself works too
    assert traced.seq_len == 128


def test_attention_runs_as_a_fused_kernel_so_activations_grow_linearly_with_sequence(configs):
    saved = []
    for seq_len in (32, 64):
        traced = autoplan.trace(f"hf:{configs['llama']}", seq_len=seq_len)
        trace = traced.traces("bf16").at_1
        saved.append(sum(op.saved_bytes for op in trace.ops if op.module.startswith("model.layers.0")))
    # the S x S score matrix would make this ratio well above 2
    assert saved[1] / saved[0] == pytest.approx(2.0, rel=0.02)


def test_estimate_on_an_hf_config(configs):
    sharded = autoplan.estimate(f"hf:{configs['llama']}", "shard", gpus=2, batch_size=4, seq_len=32)
    replicated = autoplan.estimate(f"hf:{configs['llama']}", "replicate", gpus=2, batch_size=4, seq_len=32)
    assert sharded.model.tracer == "dispatch"
    assert replicated.model_state_bytes == pytest.approx(2 * sharded.model_state_bytes, rel=0.01)


def test_cli_estimate_takes_a_plan_for_an_hf_config(run_cli, configs, tmp_path, monkeypatch):
    """`search -o` writes the config's path relative to the plan's folder, where `estimate --plan` reads it."""
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "plans" / "llama", "llama")
    assert main(["search", "--model", "hf:plans/llama", "--mem", "40MB", "--gpus", "2", "--seq-len", "32",
                 "-o", "plans/hf-plan.json", "--fit-to", "allocated"]) == 0
    name = json.loads((tmp_path / "plans" / "hf-plan.json").read_text())["model"]["name"]
    assert name == "hf:llama"
    result = run_cli("estimate", "--plan", "plans/hf-plan.json", "--timeline")  # the plan names its hf: model
    assert result.returncode == 0, result.stderr
    assert name in result.stdout and "traced by dispatch" in result.stdout
    assert "strategy plan" in result.stdout and "bwd model.layers.1" in result.stdout


def test_a_config_outside_the_plans_folder_is_named_again(configs, tmp_path, capsys):
    """A plan's config is read only inside the plan's folder: search says so when it writes one outside."""
    assert main(["search", "--model", f"hf:{configs['llama']}", "--mem", "40MB", "--gpus", "2", "--seq-len", "32",
                 "-o", str(tmp_path / "plans" / "hf-plan.json"), "--fit-to", "allocated"]) == 0
    assert "is outside the plan's folder" in capsys.readouterr().err
    name = json.loads((tmp_path / "plans" / "hf-plan.json").read_text())["model"]["name"]
    assert name == "hf:" + os.path.relpath(configs["llama"], tmp_path / "plans")
    assert main(["estimate", "--plan", str(tmp_path / "plans" / "hf-plan.json")]) == 2
    assert "leads out of the plan's folder" in capsys.readouterr().err
    plan = str(tmp_path / "plans" / "hf-plan.json")
    assert main(["estimate", "--plan", plan, "--model", f"hf:{configs['llama']}"]) == 0


def test_a_plans_hf_path_is_read_from_its_folder_and_never_absolute(configs, tmp_path, monkeypatch):
    plan = autoplan.search(f"hf:{configs['llama']}", "400MB", gpus=2, seq_len=32)
    plan.save(tmp_path / "absolute.json")
    with pytest.raises(UsageError, match="the plan file .*absolute.json names its Hugging Face config by the "
                                         "absolute path .*Give the model: `model` hf:PATH"):
        autoplan.estimate(plan=tmp_path / "absolute.json")
    assert autoplan.estimate(f"hf:{configs['llama']}", plan=tmp_path / "absolute.json").fits  # named again: fine

    write_config(tmp_path / "a" / "configs" / "llama", "llama")
    (tmp_path / "a" / "b").mkdir(parents=True)
    moved = plan.model_copy(update={"model": plan.model.model_copy(update={"name": "hf:configs/llama"})})
    moved.save(tmp_path / "a" / "plan.json")
    monkeypatch.chdir(tmp_path / "a" / "b")  # not the plan's folder: the path is still read from there
    assert autoplan.estimate(plan=tmp_path / "a" / "plan.json").predicted == plan.predicted
    moved.save(tmp_path / "a" / "b" / "plan.json")  # one folder deeper, the path points nowhere
    with pytest.raises(UsageError, match=r"the Hugging Face config .* came from the plan file .*b/plan.json \(read "
                                         r"relative to its folder, .*\): no Hugging Face config at"):
        autoplan.estimate(plan=tmp_path / "a" / "b" / "plan.json")


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "../configs/llama", "link/config.json"])
def test_a_plans_hf_path_cannot_leave_the_plans_folder(configs, tmp_path, monkeypatch, name):
    """`..` or a symlink out of the plan's folder is refused before anything is opened, whatever it points at."""
    plan = autoplan.search(f"hf:{configs['llama']}", "40MB", gpus=2, seq_len=32, fit_to="allocated")
    write_config(tmp_path / "configs" / "llama", "llama")
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "link").symlink_to(tmp_path / "configs" / "llama")
    escaping = plan.model_copy(update={"model": plan.model.model_copy(update={"name": f"hf:{name}"})})
    escaping.save(tmp_path / "plans" / "plan.json")
    opened = []
    monkeypatch.setattr(autoplan.models.hf, "config_file", lambda path: opened.append(path) or pytest.fail("opened"))
    with pytest.raises(UsageError, match=rf"names its Hugging Face config '{re.escape(name)}', which leads out of the "
                                         r"plan's folder \(.*plans\); .*Keep the config beside the plan, or give "
                                         r"the model: `model` hf:PATH"):
        autoplan.estimate(plan=tmp_path / "plans" / "plan.json")
    assert not opened


@pytest.mark.parametrize("name, missing", [
    ("llama", ["num_hidden_layers", "hidden_size"]),
    ("gpt2", ["n_layer", "n_positions"]),  # as the gpt2 config spells num_hidden_layers, max_position_embeddings
    ("bert", ["intermediate_size", "vocab_size"]),
])
def test_a_config_missing_its_sizes_is_refused_by_name(tmp_path, name, missing):
    data = {k: v for k, v in CONFIGS[name].items() if k not in missing}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(UsageError) as info:
        autoplan.search(f"hf:{tmp_path}", "1GB", seq_len=16)
    message = str(info.value)
    assert all(repr(field) in message for field in missing) and "defaults" in message, message
    assert str(tmp_path / "config.json") in message


def test_learned_positions_bound_the_sequence_and_rope_does_not(configs):
    with pytest.raises(UsageError, match=r"`seq_len` 256 is longer than the 128 positions .*max_position_embeddings"):
        autoplan.search(f"hf:{configs['gpt2']}", "1GB", gpus=2, seq_len=256)
    with pytest.raises(UsageError, match=r"`seq_len` 200 is longer than the 128 positions"):
        autoplan.estimate(f"hf:{configs['bert']}", "shard", gpus=2, seq_len=200)
    # llama's rotary embedding has no table: max_position_embeddings is only the default length
    assert autoplan.estimate(f"hf:{configs['llama']}", "shard", gpus=2, seq_len=256).training.seq_len == 256


@pytest.mark.parametrize("changes, expected", [
    ({"model_type": None}, "field 'model_type' is missing"),
    ({"model_type": "no-such-family"}, "field 'model_type' is 'no-such-family'"),
    ({"architectures": ["NoSuchForCausalLM"]}, "field 'architectures' names 'NoSuchForCausalLM'"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers"),
])
def test_bad_configs_name_the_file_and_the_field(tmp_path, changes, expected):
    directory = write_config(tmp_path / "bad", "llama", **changes)
    with pytest.raises(UsageError) as info:
        autoplan.search(f"hf:{directory}", "1GB", seq_len=16)
    assert str(directory / "config.json") in str(info.value)
    assert expected in str(info.value)


@pytest.mark.parametrize("name, field, value", [
    ("llama", "num_hidden_layers", -3), ("llama", "hidden_size", 0), ("llama", "num_key_value_heads", -1),
    ("llama", "intermediate_size", 2.5), ("llama", "vocab_size", True), ("gpt2", "n_layer", -3),
])
def test_a_size_that_is_not_a_positive_whole_number_is_blamed_on_its_field(tmp_path, capsys, monkeypatch, name,
                                                                          field, value):
    """Before transformers builds a model that fails somewhere less clear (tracing, for -3 layers)."""
    write_config(tmp_path / "bad", name, **{field: value})
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", "hf:bad", "--mem", "1GB", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    said = f"config.json: field {field!r} is {json.dumps(value)}; a model's sizes are whole numbers of at least 1"
    assert said in err
    assert "trac" not in err and not (tmp_path / "plan.json").exists()


def test_a_config_with_a_key_twice_or_nested_too_deeply_is_refused(tmp_path):
    (tmp_path / "twice").mkdir()
    (tmp_path / "twice" / "config.json").write_text(json.dumps(CONFIGS["llama"])[:-1] + ', "hidden_size": 128}')
    with pytest.raises(UsageError, match="config.json is not a config this reads: the key 'hidden_size' appears twice"):
        autoplan.trace(f"hf:{tmp_path / 'twice'}")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_text('{"model_type": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(UsageError, match="nests arrays or objects too deeply"):
        autoplan.trace(f"hf:{tmp_path / 'deep'}")


def test_unreadable_configs_name_the_file(tmp_path):
    with pytest.raises(UsageError, match="no Hugging Face config at .*missing.*config.json"):
        autoplan.search(f"hf:{tmp_path / 'missing'}", "1GB", seq_len=16)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",,}')
    with pytest.raises(UsageError, match=r"broken.json is not valid JSON: .*line 1 column"):
        autoplan.search(f"hf:{broken}", "1GB", seq_len=16)


def test_a_rope_config_without_positions_needs_only_the_sequence_length(tmp_path):
    """Falcon-7B's config.json has no max_position_embeddings: a RoPE model has no table for it to size."""
    falcon = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, multi_query=True, parallel_attn=True, bias=False, alibi=False, vocab_size=256)
    directory = tmp_path / "falcon"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(falcon))
    with pytest.raises(UsageError, match=r"give `seq_len` .* its config gives no max_position_embeddings \(a falcon "
                                         r"model has no position table to size: it takes any length\)"):
        autoplan.search(f"hf:{directory}", "1GB", gpus=2)
    assert autoplan.search(f"hf:{directory}", "1GB", gpus=2, seq_len=300).training.seq_len == 300
    gpt2 = {k: v for k, v in CONFIGS["gpt2"].items() if k != "n_positions"}  # a learned table needs its size
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    with pytest.raises(UsageError, match=r"does not give 'n_positions'; transformers would take its 'gpt2' defaults "
                                         r"\(n_positions=1024\)"):
        autoplan.search(f"hf:{tmp_path / 'gpt2.json'}", "1GB", gpus=2, seq_len=32)
