"""Expert parallelism in the mesh, the search, the pricing and the plan (cost_models.mesh.Mesh.ep,
cost_models.expert_parallel, autoplan.solve.expert_tables, autoplan.plan.expert_spec). Runs are in
test_ep_parity.py."""

import json

import pytest

import autoplan
from autoplan.api.prepare import search_meshes_of
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.models.experts import experts_of
from autoplan.models.resolve import resolve_model
from autoplan.plan.schema import Plan
from cost_models.mesh import Mesh, MeshError

MOE = dict(profile="cpu-gloo-2", seq_len=64, batch_size=4)
EXPERTS = "layers.0.mlp.experts"


def test_the_degree_borrows_from_the_data_parallel_ranks():
    mesh = Mesh(2, 8, ep=4)
    assert mesh.dp == 16 and mesh.expert_shard == 4
    assert mesh.expert_dims == (("dp_mod_ep", 4), ("ep", 4))
    assert mesh.dims == (("dp", 16),)  # no dimension of the world: it unflattens dp
    assert mesh.expert_scope == "intra_node" and Mesh(2, 8, ep=16).expert_scope == "inter_node"
    assert mesh.experts_view().dp == 4 and mesh.experts_view().dp_per_node == 2  # the experts' FSDP group
    assert Mesh(2, 8).expert_degrees(8) == [1, 2, 4, 8] and Mesh(1, 4).expert_degrees(0) == [1]
    with pytest.raises(MeshError, match="`ep` 3 does not divide the 8 data-parallel ranks"):
        Mesh(1, 8, ep=3)
    with pytest.raises(MeshError, match="`ep` 4 does not divide the 2 data-parallel ranks"):
        Mesh(1, 8, tp=4, ep=4)


def test_a_search_tries_each_degree_and_records_the_split():
    plan = autoplan.search("moe-tiny", gpus=4, tp=1, **MOE)
    assert [(e.degree, e.ep_degree) for e in plan.solver.tp_degrees] == [(1, 1), (1, 2), (1, 4)]
    fixed = autoplan.search("moe-tiny", gpus=4, ep=2, **MOE)
    assert fixed.cluster.ep_degree == 2 and fixed.cluster.mesh.ep == 2
    e = fixed.experts
    assert (e.degree, e.stacks, e.experts_per_rank, e.expert_shard, e.scope) == (2, 2, 4, 2, "intra_node")
    assert e.all_to_all_bytes == 4 * 64 * 2 * 64 * 2  # micro-batch x seq x top-2 x hidden 64 x bf16
    assert e.all_to_all_s > 0 and e.gathered_stack_bytes * 2 == e.gathered_stack_bytes_fsdp_only
    assert "experts split 2-way" in str(fixed)
    saved = json.loads(fixed.model_dump_json())
    assert saved["cluster"]["ep_degree"] == 2 and Plan.model_validate(saved) == fixed
    assert "ep_degree" not in json.loads(autoplan.search("moe-tiny", gpus=4, ep=1, **MOE).model_dump_json())["cluster"]


def test_the_split_halves_what_the_experts_gather_and_adds_the_all_to_alls():
    one, two = (autoplan.estimate("moe-tiny", "shard", gpus=4, ep=ep, **MOE) for ep in (1, 2))
    unit = {ep: {u.module: u for u in e.units}[EXPERTS].predicted for ep, e in ((1, one), (2, two))}
    assert unit[2].gathered_bytes * 2 == unit[1].gathered_bytes
    assert unit[2].persistent_bytes == unit[1].persistent_bytes  # (E / 2) / (dp / 2): as over all of dp
    assert unit[2].comm_s < unit[1].comm_s  # a gather of half the stack over two ranks, not all of it over four
    assert unit[2].fwd_s > unit[1].fwd_s and unit[2].bwd_s > unit[1].bwd_s  # the dispatch and combine


def test_fewer_experts_than_ranks_are_not_padded_to_whole_experts():
    estimate = autoplan.estimate("moe-tiny", "shard", gpus=16, **MOE)  # 8 experts over 16 ranks
    experts = {u.module: u for u in estimate.units}[EXPERTS]
    assert experts.predicted.persistent_bytes == pytest.approx(experts.params * (4 + 8) / 16, rel=0.01)


def test_expert_parallelism_is_refused_where_it_cannot_split(capsys):
    argv = ["search", "--model", "llama-tiny", "--gpus", "2", "--ep", "2", "--profile", "cpu-gloo-2"]
    assert main(argv) == 2
    assert "llama-tiny has no mixture-of-experts layers" in capsys.readouterr().err
    with pytest.raises(UsageError, match="does not divide moe-tiny's 8 experts; choose one of 1, 2, 4, 8"):
        autoplan.search("moe-tiny", gpus=4, ep=3, **MOE)
    with pytest.raises(UsageError, match="`strategy` replicate does not run beside expert parallelism"):
        autoplan.estimate("moe-tiny", "replicate", gpus=4, ep=2, **MOE)


def test_transformers_experts_are_priced_under_ep_but_not_searched_by_default(tmp_path):
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 256, "num_local_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = experts_of(resolve_model(f"hf:{tmp_path / 'config.json'}").module)
    assert (info.n_experts, info.top_k, info.hidden, len(info.stacks)) == (8, 2, 64, 2)
    assert not info.runs_split  # `apply` splits the zoo's experts only: the search does not offer it
    searched = search_meshes_of(autoplan.SearchSettings.create(gpus=4, tp=1), Mesh.of(4), info)
    assert [m.ep for m in searched] == [1]
    fixed = search_meshes_of(autoplan.SearchSettings.create(gpus=4, tp=1, ep=2), Mesh.of(4), info)
    assert [m.ep for m in fixed] == [2]
