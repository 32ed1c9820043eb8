"""Whole training steps measured against the sum of their parts.

Ops timed one at a time, collectives timed on idle ranks and FSDP2's hooks timed on tiny units do
not add up to a real multi-rank training step. On CPU + gloo, for example, a step of two ranks runs
~30-50% longer than its parts: the units' forward compute runs slower while the ranks' collectives
compete with it for the cores, and every unit pays several milliseconds of waiting at its
collectives' synchronisation points. So `autoplan profile` also trains a calibration model, a small
GPT-2 at two depths and two micro-batch sizes, under three uniform plans (shard, shard_keep,
replicate) exactly as `autoplan apply` runs them, and times forward, backward and optimizer step on
every rank at once; shard and replicate run again with every block checkpointed, and shard with every
block selectively checkpointed. Per phase, a non-negative least-squares fit

    measured - collectives' own time = compute_scale * (sum of the ops' isolated times)
                                       [+ recompute_scale * (checkpointed units' recomputed ops), backward]
                                       + selective_s * (selectively checkpointed units' working ops)
                                       + unit_s * units + collective_s * collective calls

gives how much slower ops run inside the step (compute_scale), how much the forward ops a
checkpointed unit re-runs in its backward cost there (recompute_scale: they are forward ops, but
they run amid the backward's collectives), what each FSDP2 unit costs beyond its ops and collectives
(unit_s), what each collective call costs beyond its time on idle ranks (collective_s), and what
torch's selective checkpoint costs per op of a unit it wraps (selective_s: it runs the unit's forward,
and its recompute, under a Python dispatch mode that decides op by op what to keep; on an H200 a
selectively checkpointed llama block cost 5-7 ms a step more than its kernels, whatever the micro-batch).
Micro-batch sizes separate the compute from the constants; the plans (all-gathers and a
reduce-scatter per unit, the same without the backward all-gather, one all-reduce per unit)
separate the calls from the units, and checkpointing the recompute from the rest; each selective
step against the same plan without checkpointing gives the per-op cost (calibration_fit.py fits it
all). Every case runs in CALIBRATION_ROUNDS rounds, one after the other, and keeps its fastest: a
neighbour's burst of load on a shared host only ever slows a round down (the benchmarks measure the
same way). The
calibration model is not one the fidelity benchmark checks: the fit is tested on other models,
sizes and plans.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from cost_models.evaluate import checkpoint_name
from cost_models.options import DEFAULT_OPTIMIZER, DEFAULT_PRECISION, PRECISIONS

__all__ = [
    "CALIBRATION_DEPTHS", "CALIBRATION_PLANS", "CALIBRATION_MICRO_BATCHES", "CALIBRATION_WIDTH", "CALIBRATION_HEADS",
    "CALIBRATION_SEQ_LEN", "CALIBRATION_ROUNDS", "CALIBRATION_DTYPE", "CALIBRATION_OPTIMIZER", "PLAN_PROFILE",
    "calibration_model", "calibration_workloads", "calibration_cases", "case_key", "step_key", "uniform_plan",
    "measure_training_steps", "fastest_rounds", "WARMUP_STEPS", "TIMED_STEPS",
]

CALIBRATION_DEPTHS = (2, 4)
# (sharding, every block's checkpoint mode): the experiment's design (its plans separate per-call from per-unit
# costs), named rather than read from the registry so that registering a sharding kind does not change
# what a profile's fit measures
CALIBRATION_PLANS = (("shard", "none"), ("shard_keep", "none"), ("replicate", "none"), ("shard", "full"),
                     ("replicate", "full"), ("shard", "selective"))
# a case's key: the sharding and this suffix of its checkpoint mode (a profile's cached steps keep their keys)
_CASE_SUFFIX = {"none": "", "full": "+ckpt", "selective": "+sel"}
# the steps train at the default precision and optimizer, as `autoplan search` plans by default
CALIBRATION_DTYPE, CALIBRATION_OPTIMIZER = DEFAULT_PRECISION, DEFAULT_OPTIMIZER
# On a GPU the steps must be bound by their kernels, as a real model's are, not by the CPU issuing them: at width
# 1024 an H200 ran micro-batches 4 and 16 in the same time (3.6 and 3.8 ms forward), which fitted a compute scale of
# 0.06 and 1.35 ms a unit. Width 4096 (32 heads of 128, flash's sizes) does 16x the work per token.
CALIBRATION_MICRO_BATCHES = {"cpu": (2, 8), "cuda": (1, 4)}
CALIBRATION_WIDTH = {"cpu": 96, "cuda": 4096}
CALIBRATION_HEADS = {"cpu": 4, "cuda": 32}
CALIBRATION_SEQ_LEN = {"cpu": 128, "cuda": 1024}
WARMUP_STEPS, TIMED_STEPS = 3, 10
CALIBRATION_ROUNDS = 3


def calibration_model(depth: int, device_type: str) -> str:
    """The zoo spec of the calibration model at one depth (GPT-2 blocks, vocabulary 512), with as many positions as
    the calibration sequence (gpt2-tiny's 128 are too few on CUDA) and, on CUDA, heads of 128."""
    positions = f",max_seq_len={CALIBRATION_SEQ_LEN[device_type]}" if CALIBRATION_SEQ_LEN[device_type] > 128 else ""
    heads = f",n_heads={CALIBRATION_HEADS[device_type]}" if CALIBRATION_HEADS[device_type] != 4 else ""
    return f"gpt2-tiny[n_layers={depth},d_model={CALIBRATION_WIDTH[device_type]}{heads}{positions}]"


def calibration_workloads(device_type: str) -> dict[str, tuple[int, ...]]:
    """Models and micro-batches whose ops the profile must time for the fit (every depth has the same ops)."""
    return {calibration_model(max(CALIBRATION_DEPTHS), device_type): CALIBRATION_MICRO_BATCHES[device_type]}


def calibration_cases(device_type: str) -> list[tuple[str, str, int, int]]:
    """(strategy, checkpoint mode, depth, micro-batch) of every calibration step."""
    return [(strategy, checkpoint, depth, mb) for strategy, checkpoint in CALIBRATION_PLANS
            for depth in CALIBRATION_DEPTHS for mb in CALIBRATION_MICRO_BATCHES[device_type]]


def case_key(strategy: str, checkpoint: str | bool, depth: int, micro_batch: int) -> str:
    """`checkpoint`: a mode's name, or a bool as profiles measured before the selective case record it."""
    return f"{strategy}{_CASE_SUFFIX[checkpoint_name(checkpoint)]}/{depth}/{micro_batch}"


# the calibration plans are costed with this profile: only their decisions run, so any profile will do
PLAN_PROFILE = "a100-sxm4-80gb"


def uniform_plan(traced, strategy: str, checkpoint: str | bool, world_size: int, micro_batch: int):
    """The plan `autoplan search --strategy S [--checkpoint] --batch-size MB` writes for `traced` (a
    TracedModel), built directly: the same decisions, micro-batch and predictions, with nothing searched
    (no sweep, no baselines; the solver's record says FIXED)."""
    from autoplan.api.prepare import allocator_conf
    from autoplan.models.fingerprint import model_fingerprint
    from autoplan.plan.assemble import prediction, unit_decisions
    from autoplan.plan.schema import ClusterSpec, ModelRef, Plan, SolverInfo, SweepEntry, TrainingSpec
    from autoplan.settings import SearchSettings
    from autoplan.solve.cluster import resolve_cluster
    from autoplan.solve.request import Limits
    from autoplan.solve.solver import SolveStatus
    from autoplan.version import __version__
    from cost_models.evaluate import evaluate, uniform_choices

    dtype, optimizer, granularity = CALIBRATION_DTYPE, CALIBRATION_OPTIMIZER, "block"
    cluster = resolve_cluster(world_size, None, None, PLAN_PROFILE)
    limits = Limits(cluster.profile.mem_bytes, allocator_conf=allocator_conf(SearchSettings.create(), cluster))
    traced.price_for(None, cluster.profile.device_type)  # as a search prices it
    tables = traced.cache(PRECISIONS[dtype].compute_dtype, granularity)
    table = tables.table(micro_batch, 1, cluster, traced.seq_len, dtype, optimizer)
    table = limits.with_margin(table, tables)  # the allocator's bound per time point, as a search's table carries
    choices = uniform_choices(table, strategy, checkpoint, exact=True)
    if choices is None:
        raise ValueError(f"calibration plan {strategy!r} is not an option on {world_size} ranks of one node")
    result = evaluate(table, choices)
    throughput = table.samples_per_step / result.step_time_s
    return Plan(
        autoplan_version=__version__,
        model=ModelRef(name=traced.name, config=traced.resolved.config, n_params=traced.n_params,
                       fingerprint=model_fingerprint(traced.module), tracer=tables.tracer,
                       **traced.notes(PRECISIONS[dtype].compute_dtype)),
        cluster=ClusterSpec.of(cluster, limits),
        training=TrainingSpec(micro_batch_size=micro_batch, grad_accum_steps=1,
                              global_batch_size=table.samples_per_step, seq_len=traced.seq_len, dtype=dtype,
                              optimizer=optimizer, granularity=granularity),
        units=unit_decisions(table, choices),
        predicted=prediction(table, result, limits.allocator_conf),
        solver=SolverInfo(status=SolveStatus.FIXED, objective_s=result.step_time_s, bound_s=result.step_time_s,
                          num_variables=0, num_constraints=0,
                          micro_batch_sweep=[SweepEntry(micro_batch_size=micro_batch, grad_accum_steps=1,
                                                        status=SolveStatus.FIXED, step_time_s=result.step_time_s,
                                                        throughput_samples_s=throughput)]),
        baselines=[],
    )


def _timed_steps(model, optimizer, data, shape, rank: int, device: torch.device,
                 steps: tuple[int, int]) -> dict[str, float]:
    """Median seconds of forward (loss included), backward and optimizer step over the timed steps
    (`steps`: warm-up, timed)."""
    from autoplan.run.data import rank_micro_batches
    from autoplan.run.worker import next_token_loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    phases: dict[str, list[float]] = {"fwd": [], "bwd": [], "step": []}
    warmup, timed = steps
    for step in range(warmup + timed):
        [(input_ids, labels)] = rank_micro_batches(data.global_batch(step, shape), rank, shape)
        input_ids, labels = input_ids.to(device), labels.to(device)
        sync()
        start = time.perf_counter()
        loss = next_token_loss(model(input_ids), labels)
        sync()
        forward_end = time.perf_counter()
        loss.backward()
        sync()
        backward_end = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= warmup:
            phases["fwd"].append(forward_end - start)
            phases["bwd"].append(backward_end - forward_end)
            phases["step"].append(time.perf_counter() - backward_end)
    return {phase: statistics.median(values) for phase, values in phases.items()}


def step_key(device_type: str, strategy: str, checkpoint: str | bool, depth: int, micro_batch: int,
             steps: tuple[int, int], round_index: int) -> str:
    """The measurement cache's key of one round of one calibration step: everything the time depends on
    besides the cache's scope (device, torch, threads) and the run's backend and ranks."""
    return (f"{calibration_model(depth, device_type)}@s{CALIBRATION_SEQ_LEN[device_type]}:{CALIBRATION_DTYPE}:"
            f"{CALIBRATION_OPTIMIZER}:{case_key(strategy, checkpoint, depth, micro_batch)}:"
            f"steps{steps[0]}+{steps[1]}:round{round_index}")


def measure_training_steps(device: torch.device, cases, steps: tuple[int, int] = (WARMUP_STEPS, TIMED_STEPS),
                           report=None, progress: bool = False) -> dict[str, dict[str, float]]:
    """On every rank of the default group: the phase times of each of `cases` ((key, strategy,
    checkpoint, depth, micro-batch), one round of a calibration step each), the slowest rank's, by key.
    `report(key, times)` is called on every rank as each case is measured."""
    from tqdm import tqdm

    from autoplan.api.traced import TracedModel
    from autoplan.run.apply import apply, materialise, model_for_plan
    from autoplan.run.data import BatchShape, SyntheticTokens, vocab_size_of

    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len = CALIBRATION_SEQ_LEN[device.type]
    traced = {depth: TracedModel(calibration_model(depth, device.type), seq_len=seq_len)
              for depth in sorted({case[3] for case in cases})}
    results: dict[str, dict[str, float]] = {}
    for key, strategy, checkpoint, depth, micro_batch in tqdm(cases, desc="calibration steps", unit="case",
                                                              disable=rank != 0 or not progress):
        plan = uniform_plan(traced[depth], strategy, checkpoint, world, micro_batch)
        model = model_for_plan(plan)
        data = SyntheticTokens(vocab_size_of(model), seed=0)
        model, optimizer = apply(model, plan, lr=1e-4)
        materialise(model, device, seed=0)
        shape = BatchShape(micro_batch, 1, world, seq_len)
        dist.barrier()
        times = _timed_steps(model, optimizer, data, shape, rank, device, steps)
        slowest = torch.tensor([times["fwd"], times["bwd"], times["step"]], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[key] = dict(zip(("fwd", "bwd", "step"), slowest.tolist()))
        if report is not None:
            report(key, results[key])
        del model, optimizer
    return results


def fastest_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's fastest over the rounds of one case (a neighbour's burst only ever slows a round)."""
    return {phase: min(r[phase] for r in rounds) for phase in ("fwd", "bwd", "step")}
