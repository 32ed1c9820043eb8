"""Adding an option is adding one row to `cost_models.options`.

Each test registers one row (for the test only, with `registered`) and follows it through every
stage that names options: the cost table the solver gets, `autoplan.search`, the plan file, the plan
schema, `autoplan.apply` (on one rank of a fake 4-rank world) and, once the row is gone again, an
older autoplan's refusal of the plan that names it. Nothing else is edited for the new option.
"""

import json

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autoplan
import autoplan.run.fsdp as fsdp_module
from autoplan.errors import PlanFileError
from autoplan.plan.schema import plan_json_schema
from autoplan.run.apply import build_optimizer, model_for_plan
from autoplan.solve.cluster import resolve_cluster
from cost_models.choices import options_for
from cost_models.options import (
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    OPTIMIZERS,
    PRECISIONS,
    SHARDING_KINDS,
    MeshShape,
    OptimizerKind,
    ShardGroup,
    ShardingKind,
    register,
    registered,
)

# torch.optim.Adagrad: one state per element (the running sum of squared gradients); a step reads p, g,
# s and writes p, s; its foreach step allocates one state-sized temporary (std = sqrt(s) + eps)
ADAGRAD = OptimizerKind("adagrad", "Adagrad", states=1, touches=5, step_temporaries=1,
                        description="torch.optim.Adagrad: one running sum per element")
# a new combination of existing attributes: HSDP that keeps the gathered parameters to the backward
HYBRID_KEEP = ShardingKind("hybrid_keep", ShardGroup.NODE, reshard_after_forward=False, multi_node_only=True,
                           description="sharded within a node, replicated across nodes, kept gathered")


def _enum(definition: str, field: str) -> list[str]:
    return plan_json_schema()["$defs"][definition]["properties"][field]["enum"]


@pytest.fixture
def fake_world():
    """This process as rank 0 of a 4-rank world whose collectives do nothing (torch's fake backend)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fully_shard_calls(monkeypatch):
    """What apply hands FSDP2's fully_shard per unit (the call itself still runs)."""
    calls = []
    real = fsdp_module.fully_shard

    def spy(module, **kwargs):
        mesh = kwargs["mesh"]
        calls.append({"module": module, "mesh_shape": tuple(mesh.shape),
                      "reshard_after_forward": kwargs["reshard_after_forward"]})
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp_module, "fully_shard", spy)
    return calls


# --------------------------------------------------------------------------- #
# The registry itself
# --------------------------------------------------------------------------- #


def test_registered_adds_a_row_for_the_block_and_refuses_a_taken_name():
    assert list(OPTIMIZERS) == ["adamw", "adam", "sgd"]
    with registered(ADAGRAD) as row:
        assert OPTIMIZERS["adagrad"] is row
        with pytest.raises(ValueError, match="'adagrad' is registered already"):
            register(OptimizerKind("adagrad", "Adagrad", states=1, touches=5))
    assert "adagrad" not in OPTIMIZERS
    with pytest.raises(ValueError, match="'adamw' is registered already"):
        register(OptimizerKind("adamw", "AdamW", states=2, touches=7))
    with pytest.raises(ValueError, match="'adamw' is registered already"), registered(OPTIMIZERS["adamw"]):
        pass
    assert list(OPTIMIZERS) == ["adamw", "adam", "sgd"]  # a refused row removes nothing on the way out
    with pytest.raises(TypeError, match="not an option row"):
        register("adagrad")


def test_defaults_are_registered_and_categories_are_plain_strings():
    assert DEFAULT_PRECISION in PRECISIONS and DEFAULT_OPTIMIZER in OPTIMIZERS
    assert [kind.mesh for kind in SHARDING_KINDS.values()] == [MeshShape.WORLD, MeshShape.WORLD,
                                                               MeshShape.REPLICATE, MeshShape.HYBRID]
    bf16_mixed = PRECISIONS["bf16-mixed"]
    assert (bf16_mixed.master_bytes, bf16_mixed.compute_bytes, bf16_mixed.reduce_bytes, bf16_mixed.state_bytes) == \
        (4, 2, 4, 4)
    # a category is the plain string it names: in f-strings, JSON and as a dict key
    group = SHARDING_KINDS["hybrid"].shard_group
    assert f"{bf16_mixed.compute_dtype}" == "bf16" and json.dumps(group) == '"node"' and {"node": 1}[group] == 1


