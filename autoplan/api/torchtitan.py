"""A team's torchtitan job config as autoplan settings: what `estimate --torchtitan` costs and `search
--torchtitan` starts from.

torchtitan's TOML job config (torchtitan/config/job_config.py, the TOML form its llama3 train_configs
shipped until torchtitan moved to Python configs in 2026) says what to train and how to lay it out; the
cluster (how many GPUs, which) is torchrun's, so it comes from autoplan's own flags. The translation:

- [model] name "llama3" and its flavor (debugmodel, 8B, 70B, 405B) -> the zoo's llama with the flavor's
  shapes (torchtitan's TransformerModelArgs: dim, layers, heads, KV heads, the FFN's multiplier and
  rounding, RoPE theta, vocabulary 128256); 8B and 70B are the zoo's llama3-8b and llama3-70b.
- [training] local_batch_size (the micro-batch), global_batch_size (-1: local x data-parallel ranks; more
  is gradient accumulation), seq_len, dtype / mixed_precision_param / mixed_precision_reduce (bf16-mixed,
  fp32, or pure bf16), enable_cpu_offload (offload).
- [optimizer] name AdamW or Adam (lr, eps, betas, weight decay change no cost).
- [parallelism] data_parallel_shard_degree (-1: the ranks left), data_parallel_replicate_degree (DDP:
  replicate; with sharding HSDP: hybrid, whose shard groups must be a node's data-parallel ranks),
  tensor_parallel_degree (with torchtitan's sequence-parallel norms), context_parallel_degree (ring attention
  rotating by all-gather, FSDP over dp_shard x cp), fsdp_reshard_after_forward.
- [activation_checkpoint] mode none, full, or selective with selective_ac_option "op" (autoplan's
  selective) or an integer N (every N-th block fully checkpointed).

The units are torchtitan's: the embedding, each block, the head (torchtitan wraps the final norm with
the output projection; autoplan's root keeps the norm, a few kilobytes) and the root, with checkpointing on
the blocks only and, by default, the head kept gathered after its forward (torchtitan's "default" policy):
pins on top of a uniform strategy. Keys that change what would be costed (pipeline or expert parallelism,
an all-to-all ring rotation, float8 or MX converters, a compiler-chosen memory budget, custom code) are refused by name;
keys with no bearing on the cost (logging, checkpoints, data, schedules) are read and left; keys torchtitan
does not have are named in a warning.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplan.errors import UsageError
from autoplan.models.config import ModelConfig
from autoplan.models.resolve import zoo_spec
from autoplan.pins import range_text
from cost_models.mesh import Mesh

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["FLAVORS", "TorchtitanJob", "read_torchtitan"]

# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py): dim, n_layers, n_heads, n_kv_heads,
# ffn_dim_multiplier, multiple_of, rope_theta, vocab_size
FLAVORS: dict[str, tuple] = {
    "debugmodel": (256, 6, 16, None, None, 256, 500000.0, 2048),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 500000.0, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 500000.0, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 500000.0, 128256),
}
# the keys of torchtitan's JobConfig, by section (what is not here is named as unknown)
_KEYS = {
    "job": "config_file dump_folder description print_config save_config_file custom_config_module",
    "profiling": "enable_profiling save_traces_folder profile_freq profiler_active profiler_warmup "
                 "enable_memory_snapshot save_memory_snapshot_folder",
    "metrics": "log_freq enable_tensorboard disable_color_printing save_tb_folder save_for_all_ranks enable_wandb",
    "model": "name flavor hf_assets_path tokenizer_path converters print_after_conversion",
    "optimizer": "name lr beta1 beta2 eps weight_decay implementation early_step_in_backward",
    "lr_scheduler": "warmup_steps total_steps decay_ratio decay_type min_lr_factor",
    "training": "dataset dataset_path local_batch_size global_batch_size seq_len max_norm steps enable_cpu_offload "
                "dtype mixed_precision_param mixed_precision_reduce gc_freq gc_debug dataloader",
    "parallelism": "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
                   "tensor_parallel_degree disable_loss_parallel enable_async_tensor_parallel pipeline_parallel_degree "
                   "module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
                   "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
                   "pipeline_parallel_schedule pipeline_parallel_schedule_csv pipeline_parallel_microbatch_size "
                   "pipeline_parallel_expert_parallel_overlap context_parallel_degree context_parallel_load_balancer "
                   "context_parallel_rotate_method expert_parallel_degree expert_tensor_parallel_degree "
                   "expert_parallel_comm_backend",
    "checkpoint": "enable enable_ft_dataloader_checkpoints folder interval initial_load_path initial_load_model_only "
                  "initial_load_in_hf initial_load_in_hf_quantized last_save_model_only last_save_in_hf export_dtype "
                  "async_mode keep_latest_k load_step exclude_from_loading enable_first_step_checkpoint "
                  "create_seed_checkpoint load_only",
    "activation_checkpoint": "mode selective_ac_option per_op_sac_force_recompute_mm_shapes_by_fqns early_stop "
                             "memory_budget visualize_memory_budget_pareto preserve_rng_state determinism_check debug",
    "compile": "enable components backend",
    "quantize": "linear grouped_mm",
    "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder save_traces_file_prefix mode",
    "memory_estimation": "enable disable_fake_mode",
    "fault_tolerance": "enable process_group process_group_timeout_ms replica_id group_size min_replica_size "
                       "semi_sync_method",
    "experimental": "custom_import custom_args_module",
    "validation": "enable dataset dataset_path local_batch_size seq_len freq steps dataloader",
    "debug": "seed deterministic deterministic_warn_only moe_force_load_balance",
}
_OPEN = {"training.dataloader", "validation.dataloader", "quantize.linear", "quantize.grouped_mm"}  # sub-tables
# keys that change what would run, refused unless at their default
_REFUSED = {
    "parallelism.pipeline_parallel_degree": (1, "pipeline parallelism"),
    "parallelism.context_parallel_rotate_method": ("allgather", "ring attention rotating by all-to-all (autoplan "
                                                   "prices torchtitan's default, allgather)"),
    "parallelism.expert_parallel_degree": (1, "expert parallelism"),
    "parallelism.expert_tensor_parallel_degree": (1, "expert tensor parallelism"),
    "model.converters": ([], "float8 / MX converters (low-precision matmuls and all-gathers)"),
    "experimental.custom_import": ("", "custom code imported into the job"),
    "experimental.custom_args_module": ("", "custom code imported into the job"),
    "job.custom_config_module": ("", "custom code imported into the job"),
    "fault_tolerance.enable": (False, "fault-tolerant replica groups (torchft)"),
}


@dataclass
class TorchtitanJob:
    """A torchtitan job config read as autoplan settings for a given cluster."""

    path: Path
    flavor: str
    model: str  # the zoo spec
    seq_len: int
    local_batch_size: int
    global_batch: int
    dtype: str
    optimizer: str
    tp: int
    dp: int  # data-parallel ranks (replicate x shard)
    strategy: str
    checkpoint: str  # the blocks' mode (none where every N-th block is checkpointed: see `pin`)
    offload: bool
    pin: list[str] = field(default_factory=list)  # the units as torchtitan wraps them
    cp: int = 1  # context-parallel degree (FSDP over dp_shard x cp, as torchtitan's "dp_shard_cp")
    layout: str = ""  # torchtitan's parallelism in words
    notes: list[str] = field(default_factory=list)  # approximations and unknown keys, said before the costs

    def estimate_fields(self) -> dict[str, Any]:
        """The job as `autoplan.estimate` fields (the cluster's are the caller's)."""
        return dict(model=self.model, seq_len=self.seq_len, batch_size=self.local_batch_size,
                    global_batch=self.global_batch, dtype=self.dtype, optimizer=self.optimizer, strategy=self.strategy,
                    checkpoint=self.checkpoint, offload=self.offload, tp=self.tp if self.tp > 1 else None,
                    sequence_parallel="on" if self.tp > 1 else None, pin=tuple(self.pin),
                    cp=self.cp if self.cp > 1 else None)

    def search_fields(self) -> dict[str, Any]:
        """What a search keeps of the job: the model, sequence, samples per step, precision and optimizer."""
        return dict(model=self.model, seq_len=self.seq_len, global_batch=self.global_batch, dtype=self.dtype,
                    optimizer=self.optimizer)


def read_torchtitan(path: str | Path, mesh: Mesh) -> TorchtitanJob:
    """The torchtitan job config at `path` on the cluster `mesh` (its world size fills the -1 degrees).
    UsageError naming the key for what cannot be costed, or a file that is not one."""
    path = Path(path).expanduser()
    try:
        config = tomllib.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read the torchtitan config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"the torchtitan config {path} is not TOML: {exc}") from None
    notes = _unknown_keys(config, path)
    for dotted, (default, what) in _REFUSED.items():
        value = _get(config, dotted, default)
        if value != default:
            raise UsageError(f"{path}: {dotted} = {value!r} asks for {what}, which autoplan does not cost; "
                             f"remove it (or set {_toml(default)}) to cost the rest")
    model, flavor = _model(config, path)
    seq_len = _positive(config, "training.seq_len", 2048, path)
    job = TorchtitanJob(path=path, flavor=flavor, model="", seq_len=seq_len, notes=notes,
                        local_batch_size=_positive(config, "training.local_batch_size", 8, path), global_batch=0,
                        dtype=_dtype(config, path), optimizer=_optimizer(config, path), tp=1, dp=1, strategy="shard",
                        checkpoint="none", offload=bool(_get(config, "training.enable_cpu_offload", False)))
    job.model = zoo_spec(model if seq_len <= model.max_seq_len else _longer(model, seq_len))
    _parallelism(config, job, mesh)
    _checkpointing(config, job, model.n_layers)
    _approximations(config, job)
    return job


def _unknown_keys(config: dict, path: Path) -> list[str]:
    unknown = []
    for section, table in config.items():
        if section not in _KEYS:
            unknown.append(f"[{section}]")
            continue
        if not isinstance(table, dict):
            raise UsageError(f"{path}: {section} is a value, not a [{section}] table")
        known = set(_KEYS[section].split())
        unknown += [f"{section}.{key}" for key in table if key not in known]
    if not unknown:
        return []
    renamed = {"training.batch_size": "training.local_batch_size"}  # torchtitan's older names
    hints = [f"{key} (now {renamed[key]})" if key in renamed else key for key in unknown]
    return [f"not keys of torchtitan's job config, ignored: {', '.join(hints)}"]


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    section, _, key = dotted.partition(".")
    return config.get(section, {}).get(key, default)


def _toml(value: Any) -> str:
    return {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)


def _positive(config: dict, dotted: str, default: int, path: Path) -> int:
    value = _get(config, dotted, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{path}: {dotted} = {value!r}: give a whole number of at least 1")
    return value


def _model(config: dict, path: Path) -> tuple[ModelConfig, str]:
    name, flavor = _get(config, "model.name", "llama3"), str(_get(config, "model.flavor", "debugmodel"))
    if name != "llama3":
        raise UsageError(f"{path}: model.name = {name!r}: autoplan reads torchtitan's llama3 (its zoo's llama); "
                         "for another model give autoplan the model itself (`model`)")
    if flavor not in FLAVORS:
        other = (" (another attention: FlexAttention or varlen with a block-causal mask, where autoplan costs "
                 "causal SDPA)" if flavor.split("_")[0] in FLAVORS else "")
        raise UsageError(f"{path}: model.flavor = {flavor!r}{other}; the llama3 flavors autoplan reads: "
                         f"{', '.join(FLAVORS)}")
    dim, layers, heads, kv, multiplier, multiple_of, theta, vocab = FLAVORS[flavor]
    # the FFN's size by Meta's rule (the zoo's ffn_dim), then fixed: the zoo's presets give it so
    ffn = ModelConfig("llama", layers, heads, dim, vocab_size=vocab, max_seq_len=8192, ffn_dim_multiplier=multiplier,
                      multiple_of=multiple_of).ffn_dim
    return ModelConfig("llama", layers, heads, dim, vocab_size=vocab, max_seq_len=8192, n_kv_heads=kv, ffn_hidden=ffn,
                       rope_theta=theta), f"llama3 {flavor}"


def _longer(model: ModelConfig, seq_len: int) -> ModelConfig:
    return ModelConfig(**{**model.to_dict(), "max_seq_len": seq_len})  # torchtitan sizes RoPE to the sequence


def _dtype(config: dict, path: Path) -> str:
    if _get(config, "training.mixed_precision_reduce", "float32") != "float32":
        raise UsageError(f"{path}: training.mixed_precision_reduce must be \"float32\" (torchtitan's only choice)")
    if _get(config, "training.dtype", "float32") == "bfloat16":
        return "bf16"  # parameters, gradients and optimizer states in bf16, no fp32 master copy
    param = _get(config, "training.mixed_precision_param", "bfloat16")
    if param not in ("bfloat16", "float32"):
        raise UsageError(f"{path}: training.mixed_precision_param = {param!r}: \"bfloat16\" or \"float32\"")
    return "bf16-mixed" if param == "bfloat16" else "fp32"


def _optimizer(config: dict, path: Path) -> str:
    name = _get(config, "optimizer.name", "AdamW")
    known = {"AdamW": "adamw", "Adam": "adam"}
    if name not in known:
        raise UsageError(f"{path}: optimizer.name = {name!r}: autoplan costs {', '.join(known)}")
    return known[name]


def _parallelism(config: dict, job: TorchtitanJob, mesh: Mesh) -> None:
    """The degrees on this cluster, the sharding kind, the global batch."""
    path, world = job.path, mesh.world_size
    replicate = _positive(config, "parallelism.data_parallel_replicate_degree", 1, job.path)
    job.tp = _positive(config, "parallelism.tensor_parallel_degree", 1, job.path)
    job.cp = _positive(config, "parallelism.context_parallel_degree", 1, job.path)
    inner = job.tp * job.cp
    shard = _get(config, "parallelism.data_parallel_shard_degree", -1)
    if shard == -1:
        if world % (replicate * inner):
            raise UsageError(f"{path}: data_parallel_replicate_degree {replicate} x context x tensor parallel degrees "
                             f"{job.cp} x {job.tp} do not divide the {world} GPUs; give `gpus` (and `nodes`) as the "
                             "job runs")
        shard = world // (replicate * inner)
    if not isinstance(shard, int) or shard < 1 or replicate * shard * inner != world:
        raise UsageError(f"{path}: replicate {replicate} x shard {shard} x context parallel {job.cp} x tensor parallel "
                         f"{job.tp} is not the {world} GPUs of the cluster; give `gpus` (and `nodes`, "
                         "`gpus_per_node`) as the job runs")
    job.dp = replicate * shard
    policy = _get(config, "parallelism.fsdp_reshard_after_forward", "default")
    if policy not in ("default", "always", "never"):
        raise UsageError(f"{path}: parallelism.fsdp_reshard_after_forward = {policy!r}: default, always or never")
    if replicate > 1 and inner > 1:
        raise UsageError(f"{path}: data_parallel_replicate_degree {replicate} beside tensor or context parallelism: "
                         "autoplan's data-parallel dimension under them shards over all its ranks (no replicas)")
    if replicate > 1 and shard > 1 and shard != mesh.gpus_per_node:
        raise UsageError(f"{path}: HSDP with shard degree {shard}: autoplan's hybrid sharding shards within a node "
                         f"(its {mesh.gpus_per_node} GPUs) and replicates across nodes")
    if shard == 1 and replicate > 1:
        job.strategy = head = "replicate"
        job.layout = f"DDP over {replicate} ranks"
    else:
        job.strategy = "hybrid" if replicate > 1 else "shard_keep" if policy == "never" else "shard"
        # torchtitan keeps the head (final norm + output) gathered after its forward unless the policy is "always"
        head = job.strategy if job.strategy == "hybrid" or policy == "always" else "shard_keep"
        job.layout = (f"{'HSDP' if replicate > 1 else 'FSDP'} over {job.dp} ranks"
                      + (f" ({replicate} replicas of {shard})" if replicate > 1 else ""))
    if job.cp > 1:
        job.layout += f" x context parallel {job.cp} (ring attention, FSDP over dp_shard x cp)"
    if job.tp > 1:
        job.layout += f" x tensor parallel {job.tp} (sequence-parallel norms, loss parallel)"
    offload = "+offload" if job.offload else ""
    job.pin = [f"tok_embeddings={job.strategy}{offload}", f"lm_head={head}{offload}"]
    global_batch = _get(config, "training.global_batch_size", -1)
    job.global_batch = job.local_batch_size * job.dp if global_batch in (-1, None) else global_batch
    if not isinstance(job.global_batch, int) or job.global_batch % (job.local_batch_size * job.dp):
        raise UsageError(f"{path}: training.global_batch_size {global_batch} is not a multiple of local_batch_size "
                         f"{job.local_batch_size} x {job.dp} data-parallel ranks")


def _checkpointing(config: dict, job: TorchtitanJob, layers: int) -> None:
    mode = _get(config, "activation_checkpoint.mode", "selective")
    option = str(_get(config, "activation_checkpoint.selective_ac_option", "2"))
    if mode in ("none", "full"):
        job.checkpoint = mode
    elif mode == "selective" and option == "op":
        job.checkpoint = "selective"
        job.notes.append("selective_ac_option \"op\" costed as autoplan's selective mode, which keeps every matmul's "
                         "output; torchtitan's op policy recomputes every second matmul, so its activations lie "
                         "between this estimate and full checkpointing")
    elif mode == "selective" and option.isdigit() and int(option) >= 1:
        every = int(option)  # torchtitan counts blocks from 1 and checkpoints each `every`-th
        checkpointed = [i for i in range(layers) if (i + 1) % every == 0]
        plain = [i for i in range(layers) if (i + 1) % every]
        job.pin += [f"layers.{range_text(checkpointed)}={job.strategy}+ckpt{'+offload' if job.offload else ''}"]
        if plain:
            job.pin += [f"layers.{range_text(plain)}={job.strategy}{'+offload' if job.offload else ''}"]
    elif mode == "memory_budget":
        raise UsageError(f"{job.path}: activation_checkpoint.mode = \"memory_budget\" lets torch.compile choose what "
                         "to recompute, which autoplan cannot cost; use none, selective or full")
    else:
        raise UsageError(f"{job.path}: activation_checkpoint mode {mode!r} with selective_ac_option {option!r}: give "
                         "mode none, full, or selective with \"op\" or a whole number")


def _approximations(config: dict, job: TorchtitanJob) -> None:
    said = {
        "compile.enable": "torch.compile is on: autoplan costs eager kernels, so the compiled step is likely faster",
        "parallelism.enable_async_tensor_parallel": "async tensor parallelism overlaps TP's collectives, which "
                                                    "autoplan costs as torchtitan's plain TP runs them",
        "parallelism.disable_loss_parallel": "loss parallelism is off: the head's logits are gathered whole, where "
                                             "autoplan costs a vocabulary-parallel loss",
    }
    job.notes += [text for key, text in said.items() if _get(config, key, False) is True]
