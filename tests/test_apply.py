"""`autoplan.apply` and `autoplan apply` refuse what they cannot run, before anything starts."""

import json

import pytest
import torch
import torch.distributed as dist
from planmaker import make_plan
from torch.distributed.device_mesh import init_device_mesh

from autoplan.cli.main import main
from autoplan.errors import PlanFileError, UsageError
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import apply, materialise, model_for_plan


def test_refuses_a_plan_for_another_model_naming_the_first_difference():
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard"})
    deeper = build_model(get_config("gpt2-tiny", n_layers=3))
    with pytest.raises(PlanFileError, match=r"parameter transformer\.h\.2\.ln_1\.weight \[64\] is not in the plan"):
        apply(deeper, plan)
    wider = build_model(get_config("gpt2-tiny", vocab_size=1000))
    with pytest.raises(PlanFileError, match=r"parameter transformer\.wte\.weight has shape \[1000, 64\], the plan has \[512, 64\]"):
        apply(wider, plan)
    with pytest.raises(PlanFileError, match="tok_embeddings.weight"):
        apply(build_model("llama-tiny"), plan)
    # nothing was touched: still plain meta modules
    assert type(deeper).__name__ == "GPT2" and all(p.is_meta for p in deeper.parameters())


def test_needs_a_process_group_or_a_mesh():
    plan = make_plan("gpt2-tiny")
    with pytest.raises(UsageError, match="init_process_group"):
        apply(build_model("gpt2-tiny"), plan)


def test_factory_plan_needs_the_factory_named_again():
    model = model_for_plan(make_plan("gpt2-tiny"))  # zoo plan: rebuilt from its config
    assert type(model).__name__ == "GPT2" and next(model.parameters()).is_meta
    factory_plan = make_plan(factory_model=build_model("gpt2-tiny"), name="factory_models:tiny_gpt2")
    with pytest.raises(UsageError, match="`model` factory_models:tiny_gpt2"):
        model_for_plan(factory_plan)
    assert next(model_for_plan(factory_plan, "factory_models:tiny_gpt2").parameters()).is_meta


# --------------------------------------------------------------------------- #
# CLI: errors found before any rank is launched (exit 2, a message that says what to do)
# --------------------------------------------------------------------------- #


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard"}).save(path)
    return path


def run_cli(capsys, *argv):
    try:
        code = main(["apply", *map(str, argv)])
    except SystemExit as exc:  # argparse usage errors and --help
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_refuses_corrupt_plan_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text('{"schema_version": 1, "units": [')
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "not valid JSON" in err


def test_cli_refuses_newer_schema(plan_path, capsys):
    data = json.loads(plan_path.read_text())
    data["schema_version"] = 99
    plan_path.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, plan_path)
    assert code == 2 and "schema_version 99, newer than this autoplan reads" in err


def test_cli_refuses_plan_whose_model_differs(plan_path, capsys):
    data = json.loads(plan_path.read_text())
    data["model"]["config"]["n_layers"] = 3  # the config now builds a model the units do not describe
    plan_path.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, plan_path)
    assert code == 2 and "transformer.h.2.ln_1.weight [64] is not in the plan" in err


def test_cli_refuses_factory_plan_without_model(tmp_path, capsys):
    path = tmp_path / "plan.json"
    make_plan(factory_model=build_model("gpt2-tiny"), name="factory_models:tiny_gpt2").save(path)
    code, _, err = run_cli(capsys, path)
    assert code == 2 and "--model factory_models:tiny_gpt2" in err


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--nproc", "3"], "more ranks than the plan's world of 2"),
    (["--mem-limit", "lots"], "is not a size"),
    (["--nproc", "x"], "invalid int value"),
])
def test_cli_usage_errors(plan_path, capsys, argv, message):
    code, _, err = run_cli(capsys, plan_path, *argv)
    assert code == 2 and message in err


def test_cli_refuses_unusable_data_file(plan_path, tmp_path, capsys):
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps({"not": "a list"}))
    code, _, err = run_cli(capsys, plan_path, "--data", data)
    assert code == 2 and "not an Alpaca file" in err
    data.write_text(json.dumps([{"instruction": "hi", "input": "", "output": "yo"}]))
    code, _, err = run_cli(capsys, plan_path, "--data", data)
    assert code == 2 and "fewer than one sequence" in err


def test_cli_help_has_examples(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "autoplan apply plan.json --nproc 1" in out


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A process group of this process alone, and its 1-D mesh."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_refuses_a_unit_that_names_no_module_before_touching_the_model(one_rank_mesh):
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard"})
    plan.units[1].module = "transformer.h.9"  # fingerprint still matches; the unit does not
    model = build_model("gpt2-tiny")
    mesh = one_rank_mesh
    with pytest.raises(PlanFileError, match=r"unit module transformer\.h\.9 is not in the model"):
        apply(model, plan, mesh, dry_run=True)
    assert type(model).__name__ == "GPT2"


def test_optimizer_from_apply_trains_the_materialised_model(one_rank_mesh):
    plan = make_plan("llama-tiny", {"layers.0": "shard", "layers.1": "replicate+ckpt"})
    model, optimizer = apply(build_model("llama-tiny"), plan, one_rank_mesh, dry_run=True)
    materialise(model, "cpu", seed=0)
    params = list(model.parameters())
    assert not any(p.is_meta for p in params)
    assert [id(p) for group in optimizer.param_groups for p in group["params"]] == [id(p) for p in params]
    before = [p.detach().full_tensor().clone() for p in params]
    ids = torch.randint(0, 512, (2, 17))
    torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, params))
