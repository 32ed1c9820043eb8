"""`estimate --torchtitan` and `search --torchtitan`: a team's torchtitan job config costed as it is, and
autoplan's plan beside it. The Llama-3 configs are torchtitan's shipped train_configs/llama3_8b.toml and
llama3_70b.toml (torchtitan 238fa99, the last TOML version; "a preset for 64 A100 GPUs"), their fields as
published."""

import textwrap

import pytest

from autoplan.api.torchtitan import read_torchtitan
from autoplan.cli.main import main
from autoplan.errors import UsageError
from cost_models.mesh import Mesh

_SHARED = """
    [job]
    dump_folder = "./outputs"
    [profiling]
    enable_profiling = true
    save_traces_folder = "profile_trace"
    profile_freq = 100
    [metrics]
    log_freq = 10
    enable_tensorboard = true
    save_tb_folder = "tb"
    [checkpoint]
    enable = false
    folder = "checkpoint"
    interval = 500
    last_save_model_only = true
    export_dtype = "float32"
    async_mode = "disabled"
    [compile]
    enable = false
    components = ["model", "loss"]
    [quantize.linear.float8]
    enable_fsdp_float8_all_gather = false
    precompute_float8_dynamic_scale_for_fsdp = false
    filter_fqns = ["output"]
    [validation]
    enable = false
    dataset = "c4_validation"
    freq = 500
    steps = 1200
"""
LLAMA3_8B = textwrap.dedent(_SHARED + """
    [model]
    name = "llama3"
    flavor = "8B"
    hf_assets_path = "./assets/hf/Llama-3.1-8B"
    [optimizer]
    name = "AdamW"
    lr = 3e-4
    eps = 1e-8
    [lr_scheduler]
    warmup_steps = 200
    [training]
    local_batch_size = 1
    seq_len = 8192
    max_norm = 1.0
    steps = 1000
    dataset = "c4"
    [parallelism]
    data_parallel_replicate_degree = 1
    data_parallel_shard_degree = -1
    tensor_parallel_degree = 1
    pipeline_parallel_degree = 1
    context_parallel_degree = 1
    [activation_checkpoint]
    mode = "selective"
    selective_ac_option = "op"
""")
LLAMA3_70B = textwrap.dedent(_SHARED + """
    [model]
    name = "llama3"
    flavor = "70B"
    hf_assets_path = "./assets/hf/Llama-3.1-70B"
    [optimizer]
    name = "AdamW"
    lr = 1.5e-4
    eps = 1e-8
    [lr_scheduler]
    warmup_steps = 200
    [training]
    local_batch_size = 8
    seq_len = 8192
    max_norm = 1.0
    steps = 1000
    dataset = "c4"
    [parallelism]
    data_parallel_replicate_degree = 1
    data_parallel_shard_degree = -1
    tensor_parallel_degree = 8
    pipeline_parallel_degree = 1
    context_parallel_degree = 1
    [activation_checkpoint]
    mode = "full"
""")
CLUSTER = ["--nodes", "8", "--gpus-per-node", "8"]  # the configs' 64 A100s (the default profile)


@pytest.fixture
def configs(tmp_path):
    paths = {}
    for name, text in (("llama3_8b.toml", LLAMA3_8B), ("llama3_70b.toml", LLAMA3_70B)):
        paths[name] = tmp_path / name
        paths[name].write_text(text)
    return paths


def _run(capsys, *argv):
    try:
        code = main([*map(str, argv)])
    except SystemExit as exc:
        code = exc.code
    return code, *capsys.readouterr()


def test_the_shipped_configs_read_as_torchtitan_lays_them_out(configs):
    mesh = Mesh(nodes=8, gpus_per_node=8)
    small = read_torchtitan(configs["llama3_8b.toml"], mesh)
    assert (small.model, small.seq_len, small.local_batch_size, small.global_batch) == ("llama3-8b", 8192, 1, 64)
    assert (small.dtype, small.optimizer, small.tp, small.dp, small.strategy) == ("bf16-mixed", "adamw", 1, 64, "shard")
    assert small.checkpoint == "selective" and small.pin == ["tok_embeddings=shard", "lm_head=shard_keep"]
    large = read_torchtitan(configs["llama3_70b.toml"], mesh)
    assert (large.model, large.tp, large.dp, large.global_batch, large.checkpoint) == ("llama3-70b", 8, 8, 64, "full")
    assert large.estimate_fields()["sequence_parallel"] == "on"
    assert not large.notes  # every key of the shipped file is torchtitan's, and costed or of no bearing on cost


def test_estimate_of_the_8b_config(configs, capsys):
    code, out, err = _run(capsys, "estimate", "--torchtitan", configs["llama3_8b.toml"], *CLUSTER)
    assert code == 0, err
    assert "torchtitan config llama3_8b.toml: llama3 8B (autoplan's llama3-8b), FSDP over 64 ranks" in out
    assert "micro-batch 1 x 1 accumulation x 64 GPUs = 64 samples per step; sequence length 8192" in out
    assert "torchtitan's op policy recomputes every second matmul" in out  # the approximation, said
    assert "pinned: tok_embeddings: shard, lm_head: shard_keep" in out and "step time" in out and "fits" in out


