"""search: model -> trace -> units -> cost tables per micro-batch -> CP-SAT -> Plan.

The micro-batch sweep solves one CP-SAT model per candidate size (powers of two, or the divisors
a fixed global batch allows) and keeps the plan with the highest throughput. Memory grows with the
micro-batch, so the sweep stops at the first size nothing fits in.

A TracedModel holds the traces, so that many searches (a sweep of memory limits, other clusters)
and estimates of one model trace it once.
"""

from __future__ import annotations

import json
import math
import re

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from cost_models.evaluate import Evaluation, evaluate, uniform_choices
from cost_models.memory import CATEGORIES, total
from cost_models.step import lower_bound_step_s
from cost_models.table import ClusterShape, CostTable, activation_keep_bytes, build_cost_table, kept_saved_bytes

from . import __version__
from .errors import AutoplanError, InfeasibleError, UsageError
from .fingerprint import model_fingerprint
from .hf import HF_PREFIX, build_hf_model
from .models import UnknownModelError, build_model, count_params, get_config, load_factory
from .options import SHARDING_KINDS
from .plan import (
    Baseline, ClusterSpec, MemoryBreakdown, ModelRef, Plan, Prediction, SolverInfo, SweepEntry,
    TimelinePoint, TrainingSpec, UnitDecision, UnitPrediction,
)
from .profiles import DeviceProfile, load_profile
from .sizes import format_bytes, parse_mem_bytes
from .solver import DEFAULT_TIME_LIMIT_S, AffineModel, SolveResult, solve_min_memory, solve_min_time
from .trace import extrapolate_ops
from .tracing import ExampleInputs, TracePair, trace_pair
from .units import build_units

DEFAULT_MODEL = "gpt2-1.5b"
DEFAULT_PROFILE = "a100-sxm4-80gb"
DEFAULT_GPUS_PER_NODE = 8
MAX_MICRO_BATCH = 256
# plans are made to this fraction below --mem: predicted peaks land within ~1% of measured ones in a
# typical step (see benchmarks/RESULTS.md), and now and then a buffer freed late by another thread
# (gloo's) lifts a step's peak by up to ~2% more
DEFAULT_HEADROOM = 0.02
# the tie-break towards lower memory is best-effort: proving the leanest of many equally fast plans
# over near-identical blocks can take CP-SAT any time limit (405B: all 10 s); without it the fastest
# plan found stands
TIE_BREAK_TIME_S = 1.0
MAX_HEADROOM = 0.5
DTYPES = ("bf16-mixed", "bf16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd")
BASELINES = (("all-shard", "shard", False), ("all-shard+ckpt", "shard", True), ("all-replicate", "replicate", False))


def check_choice(flag: str, value: str, choices) -> None:
    """UsageError naming the flag, the bad value and the accepted ones."""
    if value not in choices:
        raise UsageError(f"unknown {flag} {value!r}; choose one of {', '.join(choices)}")


@dataclass
class ResolvedModel:
    module: nn.Module  # on the meta device
    name: str
    config: dict | None
    max_seq_len: int | None = None  # the default sequence length, when the model says


def parse_zoo_spec(spec: str) -> tuple[str, dict[str, int | float | bool]]:
    """'gpt2-tiny[n_layers=4,d_model=128]' -> ('gpt2-tiny', {'n_layers': 4, 'd_model': 128})."""
    match = re.fullmatch(r"\s*([^\[\]]+?)\s*(?:\[(.*)\])?\s*", spec)
    if match is None:
        raise UsageError(f"cannot read model {spec!r}: write NAME or NAME[field=value,...], e.g. gpt2-tiny[n_layers=4]")
    overrides: dict[str, int | float | bool] = {}
    for item in filter(None, (part.strip() for part in (match.group(2) or "").split(","))):
        field, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"model override {item!r} in {spec!r} is not field=value")
        try:
            value = json.loads(text.strip().lower())
        except json.JSONDecodeError:
            raise UsageError(f"model override {item!r} in {spec!r}: {text!r} is not a number or true/false") from None
        overrides[field.strip()] = value
    return match.group(1), overrides


