"""Plans made by hand for tests: any decision for any unit of a zoo model, without the search."""

from __future__ import annotations

from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.zoo import ModelConfig, build_model, count_params, get_config
from autoplan.plan.schema import (
    ClusterSpec,
    MemoryBreakdown,
    ModelRef,
    Plan,
    Prediction,
    SolverInfo,
    TrainingSpec,
    UnitDecision,
    UnitPrediction,
)
from autoplan.plan.pipeline_spec import PipelineSpec, StageSpec
from autoplan.version import __version__
from cost_models.options import CHECKPOINT_MODES, SHARDING_KINDS

_ZERO_UNIT = UnitPrediction(persistent_bytes=0, grad_bytes=0, gathered_bytes=0, activation_bytes=0,
                            fwd_s=0.0, bwd_s=0.0, comm_s=0.0, optimizer_s=0.0)
_ZERO_BREAKDOWN = MemoryBreakdown(params_bytes=0, grads_bytes=0, optimizer_bytes=0, activations_bytes=0,
                                  gathered_bytes=0, temporaries_bytes=0)


def _owner(unit_paths: list[str], module_path: str) -> str:
    """Innermost unit whose module contains `module_path` ("" is the root)."""
    inside = [p for p in unit_paths if p == "" or module_path == p or module_path.startswith(p + ".")]
    return max(inside, key=len)


def make_plan(
    model: str | ModelConfig = "gpt2-tiny",
    decisions: dict[str, str] | None = None,
    *,
    world_size: int = 2,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    micro_batch_size: int = 2,
    grad_accum_steps: int = 1,
    seq_len: int = 16,
    name: str | None = None,
    factory_model=None,
    predicted_peak_mem_bytes: int = 100_000_000,
    predicted_step_time_s: float = 0.1,
) -> Plan:
    """`decisions` maps a unit's module path to "shard", "shard_keep", "replicate" or "hybrid",
    with "+ckpt" (full) or "+sel" (selective checkpointing) and "+offload" appended; the root "" defaults
    to "shard".
    `factory_model` (a model on meta) makes a plan for a user factory named `name`."""
    decisions = {"": "shard", **(decisions or {})}
    if factory_model is not None:
        net, ref = factory_model, ModelRef(name=name, config=None, n_params=count_params(factory_model),
                                           fingerprint=model_fingerprint(factory_model))
    else:
        config = get_config(model) if isinstance(model, str) else model
        net = build_model(config)
        ref = ModelRef(name=name or (model if isinstance(model, str) else config.family), config=config.to_dict(),
                       n_params=count_params(net), fingerprint=model_fingerprint(net))
    paths = list(decisions)
    shapes: dict[str, dict[str, list[int]]] = {p: {} for p in paths}
    for param_name, param in net.named_parameters():
        module_path = param_name.rsplit(".", 1)[0] if "." in param_name else ""
        shapes[_owner(paths, module_path)][param_name] = list(param.shape)
    units = []
    modes_by_label = {mode.label.lstrip("+"): name for name, mode in CHECKPOINT_MODES.items() if mode.label}
    for path, label in decisions.items():
        sharding, *flags = label.split("+")
        checkpoint = next((modes_by_label[f] for f in flags if f in modes_by_label), "none")
        units.append(UnitDecision(
            module=path, sharding=sharding, checkpoint=checkpoint, offload="offload" in flags,
            reshard_after_forward=SHARDING_KINDS[sharding].reshard_after_forward,
            params=sum(_numel(s) for s in shapes[path].values()), param_shapes=shapes[path], predicted=_ZERO_UNIT,
        ))
    global_batch = micro_batch_size * grad_accum_steps * world_size
    return Plan(
        autoplan_version=__version__,
        model=ref,
        cluster=ClusterSpec(world_size=world_size, nodes=nodes, gpus_per_node=gpus_per_node or world_size // nodes,
                            profile="test", device_mem_bytes=10**9, mem_limit_bytes=10**9),
        training=TrainingSpec(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                              global_batch_size=global_batch, seq_len=seq_len, dtype=dtype,
                              optimizer=optimizer, granularity="block"),
        units=units,
        predicted=Prediction(peak_mem_bytes=predicted_peak_mem_bytes, peak_point="bwd test",
                             breakdown=_ZERO_BREAKDOWN, step_time_s=predicted_step_time_s,
                             throughput_samples_s=global_batch / predicted_step_time_s,
                             throughput_tokens_s=global_batch * seq_len / predicted_step_time_s, timeline=[]),
        solver=SolverInfo(status="FIXED", objective_s=0.0, bound_s=0.0,
                          num_variables=0, num_constraints=0, micro_batch_sweep=[]),
        baselines=[],
    )


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def pipelined(plan: Plan, stages: list[list[str]], schedule: str = "1f1b", degree: int = 2,
              microbatches: int | None = None, ranks: list[int] | None = None) -> Plan:
    """`plan` cut into pipeline stages of `degree` ranks (stage i holds the module paths `stages[i]`, on rank
    `ranks[i]`: by default i % degree); the step's micro-batches are the plan's accumulation steps unless
    `microbatches` is given (then both). Stage figures are zeros: a hand-made plan predicts nothing."""
    training = plan.training
    microbatches = microbatches or training.grad_accum_steps
    dp = plan.cluster.world_size // (degree * plan.cluster.tp_degree)
    ranks = ranks or [i % degree for i in range(len(stages))]
    spec = PipelineSpec(degree=degree, schedule=schedule, microbatches=microbatches, stages=[
        StageSpec(rank=rank, modules=modules, units=modules, peak_mem_bytes=0, fwd_s=0.0, bwd_s=0.0)
        for rank, modules in zip(ranks, stages)])
    return plan.model_copy(update={
        "cluster": plan.cluster.model_copy(update={"pp_degree": degree}),
        "training": training.model_copy(update={
            "grad_accum_steps": microbatches,
            "global_batch_size": training.micro_batch_size * microbatches * dp}),
        "pipeline": spec,
    })
