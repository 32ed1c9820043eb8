"""Context parallelism in the mesh, the settings, the search and the pricing (cost_models.context_parallel,
autoplan.solve.context_tables); its execution is tested against one process in test_cp_parity.py."""

import json

import pytest

import autoplan
from autoplan.api.inspect import diff, explain
from autoplan.api.prepare import search_meshes_of
from autoplan.errors import UsageError
from autoplan.plan.schema import Plan
from autoplan.settings import EstimateSettings, SearchSettings
from autoplan.solve.cluster import resolve_cluster
from autoplan.solve.context_tables import ContextParallelTables, source_of
from cost_models.context_parallel import is_ring_attention, kv_shard_bytes, ring_buffers, ring_merge_bytes
from cost_models.mesh import Mesh, MeshError
from cost_models.options import ShardGroup
from cost_models.training import Training

SEQ = 64


@pytest.fixture(scope="module")
def llama():
    return autoplan.trace("llama-tiny", seq_len=SEQ)


def test_the_mesh_puts_context_between_data_and_tensor_parallelism():
    mesh = Mesh(gpus_per_node=8, tp=2, cp=2)
    assert (mesh.dp, mesh.fsdp_ranks, mesh.shard_size(ShardGroup.WORLD)) == (2, 4, 4)
    assert mesh.dims == (("dp", 2), ("cp", 2), ("tp", 2))
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # a cp x tp group shares its rows
    assert Mesh(gpus_per_node=8, cp=8).dims == (("dp", 1), ("cp", 8))
    assert Mesh(gpus_per_node=8).context_degrees() == [1, 2, 4, 8]
    assert Mesh(gpus_per_node=8, tp=2).context_degrees() == [1, 2, 4]
    assert Mesh(nodes=2, gpus_per_node=8, tp=4, cp=2).cp_scope == "intra_node"
    assert Mesh(nodes=2, gpus_per_node=8, tp=4, cp=4).cp_scope == "inter_node"
    with pytest.raises(MeshError, match="`cp` 3 does not divide the 8 ranks"):
        Mesh(gpus_per_node=8, cp=3)
    with pytest.raises(MeshError, match="expert and context parallelism together are not built"):
        Mesh(gpus_per_node=8, cp=2, ep=2)


def test_settings_and_the_meshes_searched():
    mesh = Mesh(gpus_per_node=8)
    short = search_meshes_of(SearchSettings(tp=1), mesh, seq_len=8192)
    long = search_meshes_of(SearchSettings(tp=1), mesh, seq_len=16384)
    assert [m.cp for m in short] == [1] and [m.cp for m in long] == [1, 2, 4, 8]
    fixed = search_meshes_of(SearchSettings(cp=4), mesh, seq_len=1024)  # every tensor degree it fits beside
    assert {(m.tp, m.cp) for m in fixed} == {(1, 4), (2, 4)}
    with pytest.raises(UsageError, match="`cp` 3 does not divide"):
        search_meshes_of(SearchSettings(cp=3), mesh, seq_len=1024)
    with pytest.raises(UsageError, match="`cp` must be at least 1"):
        SearchSettings(cp=0)
    with pytest.raises(UsageError, match="`cp`, `sequence_parallel` go with a `strategy`"):
        EstimateSettings(plan="plan.json", cp=2)


