"""Fixed-strategy estimates through the API and `autoplan estimate`, on the zoo and on a user factory."""

import json
import textwrap

import pytest

import autoplan
from autoplan.cli.main import main
from autoplan.errors import PlanFileError, UsageError
from autoplan.models.zoo import build_model, count_params

TINY = dict(gpus=2, seq_len=64, batch_size=8)
FACTORY_SOURCE = textwrap.dedent('''
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class TinyLM(nn.Module):
        def __init__(self, vocab=256, dim=32, layers=3):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
            self.head = nn.Linear(dim, vocab)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def build():
        return TinyLM()
''')


@pytest.fixture(scope="module")
def traced():
    return autoplan.trace("gpt2-tiny", seq_len=64)


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(FACTORY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_model_states_are_a_world_fraction_sharded_and_whole_replicated(traced):
    n_params = count_params(build_model("gpt2-tiny"))
    sharded = autoplan.estimate(traced, "shard", **{k: v for k, v in TINY.items() if k != "seq_len"})
    replicated = autoplan.estimate(traced, "replicate", gpus=2, batch_size=8)
    # bf16-mixed AdamW: fp32 parameters, gradients and two states, 16 bytes per parameter
    assert sharded.model_state_bytes == n_params * 16 // 2
    assert replicated.model_state_bytes == n_params * 16
    pure_bf16 = autoplan.estimate(traced, "replicate", gpus=2, batch_size=8, dtype="bf16")
    assert pure_bf16.model_state_bytes == n_params * 8
    sgd = autoplan.estimate(traced, "replicate", gpus=2, batch_size=8, optimizer="sgd")
    assert sgd.predicted.timeline[-1].breakdown.optimizer_bytes == 0


def test_checkpointing_trades_activations_for_time(traced):
    plain = autoplan.estimate(traced, "shard", gpus=2, batch_size=16)
    ckpt = autoplan.estimate(traced, "shard", checkpoint=True, gpus=2, batch_size=16)
    act = [max(p.breakdown.activations_bytes for p in e.predicted.timeline) for e in (plain, ckpt)]
    assert act[1] < act[0]
    assert ckpt.predicted.step_time_s > plain.predicted.step_time_s
    assert ckpt.strategy == "shard+ckpt" and "checkpointing" in ckpt.description


def test_estimate_of_a_plan_reproduces_its_prediction(traced, tmp_path):
    plan = autoplan.search(traced, "400MB", gpus=2)  # fitted to what the caching allocator needs, so it fits
    plan.save(tmp_path / "plan.json")
    for source in (plan, tmp_path / "plan.json"):
        result = autoplan.estimate(plan=source)  # model and settings from the plan
        assert result.predicted == plan.predicted
        assert result.cluster.mem_limit_bytes == plan.cluster.mem_limit_bytes and result.fits


def test_estimate_of_a_plan_for_another_model_is_refused(traced):
    plan = autoplan.search(traced, "20MB", gpus=2, fit_to="allocated")
    with pytest.raises(PlanFileError, match="different model"):
        autoplan.estimate("llama-tiny", plan=plan)
    with pytest.raises(UsageError, match="not both"):
        autoplan.estimate(traced, "shard", plan=plan)


def test_bad_strategies_are_usage_errors(traced):
    with pytest.raises(UsageError, match="shard, shard_keep, replicate, hybrid"):
        autoplan.estimate(traced, "zero3", gpus=2)
    with pytest.raises(UsageError, match="more than one node"):
        autoplan.estimate(traced, "hybrid", gpus=2)
    with pytest.raises(UsageError, match="traced at sequence length 64"):
        autoplan.estimate(traced, "shard", seq_len=128)


def test_hybrid_and_keep_gathered_on_two_nodes(traced):
    hybrid = autoplan.estimate(traced, "hybrid", nodes=2, gpus_per_node=2, batch_size=4)
    keep = autoplan.estimate(traced, "shard_keep", nodes=2, gpus_per_node=2, batch_size=4)
    assert {u.sharding for u in hybrid.units} == {"hybrid"}
    assert {u.sharding for u in keep.units} == {"shard", "shard_keep"}  # the root is never kept gathered


def test_search_and_estimate_a_user_factory(factory_dir):
    plan = autoplan.search("user_models:build", "20MB", gpus=2, seq_len=32, fit_to="allocated")
    assert plan.model.name == "user_models:build" and plan.model.tracer == "fx"
    assert [u.module for u in plan.units][:2] == ["", "embed"]
    with pytest.raises(UsageError, match="does not import code named only in a plan file.*`model` user_models:build"):
        autoplan.estimate(plan=plan)  # a plan never makes autoplan import code: the factory is named again
    result = autoplan.estimate("user_models:build", plan=plan)
    assert result.predicted == plan.predicted
    with pytest.raises(UsageError, match="`seq_len`"):
        autoplan.estimate("user_models:build", "shard")  # outside the zoo: no default length


def test_cli_estimate_prints_the_breakdown_for_a_user_factory(run_cli, factory_dir):
    result = run_cli("estimate", "--model", "user_models:build", "--seq-len", "32", "--gpus", "4",
                     "--strategy", "replicate", "--checkpoint", "--batch-size", "2", "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("parameters", "gradients", "optimizer states", "activations", "gathered parameters",
                  "temporaries", "total", "step time", "replicate+ckpt", "fp32", "traced by fx"):
        assert label in out, label
    assert "fits" in out



def test_cli_estimate_json_and_usage_errors(factory_dir, monkeypatch, capsys):
    monkeypatch.chdir(factory_dir)
    assert main(["estimate", "--model", "user_models:build", "--seq-len", "32", "--gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"] == "shard" and data["predicted"]["peak_mem_bytes"] > 0
    assert data["cluster"]["world_size"] == 4

    assert main(["estimate", "--model", "user_models:build", "--seq-len", "32", "--plan", "p.json",
                 "--checkpoint"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["estimate", "--strategy", "shard", "--plan", "p.json"]) == 2
    err = capsys.readouterr().err
    assert "--strategy" in err and "--plan" in err and "not both" in err