def resolve_model(model: str | nn.Module) -> ResolvedModel:
    """A zoo name, "hf:path/to/config.json" (or its directory), a "package.module:factory" spec, or a
    module object."""
    if isinstance(model, nn.Module):
        return ResolvedModel(model, type(model).__name__, None)
    if model.startswith(HF_PREFIX):
        built = build_hf_model(model[len(HF_PREFIX):])
        return ResolvedModel(built.module, model, None, built.max_seq_len)
    if ":" in model and "[" not in model:
        try:
            module = load_factory(model, device="meta")
        except (ValueError, ImportError) as exc:
            raise UsageError(f"cannot build model {model!r}: {exc}") from exc
        return ResolvedModel(module, model, None)
    name, overrides = parse_zoo_spec(model)
    try:
        config = get_config(name, **overrides)
    except UnknownModelError as exc:
        raise UsageError(str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise UsageError(f"cannot build {model!r}: {exc}") from exc
    return ResolvedModel(build_model(config, device="meta"), model, config.to_dict(), config.max_seq_len)


@dataclass(frozen=True)
class Cluster:
    shape: ClusterShape
    profile: DeviceProfile
    profile_name: str
    is_default: bool


def resolve_cluster(gpus: int | None, nodes: int | None, gpus_per_node: int | None, profile: str | None) -> Cluster:
    for label, value in (("--gpus", gpus), ("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value is not None and value < 1:
            raise UsageError(f"{label} must be at least 1, got {value}")
    is_default = gpus is None and nodes is None and gpus_per_node is None and profile is None
    nodes = nodes or 1
    if gpus_per_node is None:
        if gpus is not None and gpus % nodes:
            raise UsageError(f"--gpus {gpus} is not a multiple of --nodes {nodes}")
        gpus_per_node = gpus // nodes if gpus is not None else DEFAULT_GPUS_PER_NODE
    if gpus is not None and gpus != nodes * gpus_per_node:
        raise UsageError(f"--gpus {gpus} does not equal --nodes {nodes} x --gpus-per-node {gpus_per_node}")
    profile_name = profile or DEFAULT_PROFILE
    return Cluster(ClusterShape(nodes * gpus_per_node, nodes, gpus_per_node), load_profile(profile_name),
                   profile_name, is_default)


def micro_batch_candidates(world_size: int, batch_size: int | None, global_batch: int | None) -> list[tuple[int, int]]:
    """(micro_batch_size, grad_accum_steps) pairs to try, smallest micro-batch first."""
    if global_batch is not None and global_batch < 1:
        raise UsageError(f"--global-batch must be positive, got {global_batch}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    if global_batch is None:
        sizes = [batch_size] if batch_size else [2**k for k in range(MAX_MICRO_BATCH.bit_length()) if 2**k <= MAX_MICRO_BATCH]
        return [(size, 1) for size in sizes]
    if global_batch % world_size:
        raise UsageError(f"--global-batch {global_batch} is not divisible by the {world_size} GPUs")
    per_rank = global_batch // world_size
    if batch_size is not None:
        if per_rank % batch_size:
            raise UsageError(
                f"--global-batch {global_batch} is not a multiple of --batch-size {batch_size} x {world_size} GPUs")
        return [(batch_size, per_rank // batch_size)]
    return [(size, per_rank // size) for size in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % size == 0]


class _TraceCache:
    """Op costs at any micro-batch from two traces (micro-batch 1 and 2): they are affine in it."""

    def __init__(self, model: nn.Module, seq_len: int, compute_dtype: str, granularity: str,
                 traces: TracePair | None = None):
        traces = traces or trace_pair(model, seq_len, compute_dtype)
        self.tracer = traces.tracer
        self.trace_1, self.trace_2 = traces.at_1, traces.at_2
        self.units = build_units(model, self.trace_1, granularity)
        self.keep_1 = activation_keep_bytes(self.trace_1, self.units)
        self.keep_2 = activation_keep_bytes(self.trace_2, self.units)
        self.kept_saved_1 = kept_saved_bytes(self.trace_1, self.units)
        self.kept_saved_2 = kept_saved_bytes(self.trace_2, self.units)

    def table(self, micro_batch_size: int, grad_accum_steps: int, cluster: Cluster, seq_len: int,
              dtype: str, optimizer: str) -> CostTable:
        ops = extrapolate_ops(self.trace_1.ops, self.trace_2.ops, micro_batch_size)
        keep = [a + (b - a) * (micro_batch_size - 1) for a, b in zip(self.keep_1, self.keep_2)]
        kept_saved = {name: a + (self.kept_saved_2.get(name, 0) - a) * (micro_batch_size - 1)
                      for name, a in self.kept_saved_1.items()}
        return build_cost_table(self.units, ops, keep, cluster.profile, cluster.shape, micro_batch_size,
                                grad_accum_steps, seq_len, dtype, optimizer, kept_saved)


class TracedModel:
    """A model read once for planning: reuse it for any number of searches and estimates.

    `model` is a zoo name, "hf:path/to/config.json", "package.module:factory" or an nn.Module.
    Tracing runs the model on the meta device at micro-batch 1 and 2 (op costs are affine in the
    micro-batch), once per compute dtype, when a search or estimate first needs it. `seq_len` defaults
    to the model's context (zoo and Hugging Face models) or to dim 1 of `example_inputs`, which a model
    whose forward does not take token ids [batch, seq] needs (tensors with the batch in dim 0).
    `tracer` forces "fx" or "dispatch"; by default fx is tried first.
    """

    def __init__(self, model: str | nn.Module, *, seq_len: int | None = None, example_inputs: Any = None,
                 tracer: str | None = None):
        self.resolved = resolve_model(model)
        self.example_inputs = ExampleInputs.of(example_inputs) if example_inputs is not None else None
        if seq_len is None:
            seq_len = self.resolved.max_seq_len or (self.example_inputs.seq_len if self.example_inputs else None)
        if seq_len is None:
            raise UsageError("give --seq-len (the sequence length to plan for) for a model outside the zoo")
        if seq_len < 1:
            raise UsageError(f"--seq-len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.forced_tracer = tracer
        self._traces: dict[str, TracePair] = {}
        self._caches: dict[tuple[str, str], _TraceCache] = {}

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def module(self) -> nn.Module:
        return self.resolved.module

    @property
    def n_params(self) -> int:
        return count_params(self.resolved.module)

    @property
    def tracer(self) -> str | None:
        """The tracer that read the model ("fx" or "dispatch"), None before the first trace."""
        return next((pair.tracer for pair in self._traces.values()), None)

    def traces(self, compute_dtype: str = "bf16") -> TracePair:
        if compute_dtype not in self._traces:
            self._traces[compute_dtype] = trace_pair(self.resolved.module, self.seq_len, compute_dtype,
                                                     self.example_inputs, self.forced_tracer)
        return self._traces[compute_dtype]

    def cache(self, compute_dtype: str, granularity: str) -> _TraceCache:
        key = (compute_dtype, granularity)
        if key not in self._caches:
            self._caches[key] = _TraceCache(self.resolved.module, self.seq_len, compute_dtype, granularity,
                                            self.traces(compute_dtype))
        return self._caches[key]

    def search(self, mem: str | int, **settings) -> Plan:
        """`autoplan.search` on this traced model; takes the same keyword settings."""
        return search(self, mem, **settings)

    def estimate(self, **settings):
        """`autoplan.estimate` on this traced model; takes the same keyword settings."""
        from .estimate import estimate

        return estimate(self, **settings)

    def __repr__(self) -> str:
        return (f"TracedModel({self.name!r}, {self.n_params:,} parameters, seq_len={self.seq_len}, "
                f"tracer={self.tracer or 'not traced yet'})")


def trace(model: str | nn.Module, *, seq_len: int | None = None, example_inputs: Any = None,
          dtype: str = "bf16-mixed", tracer: str | None = None) -> TracedModel:
    """Read a model once for planning; pass the result to `search`, `estimate` or `frontier` in place of
    the model. Traces now (for `dtype`'s compute precision), so errors surface here.

    >>> import autoplan
    >>> traced = autoplan.trace("gpt2-tiny", seq_len=64)
    >>> traced.tracer, traced.n_params
    ('fx', 141056)
    """
    check_choice("--dtype", dtype, DTYPES)
    traced = TracedModel(model, seq_len=seq_len, example_inputs=example_inputs, tracer=tracer)
    traced.traces(compute_dtype_of(dtype))
    return traced


def compute_dtype_of(dtype: str) -> str:
    return "fp32" if dtype == "fp32" else "bf16"


def _breakdown(point) -> MemoryBreakdown:
    return MemoryBreakdown(**{f"{c}_bytes": int(point.parts[c]) for c in CATEGORIES})


def _prediction(table: CostTable, result: Evaluation) -> Prediction:
    samples = table.samples_per_step
    return Prediction(
        peak_mem_bytes=result.peak_mem_bytes,
        peak_point=result.peak_point.label,
        breakdown=_breakdown(result.peak_point),
        step_time_s=result.step_time_s,
        throughput_samples_s=samples / result.step_time_s,
        throughput_tokens_s=samples * table.seq_len / result.step_time_s,
        timeline=[TimelinePoint(point=p.label, total_bytes=int(total(p)), breakdown=_breakdown(p))
                  for p in result.points],
    )


def _unit_decisions(table: CostTable, choices: list[int]) -> list[UnitDecision]:
    decisions = []
    for unit, options, costs, choice in zip(table.units, table.options, table.costs, choices):
        option, cost = options[choice], costs[choice]
        decisions.append(UnitDecision(
            module=unit.path, sharding=option.sharding, checkpoint=option.checkpoint,
            reshard_after_forward=option.kind.reshard_after_forward, params=unit.numel,
            param_shapes={p.name: list(p.shape) for p in unit.params},
            predicted=UnitPrediction(
                persistent_bytes=cost.param_bytes + cost.optimizer_bytes, grad_bytes=cost.grad_bytes,
                gathered_bytes=cost.gathered_bytes, activation_bytes=cost.activation_bytes,
                fwd_s=cost.fwd_s, bwd_s=cost.bwd_s, comm_s=cost.comm_fwd_s + cost.comm_bwd_s,
                optimizer_s=cost.optimizer_s,
            ),
        ))
    return decisions


def _baselines(tables: list[CostTable], mem_limit_bytes: int) -> list[Baseline]:
    baselines = []
    for name, sharding, checkpoint in BASELINES:
        best: tuple[CostTable, Evaluation] | None = None
        smallest: tuple[CostTable, Evaluation] | None = None
        for table in tables:
            choices = uniform_choices(table, sharding, checkpoint)
            result = evaluate(table, choices)
            smallest = smallest or (table, result)
            if result.fits(mem_limit_bytes):
                throughput = table.samples_per_step / result.step_time_s
                if best is None or throughput > best[0].samples_per_step / best[1].step_time_s:
                    best = (table, result)
        table, result = best or smallest
        baselines.append(Baseline(
            name=name, fits=best is not None, micro_batch_size=table.micro_batch_size,
            peak_mem_bytes=result.peak_mem_bytes, step_time_s=result.step_time_s,
            throughput_samples_s=table.samples_per_step / result.step_time_s,
        ))
    return baselines


def _infeasible(table: CostTable, mem_limit_bytes: int, headroom: float, model_name: str, cluster: Cluster,
                time_limit_s: float, fixed_batch: bool) -> InfeasibleError:
    smallest = solve_min_memory(table, time_limit_s=time_limit_s)
    peak = int(smallest.objective) if smallest.objective is not None else None
    needed = math.ceil(peak / (1 - headroom)) if peak is not None else None  # the limit that leaves the headroom
    lean = evaluate(table, smallest.choices) if smallest.choices else None
    state = ""
    if lean is not None:
        parts = lean.peak_point.parts
        state = (f" (at its peak: parameters, gradients and optimizer states "
                 f"{format_bytes(parts['params'] + parts['grads'] + parts['optimizer'])}, activations "
                 f"{format_bytes(parts['activations'])}, gathered parameters {format_bytes(parts['gathered'])}, "
                 f"temporaries {format_bytes(parts['temporaries'])})")
    helps = [f"a limit of at least {format_bytes(needed)}" if needed else "a larger limit",
             f"more GPUs (sharding divides parameters, gradients and optimizer states over {cluster.shape.world_size} "
             "now)", "a shorter --seq-len", "--dtype bf16 (no fp32 master weights)"]
    if fixed_batch and table.micro_batch_size > 1:
        helps.insert(1, "a smaller --batch-size")
    return InfeasibleError(
        f"no plan for {model_name} fits in {format_bytes(mem_limit_bytes)} per GPU less {headroom:.0%} headroom: the "
        f"smallest peak any plan reaches (all units sharded, checkpointing where it helps, micro-batch "
        f"{table.micro_batch_size}) is {format_bytes(peak) if peak else 'unknown'}{state}. What would help: "
        + "; ".join(helps) + ".",
        min_mem_bytes=needed,
    )


def search(
    model: str | nn.Module | TracedModel = DEFAULT_MODEL,
    mem: str | int = "8GB",
    *,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    profile: str | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    global_batch: int | None = None,
    dtype: str = "bf16-mixed",
    optimizer: str = "adamw",
    granularity: str = "block",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    example_inputs: Any = None,
    strategy: str | None = None,
    checkpoint: bool = False,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """The fastest plan whose predicted per-rank peak memory is at most `mem` less a `headroom` fraction. Raises InfeasibleError
    (with the smallest limit that would fit) when none does, UsageError for bad input.

    `model`: a zoo name, "hf:path/to/config.json", "package.module:factory", an nn.Module, or a
    TracedModel (from `autoplan.trace`) to reuse its traces. `mem`: bytes or a size such as "8GB".
    The cluster is `gpus` in `nodes` x `gpus_per_node` with a device `profile`; without `batch_size`
    the micro-batch is swept; `global_batch` fixes the samples per step (gradient accumulation fills
    it). `example_inputs`: see TracedModel. `strategy` ("shard", "shard_keep", "replicate",
    "hybrid"), with `checkpoint`, skips the solver: every unit takes that option (the plan to run a
    uniform baseline), and only the micro-batch is searched.

    >>> import autoplan
    >>> plan = autoplan.search("gpt2-tiny", "60MB", gpus=2, seq_len=64)
    >>> plan.predicted.peak_mem_bytes <= 60e6
    True
    """
    mem_limit_bytes = parse_mem_bytes(mem)
    if not 0 <= headroom < MAX_HEADROOM:
        raise UsageError(f"--headroom must be a fraction of the limit in [0, {MAX_HEADROOM}), got {headroom:g} "
                         f"(e.g. 0.02 plans to 98% of --mem)")
    # the headroom keeps plans under the limit when they run (see DEFAULT_HEADROOM)
    planned_bytes = int(mem_limit_bytes * (1 - headroom))
    check_choice("--dtype", dtype, DTYPES)
    check_choice("--optimizer", optimizer, OPTIMIZERS)
    if time_limit_s <= 0:
        raise UsageError(f"--time-limit must be positive, got {time_limit_s}")
    if strategy is not None:
        check_choice("--strategy", strategy, SHARDING_KINDS)
    session = reuse_traced(model, seq_len, example_inputs)
    resolved, seq_len = session.resolved, session.seq_len
    cluster = resolve_cluster(gpus, nodes, gpus_per_node, profile)
    candidates = micro_batch_candidates(cluster.shape.world_size, batch_size, global_batch)

    traced = session.cache(compute_dtype_of(dtype), granularity)

    sweep: list[SweepEntry] = []
    tables: list[CostTable] = []
    best = None  # (throughput, table, result)
    wall_s, num_vars, num_cons = 0.0, 0, 0
    for micro_batch_size, accum in candidates:
        table = traced.table(micro_batch_size, accum, cluster, seq_len, dtype, optimizer)
        if best is not None and table.samples_per_step / lower_bound_step_s(table) <= best[0]:
            # even with no memory limit this micro-batch cannot beat the best plan: skip the solve
            sweep.append(SweepEntry(micro_batch_size=micro_batch_size, grad_accum_steps=accum,
                                    status="PRUNED", step_time_s=None, throughput_samples_s=None))
            tables.append(table)
            continue
        affine = AffineModel.of(table)
        if strategy is None:
            result = solve_min_time(table, planned_bytes, time_limit_s, affine=affine)
        else:
            result = _fixed_strategy(table, affine, strategy, checkpoint, planned_bytes)
        wall_s += result.wall_time_s
        num_vars, num_cons = result.num_variables, result.num_constraints
        if result.choices is None:
            sweep.append(SweepEntry(micro_batch_size=micro_batch_size, grad_accum_steps=accum, status=result.status,
                                    step_time_s=None, throughput_samples_s=None))
            if result.status != "INFEASIBLE":
                tables.append(table)
                continue  # the time limit ran out: no verdict on this size, try the next
            if tables:
                break  # a larger micro-batch needs more memory still
            tables.append(table)
            break
        tables.append(table)
        throughput = table.samples_per_step / result.objective
        sweep.append(SweepEntry(micro_batch_size=micro_batch_size, grad_accum_steps=accum, status=result.status,
                                step_time_s=result.objective, throughput_samples_s=throughput))
        if best is None or throughput > best[0] * (1 + 1e-9):
            best = (throughput, table, result, affine)
    if best is None and any(entry.status not in ("INFEASIBLE", "PRUNED") for entry in sweep):
        raise AutoplanError(
            f"the solver found no plan within --time-limit {time_limit_s:g} s per micro-batch size "
            f"({', '.join(f'{e.micro_batch_size}: {e.status.lower()}' for e in sweep)}); raise --time-limit, or "
            "give --batch-size to try a single micro-batch size")
    if best is None:
        raise _infeasible(tables[0], mem_limit_bytes, headroom, resolved.name, cluster, time_limit_s,
                          batch_size is not None)

    _, table, result, affine = best
    choices = result.choices
    if strategy is None:
        # Among plans as fast as the best, prefer the one with the lowest peak memory.
        lean = solve_min_memory(table, time_limit_s=min(time_limit_s, TIE_BREAK_TIME_S), max_step_s=result.objective,
                                mem_limit_bytes=planned_bytes, affine=affine, start_from=result.choices)
        wall_s += lean.wall_time_s
        choices = lean.choices or result.choices
    chosen = evaluate(table, choices)
    fitting_tables = [t for t, entry in zip(tables, sweep) if entry.status != "INFEASIBLE"]

    return Plan(
        autoplan_version=__version__,
        model=ModelRef(name=resolved.name, config=resolved.config, n_params=count_params(resolved.module),
                       fingerprint=model_fingerprint(resolved.module), tracer=traced.tracer),
        cluster=ClusterSpec(world_size=cluster.shape.world_size, nodes=cluster.shape.nodes,
                            gpus_per_node=cluster.shape.gpus_per_node, profile=cluster.profile_name,
                            device_mem_bytes=cluster.profile.mem_bytes, mem_limit_bytes=mem_limit_bytes,
                            mem_headroom=headroom),
        training=TrainingSpec(micro_batch_size=table.micro_batch_size, grad_accum_steps=table.grad_accum_steps,
                              global_batch_size=table.samples_per_step, seq_len=seq_len, dtype=dtype,
                              optimizer=optimizer, granularity=granularity),
        units=_unit_decisions(table, choices),
        predicted=_prediction(table, chosen),
        solver=SolverInfo(status=result.status, objective_s=result.objective, bound_s=result.bound,
                          wall_time_s=wall_s, num_variables=num_vars, num_constraints=num_cons,
                          micro_batch_sweep=sweep),
        baselines=_baselines(fitting_tables or tables, planned_bytes),
    )


def _fixed_strategy(table: CostTable, affine: AffineModel, strategy: str, checkpoint: bool,
                    mem_limit_bytes: int) -> SolveResult:
    """A uniform plan evaluated in place of a solve, reported in the solver's terms."""
    choices = uniform_choices(table, strategy, checkpoint, exact=True)
    if choices is None:
        raise UsageError(f"--strategy {strategy} is not available here (hybrid needs --nodes 2 or more)")
    result = evaluate(table, choices)
    fits = result.peak_mem_bytes <= mem_limit_bytes
    stats = (affine.algebra.size, 0, len(affine.mem_const))
    if not fits:
        return SolveResult("INFEASIBLE", None, None, None, 0.0, *stats)
    return SolveResult("FIXED", choices, result.step_time_s, result.step_time_s, 0.0, *stats)


def reuse_traced(model: str | nn.Module | TracedModel, seq_len: int | None, example_inputs: Any) -> TracedModel:
    """`model` itself when it is traced already (its sequence length and inputs are fixed), else a new one."""
    if not isinstance(model, TracedModel):
        return TracedModel(model, seq_len=seq_len, example_inputs=example_inputs)
    if seq_len is not None and seq_len != model.seq_len:
        raise UsageError(f"{model.name} was traced at sequence length {model.seq_len}, not {seq_len}; "
                         "trace it again with seq_len=" + str(seq_len))
    if example_inputs is not None:
        raise UsageError("example_inputs belong to autoplan.trace(); this model is traced already")
    return model


__all__ = ["search", "trace", "TracedModel", "resolve_model", "resolve_cluster", "micro_batch_candidates",
           "DEFAULT_MODEL", "DEFAULT_PROFILE"]
