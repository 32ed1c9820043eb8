"""`autoplan.apply` and `autoplan apply` refuse what they cannot run, before anything starts."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from planmaker import make_plan
from torch.distributed.device_mesh import init_device_mesh

from autoplan.cli.main import main
from autoplan.errors import PlanFileError, UsageError
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import apply, materialise, model_for_plan
from autoplan.run.memtrack import MemoryLimitExceeded, allocation_failure
from autoplan.run.prepare import RunOptions, prepare_run, run_outline


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


# --------------------------------------------------------------------------- #
# Checked in the launching process, before any rank starts (issue 16, items 5, 6, 9, 10, 11)
# --------------------------------------------------------------------------- #


def edited_plan(plan_path, change):
    data = json.loads(plan_path.read_text())
    change(data)
    plan_path.write_text(json.dumps(data))
    return plan_path


def test_cli_refuses_report_at_a_directory_before_the_run(plan_path, tmp_path, capsys):
    code, out, err = run_cli(capsys, plan_path, "--report", tmp_path)
    assert code == 2 and f"--report {tmp_path} is a directory" in err and "report.json" in err
    assert "launching torchrun" not in out


def read_only_dir(tmp_path):
    """A directory that takes no new file: chmod 555, or /sys where permission bits do not stop this user (root)."""
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    for candidate in (folder, Path("/sys")):
        try:
            with tempfile.TemporaryFile(dir=candidate):
                pass
        except OSError:
            return candidate
    pytest.skip("no read-only directory here")


def test_cli_refuses_report_into_a_read_only_directory_before_the_run(plan_path, tmp_path, capsys):
    folder = read_only_dir(tmp_path)
    code, out, err = run_cli(capsys, plan_path, "--report", folder / "r.json")
    assert code == 2 and f"cannot write --report {folder / 'r.json'}" in err
    assert "launching torchrun" not in out and not (folder / "r.json").exists()


def test_cli_refuses_a_unit_the_model_lacks_before_launching(plan_path, capsys):
    edited_plan(plan_path, lambda d: d["units"][1].update(module="transformer.h.9"))  # the fingerprint still matches
    code, out, err = run_cli(capsys, plan_path)
    assert code == 2 and "unit module transformer.h.9 is not in the model" in err
    assert "launching torchrun" not in out


def test_cli_refuses_a_sequence_longer_than_the_model_takes(plan_path, capsys):
    edited_plan(plan_path, lambda d: d["training"].update(seq_len=256))  # gpt2-tiny has 128 positions
    code, _, err = run_cli(capsys, plan_path)
    assert code == 2 and "seq_len 256 is longer than the 128 positions" in err


def test_a_renamed_plan_is_labelled_by_the_model_that_runs(plan_path):
    edited_plan(plan_path, lambda d: d["model"].update(name="llama-tiny"))  # the config is still gpt2-tiny's
    prepared = prepare_run(str(plan_path))
    assert prepared.model == "gpt2-tiny"
    assert "names its model 'llama-tiny'" in prepared.model_note and prepared.model_note in prepared.warnings
    assert prepare_run(str(edited_plan(plan_path, lambda d: d["model"].update(name="gpt2-tiny")))).model_note is None


def test_a_plan_costed_for_another_device_is_said_before_the_run(plan_path):
    edited_plan(plan_path, lambda d: d["cluster"].update(profile="a100-sxm4-80gb"))
    prepared = prepare_run(str(plan_path))
    assert any("a100-sxm4-80gb" in w and "step-time comparison will be meaningless" in w for w in prepared.warnings)
    assert "no time estimate" in run_outline(prepared)[-1]
    edited_plan(plan_path, lambda d: d["cluster"].update(profile="cpu-gloo-2"))
    prepared = prepare_run(str(plan_path), RunOptions(steps=4, warmup=1))
    assert not any("meaningless" in w for w in prepared.warnings)
    outline = run_outline(prepared)
    # the CPU: 1 warm-up + 4 steps measured for memory + 4 untracked timed steps; the plan predicts 0.1 s a step
    assert "1 warm-up step(s)" in outline[0] and "4 untracked step(s)" in outline[0] and "9 steps in all" in outline[0]
    assert outline[1].startswith("estimate: about 1 s or less") and "100.0 ms per step" in outline[1]


def test_a_peak_larger_than_the_machine_is_warned_about(plan_path):
    edited_plan(plan_path, lambda d: d["predicted"].update(peak_mem_bytes=10**15))
    prepared = prepare_run(str(plan_path))
    assert any("will likely run out of memory" in w and "1000.00 TB" in w for w in prepared.warnings)


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2"], "needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2 is not a node of 2"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' is not HOST:PORT"),
    (["--node-rank", "1"], "for runs over several nodes: give --nnodes too"),
    (["--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", "h:1"], "--nproc 2 x 2 nodes is 4 ranks, more ranks than"),
])
def test_cli_node_flag_errors(plan_path, capsys, argv, message):
    code, _, err = run_cli(capsys, plan_path, *argv)
    assert code == 2 and message in err, err


def test_cli_help_says_what_runs(capsys):
    _, out, _ = run_cli(capsys, "--help")
    for words in ("untracked", "warm-up", "estimates how long", "--nnodes", "--node-rank", "--rdzv-endpoint",
                  "130, 143", "mean over ranks"):
        assert words in " ".join(out.split()), words


def test_memory_the_allocator_refuses_is_named_with_its_size():
    try:  # a real refusal by the CPU allocator: 4.6 EB
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        refused = exc
    else:
        pytest.skip("this machine's allocator granted 4.6 EB")
    assert allocation_failure(refused) == "could not allocate 4611686.02 TB (the CPU allocator: not enough memory)"
    cuda = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                       "of 79.11 GiB of which 1.50 GiB is free. Including non-PyTorch memory, ...")
    assert allocation_failure(cuda) == ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                        "of 79.11 GiB of which 1.50 GiB is free")
    assert allocation_failure(MemoryLimitExceeded(2_000, 1_000)).endswith("over the limit of 1000 bytes")
    assert allocation_failure(RuntimeError("shapes do not match")) is None