def test_a_rank_runs_and_holds_its_share_of_each_sequence(llama):
    tables = llama.cache("bf16", "block")
    training = Training(SEQ, "bf16-mixed", "adamw")
    base, cp = tables.inputs(2, training), ContextParallelTables(tables, 2).inputs(2, training)
    for whole, half in zip(base.ops, cp.ops):
        assert half.fwd_flops == -(-whole.fwd_flops // 2) and half.saved_bytes == -(-whole.saved_bytes // 2)
        assert half.param_grad_bytes == whole.param_grad_bytes  # parameters are whole on every rank
    attention = next(op for op in base.ops if is_ring_attention(op))
    ring = next(op for op in cp.ops if op.name == attention.name)
    forward, backward = ring_buffers(attention, 2)
    assert ring.fwd_transient_bytes == -(-attention.fwd_transient_bytes // 2) + forward
    assert ring.bwd_live_bytes == -(-attention.bwd_live_bytes // 2) + backward
    # llama-tiny: K and V of 2 heads x 16 wide, micro-batch 2, 64 tokens, bf16; a rank holds half
    assert kv_shard_bytes(attention, 2) == 2 * (2 * 2 * SEQ * 16) * 2 // 2
    # the ring's merges and copies: forward 8 passes over the fp32 output a step, the K/V concatenation, the casts;
    # backward 3.5 passes over fp32 q and 5.5 over fp32 K/V a step, the K/V concatenation
    out32, kv = 2 * 4 * SEQ * 16 * 4 // 2, 2 * (2 * 2 * SEQ * 16) * 2 // 2
    assert ring_merge_bytes(attention, 2) == (8 * out32 + 2 * kv + 3 * out32,
                                              2 * (7 * out32 + 11 * 2 * kv) // 2 + 2 * kv)
    assert base.keep.keys() == cp.keep.keys()
    assert all(h == -(-w // 2) for mode in base.keep for w, h in zip(base.keep[mode], cp.keep[mode]))


def test_the_ring_adds_what_attention_does_not_hide(llama):
    tables = llama.cache("bf16", "block")
    cluster = resolve_cluster(8, None, None, "h100-sxm-80gb")
    plain = source_of(tables, None, 1).table(2, 1, cluster.with_mesh(cluster.mesh.with_context(2)), SEQ, "bf16-mixed",
                                             "adamw")
    source = source_of(tables, None, 2)
    ring = source.table(2, 1, cluster.with_mesh(cluster.mesh.with_context(2)), SEQ, "bf16-mixed", "adamw")
    block = [u.path for u in ring.units].index("layers.0")
    assert all(o.kind.mesh.value == "world" for opts in ring.options for o in opts)  # no replicate, no hybrid
    times = source.ring_times(source.inputs(2, Training(SEQ, "bf16-mixed", "adamw")),
                              cluster.with_mesh(cluster.mesh.with_context(2)), "bf16")
    assert times[block].calls_fwd == 1 and times[block].calls_bwd == 3  # a gather; a gather and 2 permutes
    assert times[block].bwd_s > 0  # the last gradient permute is waited for at once
    shard = next(c for o, c in zip(ring.options[block], ring.costs[block]) if o.label == "shard")
    whole = next(c for o, c in zip(plain.options[block], plain.costs[block]) if o.label == "shard")
    assert shard.activation_bytes == pytest.approx(whole.activation_bytes / 2, rel=0.01)


def test_search_at_a_fixed_degree_records_it_and_reports_what_it_costs(llama, tmp_path):
    plan = autoplan.search(llama, "60MB", gpus=4, profile="cpu-gloo-2", cp=2, tp=1, batch_size=2)
    assert (plan.cluster.cp_degree, plan.cluster.tp_degree) == (2, 1)
    assert plan.training.global_batch_size == 4  # 2 data-parallel ranks x micro-batch 2
    assert plan.cluster.mesh == Mesh(nodes=1, gpus_per_node=4, cp=2)
    assert all(u.sharding in ("shard", "shard_keep") for u in plan.units)
    data = json.loads(plan.to_json())
    assert data["cluster"]["cp_degree"] == 2 and Plan.model_validate(data) == plan
    assert "mesh 2 data-parallel x 2 context-parallel" in plan.table() and "tp 1 cp 2" in plan.table()
    plain = json.loads(autoplan.search(llama, "60MB", gpus=4, profile="cpu-gloo-2", tp=1, batch_size=2).to_json())
    assert "cp_degree" not in plain["cluster"]  # written only above 1: older plans load unchanged


def test_models_whose_positions_apply_cannot_shard_are_refused():
    with pytest.raises(UsageError, match="rotary transformers"):
        autoplan.search("gpt2-tiny", "60MB", gpus=2, seq_len=SEQ, cp=2)
    with pytest.raises(UsageError, match="rotary transformers"):
        autoplan.estimate("gpt2-tiny", "shard", gpus=2, seq_len=SEQ, cp=2)
    with pytest.raises(UsageError, match="does not cut into 8 equal chunks"):
        autoplan.search("llama-tiny", "60MB", gpus=4, seq_len=60, cp=4, tp=1)


def test_explain_and_diff_name_the_degree(llama, tmp_path):
    with_cp = autoplan.search(llama, "60MB", gpus=4, profile="cpu-gloo-2", cp=2, tp=1, batch_size=2)
    without = autoplan.search(llama, "60MB", gpus=4, profile="cpu-gloo-2", cp=1, tp=1, batch_size=2)
    explanation = explain(with_cp, llama)
    assert explanation.step_time_s == pytest.approx(with_cp.predicted.step_time_s)  # the plan's own table
    assert explanation.table().startswith("llama-tiny on 2 data-parallel x 2 context-parallel:")
    assert "context-parallel degree 1 -> 2" in diff(without, with_cp, llama).table()


def test_a_torchtitan_config_with_context_parallelism_is_estimated_on_its_mesh(tmp_path, capsys):
    from autoplan.cli.main import main

    config = tmp_path / "cp.toml"
    config.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nlocal_batch_size = 1\n'
                      'seq_len = 128\n[parallelism]\ncontext_parallel_degree = 2\n'
                      '[activation_checkpoint]\nmode = "full"\n')
    code = main(["estimate", "--torchtitan", str(config), "--gpus", "4", "--profile", "cpu-gloo-2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "FSDP over 2 ranks x context parallel 2" in out  # torchtitan's dp_shard is what cp leaves
    assert "x 2 data-parallel ranks (tensor-parallel degree 1, context-parallel degree 2) = 2 samples" in out


def test_pins_that_do_not_run_beside_context_parallelism_leave_its_meshes_out(llama):
    plan = autoplan.search("llama-tiny[max_seq_len=16384]", "1GB", gpus=4, seq_len=16384, tp=1, profile="cpu-gloo-2",
                           batch_size=1, pin=("layers.0=replicate",))
    entries = {e.cp_degree: e for e in plan.solver.tp_degrees}
    assert plan.cluster.cp_degree == 1 and entries[1].fits
    assert not entries[2].fits and entries[2].note.startswith("not with the pins")