@pytest.mark.parametrize("row", [*OPTIMIZERS.values(), ADAGRAD], ids=lambda row: row.name)
def test_each_optimizer_row_counts_the_states_torch_keeps(row):
    """The cost model's `states` per element is what the torch class the row names allocates."""
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = build_optimizer(params, row)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    for param in params:
        state = [t for t in optimizer.state[param].values() if isinstance(t, torch.Tensor) and t.shape == param.shape]
        assert len(state) == row.states


# --------------------------------------------------------------------------- #
# (1) A new optimizer
# --------------------------------------------------------------------------- #


def test_a_registered_optimizer_is_planned_written_and_built_and_an_older_reader_refuses_it(tmp_path):
    plans = {}
    with registered(ADAGRAD):
        for name in ("sgd", "adagrad", "adamw"):
            plans[name] = autoplan.search("gpt2-tiny", "40MB", gpus=2, seq_len=64, optimizer=name, fit_to="allocated")
        assert "adagrad" in _enum("TrainingSpec", "optimizer")
        path = tmp_path / "adagrad.json"
        plans["adagrad"].save(path)
        assert json.loads(path.read_text())["training"]["optimizer"] == "adagrad"
        assert autoplan.load_plan(path) == plans["adagrad"]
        optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(3))], autoplan.load_plan(path).training.optimizer)
        assert type(optimizer) is torch.optim.Adagrad

    # optimizer memory per rank, in units of the parameters' (states and master weights both fp32 under
    # bf16-mixed): no state for SGD, one for Adagrad, two for AdamW
    states = {name: plan.predicted.breakdown.optimizer_bytes / plan.predicted.breakdown.params_bytes
              for name, plan in plans.items()}
    assert states == {"sgd": 0, "adagrad": 1, "adamw": 2}

    # the row is gone: this autoplan no longer knows the plan's optimizer
    assert "adagrad" not in _enum("TrainingSpec", "optimizer")
    with pytest.raises(PlanFileError, match=r"unknown optimizer 'adagrad' in the training settings; this autoplan "
                                            r"knows: adamw, adam, sgd; was the plan made by a newer autoplan\?"):
        autoplan.load_plan(path)
    with pytest.raises(PlanFileError, match="unknown optimizer 'adagrad'"):
        build_optimizer([torch.nn.Parameter(torch.zeros(3))], "adagrad")


# --------------------------------------------------------------------------- #
# (2) A new sharding kind
# --------------------------------------------------------------------------- #


def test_a_registered_sharding_kind_is_offered_on_two_nodes_only():
    traced = autoplan.trace("gpt2-tiny", seq_len=64)
    tables = traced.cache(PRECISIONS[DEFAULT_PRECISION].compute_dtype, "block")
    with registered(HYBRID_KEEP):
        assert "hybrid_keep" in _enum("UnitDecision", "sharding")
        two_nodes = tables.table(2, 1, resolve_cluster(None, 2, 2, None), 64, DEFAULT_PRECISION, DEFAULT_OPTIMIZER)
        one_node = tables.table(2, 1, resolve_cluster(2, 1, 2, None), 64, DEFAULT_PRECISION, DEFAULT_OPTIMIZER)
        for unit, options in zip(two_nodes.units, two_nodes.options):
            labels = [option.label for option in options]
            if unit.is_root:  # kinds that keep parameters gathered are not offered for the root
                assert "hybrid_keep" not in labels and "hybrid" in labels
            else:
                assert {"hybrid_keep", "hybrid_keep+ckpt"} <= set(labels)
        assert not any(option.sharding == "hybrid_keep" for options in one_node.options for option in options)
        assert "hybrid_keep" not in {option.sharding for option in options_for(is_leaf=True, is_root=False, nodes=1)}
        # the cost model reads the row: kept gathered (no backward all-gather), sharded over a node's GPUs
        block = next(i for i, unit in enumerate(two_nodes.units) if unit.is_leaf and not unit.is_root)
        costs = {o.label: c for o, c in zip(two_nodes.options[block], two_nodes.costs[block])}
        assert costs["hybrid_keep"].held_bytes == costs["hybrid_keep"].gathered_bytes > 0
        assert costs["hybrid"].held_bytes == 0
        assert costs["hybrid_keep"].param_bytes == costs["hybrid"].param_bytes
        assert costs["hybrid_keep"].comm_bwd_s < costs["hybrid"].comm_bwd_s
    assert "hybrid_keep" not in _enum("UnitDecision", "sharding")


