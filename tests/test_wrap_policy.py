"""An FSDP auto-wrap policy a team already has (size- or class-based) as the units of a plan: the modules it
wraps are those FSDP1 wraps, they and the root are the units, and pins and the solver do the rest."""

import functools

import pytest
import torch.nn as nn
from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

import autoplan
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.models.zoo import build_model, get_config
from autoplan.pins import load_pins
from autoplan.pins.wrap import WrapPolicy
from autoplan.tracing.units import wrap_paths


@pytest.mark.parametrize("text, policy", [
    ("size:100000", WrapPolicy(min_num_params=100_000)), ("min_num_params=1e8", WrapPolicy(min_num_params=10**8)),
    ("class:GPT2Block", WrapPolicy(layer_classes=("GPT2Block",))),
    ("transformer_layer_cls=LlamaBlock,Embedding", WrapPolicy(layer_classes=("LlamaBlock", "Embedding"))),
])
def test_the_policy_forms(text, policy):
    assert WrapPolicy.of(text) == policy and WrapPolicy.of(policy.text()) == policy


@pytest.mark.parametrize("text, message", [
    ("size", "give size:N"), ("size:lots", "is not a number"), ("size:0", "at least 1"), ("auto:x", "'auto'"),
    ("class:Not A Class", "is not a class name"), ("size:1.5", "not a whole number"),
])
def test_bad_policies_are_named(text, message):
    with pytest.raises(UsageError, match=message):
        WrapPolicy.of(text)


def _torch_wraps(model: nn.Module, min_params: int) -> list[str]:
    """The modules FSDP1's own recursion wraps under size_based_auto_wrap_policy (a wrapper that records)."""
    wrapped = []

    def record(module, **_):
        wrapped.append(module)
        return module

    _recursive_wrap(model, functools.partial(size_based_auto_wrap_policy, min_num_params=min_params), record,
                    ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
    paths = {id(module): name for name, module in model.named_modules()}
    return [paths[id(module)] for module in wrapped]


@pytest.mark.parametrize("min_params", [100, 5_000, 20_000, 40_000, 200_000])
def test_a_size_policy_wraps_what_fsdp1_wraps(min_params):
    # untied: FSDP1's recursion run alone (nothing flattened) counts a shared weight twice
    model = build_model(get_config("llama-tiny", n_layers=4))
    paths, refused = wrap_paths(model, WrapPolicy(min_num_params=min_params))
    assert sorted(paths) == sorted(_torch_wraps(model, min_params)) and not refused


def test_a_class_policy_wraps_its_classes_and_leaves_tied_weights_to_the_parent():
    model = build_model("gpt2-tiny")
    paths, refused = wrap_paths(model, WrapPolicy(layer_classes=("GPT2Block", "Embedding")))
    assert paths == ["transformer.wpe", "transformer.h.0", "transformer.h.1"]
    assert len(refused) == 1 and refused[0].startswith("transformer.wte shares a parameter with lm_head")
    with pytest.raises(UsageError, match="match no module of GPT2; its module classes: .*GPT2Block"):
        wrap_paths(model, WrapPolicy(layer_classes=("LlamaDecoderLayer",)))


def test_a_plans_units_are_the_policys_and_pins_fix_among_them(tmp_path):
    common = dict(gpus=2, seq_len=64, profile="cpu-gloo-2")
    plan = autoplan.search("llama-tiny", "40MB", wrap_policy="class:LlamaBlock", pin=["layers.1=shard+ckpt"],
                           tp=1, **common)
    assert [u.module for u in plan.units] == ["", "layers.0", "layers.1"] and plan.training.granularity == "root"
    assert next(u for u in plan.units if u.module == "layers.1").label.replace(" ", "") == "shard+ckpt"
    plan.save(tmp_path / "plan.json")
    again = autoplan.estimate(plan=tmp_path / "plan.json")  # rebuilt from the plan file: the same units
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    pins = tmp_path / "pins.yaml"
    pins.write_text("wrap:\n  transformer_layer_cls: [LlamaBlock]\npins:\n  layers.1: shard+ckpt\n")
    assert load_pins(pins).wrap == WrapPolicy(layer_classes=("LlamaBlock",))
    from_file = autoplan.search("llama-tiny", "40MB", pins=str(pins), tp=1, **common)
    assert [u.label for u in from_file.units] == [u.label for u in plan.units]


def test_estimate_of_a_policy_with_a_strategy(capsys):
    code = main(["estimate", "--model", "gpt2-tiny", "--seq-len", "64", "--gpus", "2", "--wrap-policy", "size:20000",
                 "--strategy", "shard", "--checkpoint"])
    out, err = capsys.readouterr()
    assert code == 0 and "the units those the FSDP wrap policy size:20000 wraps" in out
    assert "transformer.wte shares a parameter with lm_head" in err  # said, and left to the root


@pytest.mark.parametrize("argv, message", [
    (["--wrap-policy", "class:GPT2Block", "--granularity", "fine"], "in place of --granularity fine"),
    (["--wrap-policy", "sizes:3"], "'sizes'"),
])
def test_cli_refusals(argv, message, capsys, tmp_path):
    try:
        code = main(["search", "--model", "gpt2-tiny", "--mem", "40MB", "--seq-len", "64", "-o",
                     str(tmp_path / "p.json"), *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err
