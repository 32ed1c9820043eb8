"""Sharded checkpoints: saved under one plan, resumed under another (other sharding, checkpointing, world
size), the loss curve carries on as if the run had not stopped; a checkpoint folder is data."""

import json
import pickle

import pytest
import torch
import torch.distributed as dist
from planmaker import make_plan

from autoplan.cli.main import main
from autoplan.errors import CheckpointError
from autoplan.run.checkpoint import RECORD_FILE, find_checkpoint, load_checkpoint

MODEL = "llama-tiny"
# plan A: 2 ranks, micro-batch 2, blocks sharded with selective checkpointing
PLAN_A = dict(decisions={"layers.0": "shard+sel", "layers.1": "shard"}, world_size=2, micro_batch_size=2)
# plan B: 2 ranks, other units and kinds: the head its own unit, kept gathered, full checkpointing, replication
PLAN_B = dict(decisions={"": "replicate", "layers.0": "shard_keep+ckpt", "layers.1": "replicate", "lm_head": "shard"},
              world_size=2, micro_batch_size=2)
# plan C: 1 rank, the same global batch of 4 as 2 micro-batches of 2
PLAN_C = dict(decisions={"layers.0": "shard", "layers.1": "shard+ckpt"}, world_size=1, micro_batch_size=2,
              grad_accum_steps=2)


def _apply(capfd, plan_path, report, *flags) -> dict:
    data = report.parent / "alpaca.json"  # text, which the model learns from at once (random tokens it cannot)
    if not data.exists():
        records = [{"instruction": f"Say {word} {i} times.", "input": "", "output": " ".join([word] * (i % 7 + 1))}
                   for i, word in enumerate(["sharding", "plan", "memory", "checkpoint"] * 20)]
        data.write_text(json.dumps(records))
    code = main(["apply", str(plan_path), "--warmup", "0", "--lr", "0.01", "--data", str(data), "--report",
                 str(report), *map(str, flags)])
    out, err = capfd.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    return json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_saved_under_one_plan_resumes_under_others_with_the_same_losses(tmp_path, capfd):
    plans = {}
    for name, spec in (("a", PLAN_A), ("b", PLAN_B), ("c", PLAN_C)):
        plans[name] = tmp_path / f"plan_{name}.json"
        make_plan(MODEL, **spec).save(plans[name])
    # One run is both the uninterrupted curve and the saved one: a save that changed the run's state would make
    # the runs resumed from it (below) leave this curve.
    ckpt = tmp_path / "ckpt"
    whole = _apply(capfd, plans["a"], tmp_path / "whole.json", "--steps", 6, "--save", ckpt, "--save-every", 3)
    whole = whole["measured"]["losses"]
    # every 3 steps, through the CPU run's 6 untracked steps after the 6 tracked ones: the last at its end, step 12
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-12", "step-3", "step-6", "step-9"]
    record = json.loads((ckpt / "step-3" / RECORD_FILE).read_text())
    assert record["step"] == 3 and record["data"]["samples"] == 12 and record["world_size"] == 2
    assert find_checkpoint(ckpt) == ckpt / "step-12"

    for name in ("b", "c"):
        resumed = _apply(capfd, plans[name], tmp_path / f"resumed_{name}.json", "--steps", 3,
                         "--resume", ckpt / "step-3")
        # the same global batches from step 4 on, the weights and AdamW's moments resharded by DCP: the losses
        # are the uninterrupted run's, up to the order of floating-point sums (other reductions, other ranks)
        assert resumed["measured"]["losses"] == pytest.approx(whole[3:], rel=1e-4), name
    assert whole[3] < whole[0] - 0.1  # the curve falls: a resumed run that started afresh would be seen


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_refuses_a_checkpoint_of_another_model_before_launching(tmp_path, capfd):
    plan_path = tmp_path / "plan.json"
    make_plan(MODEL, **PLAN_C).save(plan_path)
    ckpt = tmp_path / "ckpt"
    _apply(capfd, plan_path, tmp_path / "r.json", "--steps", 1, "--save", ckpt)
    other = tmp_path / "gpt2.json"
    make_plan("gpt2-tiny", world_size=1).save(other)
    code = main(["apply", str(other), "--resume", str(ckpt)])
    out, err = capfd.readouterr()
    assert code == 2 and "is of another model" in err and "launching torchrun" not in out


def test_resume_and_save_flags_are_checked_before_anything_runs(tmp_path, capfd):
    plan_path = tmp_path / "plan.json"
    make_plan(MODEL, **PLAN_C).save(plan_path)
    code = main(["apply", str(plan_path), "--resume", str(tmp_path / "nothing")])
    _, err = capfd.readouterr()
    assert code == 2 and "no checkpoint at" in err
    (tmp_path / "empty" / "step-4").mkdir(parents=True)  # a save that did not finish
    code = main(["apply", str(plan_path), "--resume", str(tmp_path / "empty")])
    _, err = capfd.readouterr()
    assert code == 2 and "step-4 did not finish saving" in err
    with pytest.raises(SystemExit) as exc:
        main(["apply", str(plan_path), "--save-every", "2"])
    assert exc.value.code == 2 and "--save DIR" in capfd.readouterr().err
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit):
        main(["apply", str(plan_path), "--save", str(tmp_path / "a-file")])
    assert "--save" in capfd.readouterr().err


class _Payload:
    def __reduce__(self):
        return (print, ("this ran",))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_crafted_index_is_refused_not_run(tmp_path, capfd, one_rank):
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / RECORD_FILE).write_text(json.dumps({"schema_version": 1, "step": 1,
                                                          "params": {"weight": [2, 2], "bias": [2]}}))
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match=r"names builtins\.print"):
        load_checkpoint(tmp_path, torch.nn.Linear(2, 2))
    assert "this ran" not in capfd.readouterr().out