def test_a_registered_sharding_kind_is_planned_written_applied_and_an_older_reader_refuses_it(
        tmp_path, fake_world, fully_shard_calls):
    path = tmp_path / "hybrid_keep.json"
    with registered(HYBRID_KEEP):
        plan = autoplan.search("gpt2-tiny", "1GB", strategy="hybrid_keep", nodes=2, gpus_per_node=2, seq_len=64)
        plan.save(path)
        written = json.loads(path.read_text())["units"]
        # every block kept gathered; the root, not offered that, takes the kind's resharding twin
        assert [(u["sharding"], u["reshard_after_forward"]) for u in written] == \
            [("hybrid", True), ("hybrid_keep", False), ("hybrid_keep", False)]
        loaded = autoplan.load_plan(path)
        assert loaded == plan

        model, _ = autoplan.apply(model_for_plan(loaded), loaded)
        by_module = {call["module"]: call for call in fully_shard_calls}
        for unit in loaded.units:
            call = by_module[model.get_submodule(unit.module)]
            assert call["mesh_shape"] == (2, 2)  # (nodes, gpus_per_node): HYBRID, from the shard group
            assert call["reshard_after_forward"] is (unit.sharding == "hybrid")

    with pytest.raises(PlanFileError, match=r"unknown sharding 'hybrid_keep' in unit transformer\.h\.0; this "
                                            r"autoplan knows: shard, shard_keep, replicate, hybrid; was the plan "
                                            r"made by a newer autoplan\?"):
        autoplan.load_plan(path)
    with pytest.raises(PlanFileError, match="unknown sharding 'hybrid_keep' in unit transformer.h.0"):
        autoplan.apply(model_for_plan(plan), plan)  # a Plan object made while the row was there


def test_a_plan_naming_an_unknown_precision_is_refused_with_the_known_ones(tmp_path):
    from planmaker import make_plan

    path = tmp_path / "plan.json"
    data = make_plan("gpt2-tiny").to_dict()
    data["training"]["dtype"] = "fp8"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"unknown dtype 'fp8' in the training settings; this autoplan knows: "
                                            r"bf16-mixed, bf16-reduce, bf16, fp32; was the plan made by a newer autoplan\?"):
        autoplan.load_plan(path)


def test_an_unsearched_checkpoint_mode_is_left_out_of_the_search_but_taken_by_pins_and_estimates():
    # torchtitan's selective op policy exists to price runs as published: the search keeps its problem
    common = {"gpus": 2, "profile": "a100-sxm4-80gb", "seq_len": 64, "batch_size": 4, "tp": 1, "fit_to": "allocated"}
    free = autoplan.search("llama-tiny", "8MB", **common)
    assert all(unit.checkpoint != "selective_op" for unit in free.units)
    pinned = autoplan.search("llama-tiny", "8MB", pin=["layers.*=checkpoint=selective_op"], **common)
    assert [u.checkpoint for u in pinned.units if u.module.startswith("layers.")] == ["selective_op"] * 2
    estimate = autoplan.estimate("llama-tiny", "shard", checkpoint="selective_op", gpus=2, seq_len=64, batch_size=4)
    assert {u.checkpoint for u in estimate.units if u.module.startswith("layers.")} == {"selective_op"}