def test_estimate_of_the_70b_config(configs, capsys):
    code, out, err = _run(capsys, "estimate", "--torchtitan", configs["llama3_70b.toml"], *CLUSTER)
    assert code == 0, err
    assert "llama3 70B (autoplan's llama3-70b), FSDP over 8 ranks x tensor parallel 8" in out
    assert "8 data-parallel ranks (tensor-parallel degree 8, sequence parallel) = 64 samples per step" in out
    assert "full activation checkpointing" in out and "step time" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_8b.toml", "llama3_70b.toml"])
def test_search_prints_the_plan_beside_the_config(configs, capsys, tmp_path, name):
    code, out, err = _run(capsys, "search", "--torchtitan", configs[name], *CLUSTER, "-o", tmp_path / "plan.json")
    assert code == 0, err
    beside = out[out.index(f"beside the torchtitan config {name} (64 samples per step both)"):]
    rows = {line.split("  ")[1].strip(): line for line in beside.splitlines()[2:] if line.startswith("  ")}
    assert set(rows) >= {"layout", "units", "micro-batch", "step time", "throughput", "peak memory per GPU"}
    assert "x)" in rows["throughput"] and "tokens/s" in rows["throughput"]
    assert (tmp_path / "plan.json").exists()


def test_search_beside_a_small_config(tmp_path, capsys):
    config = tmp_path / "debug.toml"
    config.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\nlocal_batch_size = 2\n'
                      'seq_len = 128\n[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "2"\n')
    code, out, err = _run(capsys, "search", "--torchtitan", config, "--gpus", "4", "--tp", "1", "-o",
                          tmp_path / "plan.json")
    assert code == 0, err
    assert "checkpointing every few blocks: layers.1-5/2" in out and "(8 samples per step both)" in out
    assert "speed" not in err


@pytest.mark.parametrize("change, message", [
    ("[parallelism]\npipeline_parallel_degree = 2\n", "parallelism.pipeline_parallel_degree = 2 asks for pipeline"),
    ("[parallelism]\ncontext_parallel_degree = 2\ncontext_parallel_rotate_method = \"alltoall\"\n", "all-to-all"),
    ("[parallelism]\ncontext_parallel_degree = 3\n", "do not divide the 8 GPUs"),
    ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["float8"]\n', "float8 / MX converters"),
    ('[model]\nname = "deepseek_v3"\n', "model.name = 'deepseek_v3'"),
    ('[model]\nname = "llama3"\nflavor = "8B_flex"\n', "FlexAttention"),
    ('[activation_checkpoint]\nmode = "memory_budget"\n', "lets torch.compile choose"),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "some"\n', "selective_ac_option 'some'"),
    ('[optimizer]\nname = "Lion"\n', "optimizer.name = 'Lion'"),
    ("[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4\n", "HSDP with shard degree 4"),
    ("[parallelism]\ndata_parallel_shard_degree = 3\n", "is not the 8 GPUs"),
    ("[training]\nlocal_batch_size = 2\nglobal_batch_size = 12\n", "not a multiple of local_batch_size 2"),
    ("[training\n", "is not TOML"),
])
def test_what_changes_the_meaning_is_refused_by_name(tmp_path, change, message):
    config = tmp_path / "job.toml"
    config.write_text(change)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_torchtitan(config, Mesh(nodes=1, gpus_per_node=8))


def test_layouts_unknown_keys_and_approximations(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[training]\nbatch_size = 4\nenable_cpu_offload = true\ndtype = "bfloat16"\n[compile]\n'
                      'enable = true\n[parallelism]\ndata_parallel_replicate_degree = 2\n'
                      'data_parallel_shard_degree = 8\nfsdp_reshard_after_forward = "always"\n[mystery]\nx = 1\n')
    job = read_torchtitan(config, Mesh(nodes=2, gpus_per_node=8))
    assert (job.strategy, job.dp, job.offload, job.dtype) == ("hybrid", 16, True, "bf16")
    # torchtitan's default checkpointing: selective, option "2": every second block of debugmodel's 6 fully
    assert job.pin == ["tok_embeddings=hybrid+offload", "lm_head=hybrid+offload", "layers.1-5/2=hybrid+ckpt+offload",
                       "layers.0-4/2=hybrid+offload"]
    unknown = next(note for note in job.notes if note.startswith("not keys"))
    assert "training.batch_size (now training.local_batch_size)" in unknown and "[mystery]" in unknown
    assert any("torch.compile is on" in note for note in job.notes)
    config.write_text("[parallelism]\ndata_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1\n")
    ddp = read_torchtitan(config, Mesh(nodes=1, gpus_per_node=4))
    assert ddp.strategy == "replicate" and ddp.layout == "DDP over 4 ranks"


def test_flags_the_config_decides_are_refused_with_it(configs, capsys):
    code, _, err = _run(capsys, "estimate", "--torchtitan", configs["llama3_8b.toml"], "--seq-len", "4096")
    assert code == 2 and "decides --seq-len" in err
    code, _, err = _run(capsys, "search", "--torchtitan", configs["llama3_8b.toml"], "--model", "gpt2")
    assert code == 2 and "decides --model" in err
