"""The plan file: a pydantic v2 schema, JSON on disk, written atomically, validated on load.

`schema_version` comes first; a file from a newer autoplan is refused rather than misread. The
checked-in JSON Schema (plan_schema.json beside this file) is kept equal to `Plan.model_json_schema()`
by a test; regenerate it with `python -m autoplan.plan.schema > autoplan/plan/plan_schema.json`.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError
from pydantic_core import PydanticCustomError, core_schema

from autoplan.errors import PlanFileError
from autoplan.fileio import read_versioned_json, write_text_atomic
from autoplan.plan.cluster_spec import ClusterSpec
from autoplan.plan.figures import Count, Seconds, StrictRecord
from autoplan.plan.expert_spec import ExpertParallelSpec
from autoplan.plan.pipeline_spec import PipelineSpec
from autoplan.plan.report import format_plan
from autoplan.solve.solver import SolveStatus
from cost_models.options import (
    CHECKPOINT_MODES,
    OPTIMIZERS,
    PRECISIONS,
    SHARDING_KINDS,
    checkpoint_of_bool,
    unknown_message,
)

PLAN_SCHEMA_VERSION = 1
UNKNOWN_OPTION = "unknown_option"  # the pydantic error type of a name no registered row has


class RegisteredName:
    """A string field that holds the name of a row in one of cost_models.options' registries.

    Both the check and the JSON Schema read the registry when they run, not when this module is
    imported: a row registered later is accepted, and the schema lists the names as an enum exactly
    as a Literal of them would (so the checked-in plan_schema.json matches the default registry)."""

    def __init__(self, what: str, registry: Mapping[str, Any]):
        self.what, self.registry = what, registry

    def __get_pydantic_core_schema__(self, source: Any, handler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler) -> dict[str, Any]:
        return {"enum": list(self.registry), "type": "string"}

    def _check(self, name: str) -> str:
        if name not in self.registry:
            raise PydanticCustomError(UNKNOWN_OPTION, "{message}",
                                      {"what": self.what, "message": unknown_message(self.what, name, self.registry)})
        return name


Sharding = Annotated[str, RegisteredName("sharding", SHARDING_KINDS)]
CheckpointName = Annotated[str, BeforeValidator(checkpoint_of_bool), RegisteredName("checkpoint", CHECKPOINT_MODES)]
TrainDtype = Annotated[str, RegisteredName("dtype", PRECISIONS)]
OptimizerName = Annotated[str, RegisteredName("optimizer", OPTIMIZERS)]
Granularity = Literal["block", "fine", "leaf", "root"]
TpLayoutName = Literal["megatron", "megatron_sp", "vocab", "sequence"]  # cost_models.tensor_parallel.UnitLayout
Tracer = Literal["fx", "dispatch"]


_Strict = StrictRecord  # counts, bytes and seconds never negative, no NaN or infinity, no extra keys (figures.py)


class AttentionRecord(_Strict):
    """A run of alike attention calls and the kernel that prices (and runs) them (cost_models.attention)."""

    modules: str  # "model.layers.0-31.self_attn": the calls' modules, alike but for block indices
    count: int = Field(ge=1)
    kernel: Literal["flash", "efficient", "math"]
    detail: str  # what the call is: "causal, window 4096, K/V 8 of 32 heads"


class UnpricedRecord(_Strict):
    """An aten op no FLOP formula prices (autoplan.tracing.flops): its time is not in the plan."""

    op: str  # "aten.foo", or a library's custom op
    modules: str
    count: int = Field(ge=1)
    flops_guess: int  # 2 x output elements x the contracted size, at micro-batch 1, forward and backward


class ModelRef(_Strict):
    """How to rebuild the model: a zoo name and config, or a user factory named on the command line."""

    name: str  # zoo name, the factory spec "package.module:factory", or "hf:path/to/config.json"
    config: dict[str, Any] | None = None  # zoo ModelConfig as a dict; None for user factories
    n_params: Count
    fingerprint: str  # sha256 of the module tree and parameter shapes
    tracer: Tracer = "fx"  # what read the model: torch.fx, or the dispatch-level fallback
    # how it was priced: each attention's kernel, the kernel asked for (None: torch's pick on the profile's
    # device), ops no formula prices (and whether that was allowed), the experts' capacity factor
    attention: list[AttentionRecord] = Field(default_factory=list, exclude_if=operator.not_)
    attention_request: Literal["flash", "efficient", "math"] | None = Field(default=None, exclude_if=operator.not_)
    unpriced: list[UnpricedRecord] = Field(default_factory=list, exclude_if=operator.not_)
    allow_unpriced: bool = Field(default=False, exclude_if=operator.not_)
    capacity_factor: float = Field(default=1.0, ge=1.0, exclude_if=lambda value: value == 1.0)
    # what the forward takes when not token ids [batch, seq] alone (autoplan.models.inputs' spec); None: token ids
    inputs: str | None = Field(default=None, exclude_if=operator.not_)


class TrainingSpec(_Strict):
    micro_batch_size: int = Field(ge=1)  # per rank
    grad_accum_steps: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)  # micro_batch_size * grad_accum_steps * world_size
    seq_len: int = Field(ge=1)
    dtype: TrainDtype
    optimizer: OptimizerName
    granularity: Granularity


class UnitPrediction(_Strict):
    persistent_bytes: Count  # parameters + optimizer states held by this rank
    grad_bytes: Count  # reduced gradients held by this rank
    gathered_bytes: Count  # unsharded parameters while the unit runs
    activation_bytes: Count  # saved for backward per micro-batch (unit input only when checkpointed)
    fwd_s: Seconds
    bwd_s: Seconds  # includes the recompute when checkpointed
    comm_s: Seconds  # all-gathers, reduce-scatter, all-reduce per micro-batch (and offload's host copies)
    optimizer_s: Seconds
    host_bytes: Count = 0  # offloaded parameters, gradients and optimizer states in host memory, per rank


class UnitDecision(_Strict):
    module: str  # module path; "" is the root module
    sharding: Sharding
    checkpoint: CheckpointName  # "none", "selective", "full" (older plans: true = full, false = none)
    offload: bool = False  # parameters, gradients and optimizer states on the host (FSDP2 CPUOffloadPolicy)
    reshard_after_forward: bool
    params: Count  # parameters owned (not counting nested units)
    param_shapes: dict[str, list[Count]]
    predicted: UnitPrediction
    # under tensor parallelism: megatron (column/row-wise attention and MLP), megatron_sp (and sequence-parallel
    # norms), vocab (vocabulary-parallel embedding or head), sequence (sequence-parallel norms only); None:
    # data-parallel only, replicated across the tensor-parallel group
    tp: TpLayoutName | None = Field(default=None, exclude_if=lambda value: value is None)

    @property
    def label(self) -> str:
        """"shard", "shard +ckpt", "replicate +sel +offload": the decision as reports show it."""
        mode = CHECKPOINT_MODES.get(self.checkpoint)
        suffix = mode.label if mode is not None else f"+{self.checkpoint}"
        return self.sharding + (f" {suffix}" if suffix else "") + (" +offload" if self.offload else "")


class MemoryBreakdown(_Strict):
    params_bytes: Count
    grads_bytes: Count
    optimizer_bytes: Count
    activations_bytes: Count
    gathered_bytes: Count
    temporaries_bytes: Count


class TimelinePoint(_Strict):
    point: str  # e.g. "fwd transformer.h.3", "bwd lm_head", "optimizer step"
    total_bytes: Count
    breakdown: MemoryBreakdown


class Prediction(_Strict):
    peak_mem_bytes: Count
    peak_point: str
    breakdown: MemoryBreakdown  # at the peak
    step_time_s: Seconds
    throughput_samples_s: Seconds
    throughput_tokens_s: Seconds
    timeline: list[TimelinePoint]
    host_mem_bytes: Count = 0  # offloaded state per rank in host memory (pinned)
    host_mem_per_node_bytes: Count = 0  # the same over the node's ranks: what must fit the node's host memory
    # CUDA profiles only (None on other devices and in older plans), from the peak under the plan's
    # allocator_conf (cost_models.allocator_margin): what torch's caching allocator needs to run the step (its
    # rounding, per-stream pages or segments, fragmentation, kernel workspaces; an upper bound), and at most what
    # torch.cuda.max_memory_reserved shows with memory to spare, within the device's (older plans: native needed)
    needed_bytes: Count | None = Field(default=None, exclude_if=lambda value: value is None)
    reserved_bytes: Count | None = Field(default=None, exclude_if=lambda value: value is None)
    # `search --fit-allocator` only: the smallest limit this plan's step ran in when its allocations were
    # replayed through the caching allocator model (autoplan.run.allocator_fit); None when not replayed
    allocator_needed_bytes: Count | None = Field(default=None, exclude_if=lambda value: value is None)
    # the plan's model FLOPs utilisation: a rank's forward and backward FLOPs (torch's FlopCounter: attention
    # counted whole, no recomputation) per step over the step time and the profile's peak in the compute dtype
    mfu: float | None = Field(default=None, ge=0, exclude_if=lambda value: value is None)


class SweepEntry(_Strict):
    micro_batch_size: int = Field(ge=1)
    grad_accum_steps: int = Field(ge=1)
    status: SolveStatus  # the solve at this micro-batch; FIXED for a uniform strategy, PRUNED when skipped
    step_time_s: Seconds | None
    throughput_samples_s: Seconds | None


class TpDegreeEntry(_Strict):
    """The best plan of one tensor-parallel degree (with or without sequence parallelism), or why there is none."""

    degree: int = Field(ge=1)
    sequence_parallel: bool
    ep_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)  # its expert-parallel degree
    fits: bool
    cp_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)  # context parallelism beside it
    micro_batch_size: int | None = Field(default=None, ge=1)
    grad_accum_steps: int | None = Field(default=None, ge=1)
    step_time_s: Seconds | None = None
    throughput_samples_s: Seconds | None = None
    peak_mem_bytes: Count | None = None
    # older plans: the degree's sweep in wall-clock seconds (newer ones keep it in Plan.timing, apart)
    wall_time_s: Seconds | None = Field(default=None, exclude_if=lambda value: value is None)
    note: str = ""  # why it was not searched, or what does not fit
    # the mesh's pipeline degree and, where one fits, its schedule (written only above 1)
    pp_degree: int = Field(default=1, ge=1, exclude_if=lambda value: value == 1)
    schedule: str | None = Field(default=None, exclude_if=lambda value: value is None)


class SolverInfo(_Strict):
    status: SolveStatus  # OPTIMAL, FEASIBLE (time limit hit), FIXED (a uniform strategy, no solve)
    objective_s: Seconds  # the solver's step-time objective
    bound_s: Seconds  # best proven lower bound; objective - bound is the optimality gap
    # older plans: the micro-batch sweep's wall-clock seconds (newer ones keep it in Plan.timing, apart)
    wall_time_s: Seconds | None = Field(default=None, exclude_if=lambda value: value is None)
    num_variables: Count  # of the min-time model that gave the plan (its micro-batch's), and the memory points it
    num_constraints: Count  # kept (older plans: of the last micro-batch solved, often one where nothing fitted)
    micro_batch_sweep: list[SweepEntry]
    # every tensor-parallel degree searched (none: only degree 1 was)
    tp_degrees: list[TpDegreeEntry] = Field(default_factory=list, exclude_if=lambda value: not value)


class SearchTiming(_Strict):
    """How long the search took (wall-clock seconds): the one part identical searches do not reproduce, kept
    last in the file so all above it is the same bytes. Older plans: `solver.wall_time_s`, `tp_degrees[]`'s."""

    solver_s: Seconds  # the micro-batch sweep of the plan's tensor-parallel degree
    tp_degrees_s: list[Seconds] = Field(default_factory=list, exclude_if=lambda value: not value)  # per tp_degrees


class Baseline(_Strict):
    name: str  # "all-shard", "all-shard+ckpt", "all-replicate", ...
    fits: bool
    micro_batch_size: int = Field(ge=1)  # the best one that fits (the smallest tried when none fits)
    peak_mem_bytes: Count
    step_time_s: Seconds
    throughput_samples_s: Seconds


class PinRecord(_Strict):
    """A pin the plan was searched with (see autoplan.pins): its pattern and its decision as written."""

    pattern: str  # e.g. "transformer.h.0-11", "**.mlp", "<root>"
    decision: str  # an option's label ("shard+ckpt") or the fields it fixes ("checkpoint=full")


class Plan(_Strict):
    schema_version: Literal[1] = PLAN_SCHEMA_VERSION
    autoplan_version: str
    model: ModelRef
    cluster: ClusterSpec
    training: TrainingSpec
    units: list[UnitDecision]  # in execution order; apply wraps leaves first, the root last
    predicted: Prediction
    solver: SolverInfo
    baselines: list[Baseline]
    pins: list[PinRecord] = Field(default_factory=list)  # the user's pins it was searched with (none: all free)
    # the pipeline stages, their schedule and micro-batches (None: one stage, no pipeline; older plans)
    pipeline: PipelineSpec | None = Field(default=None, exclude_if=lambda value: value is None)
    # the experts split over groups of ranks (None: no expert parallelism; older plans)
    experts: ExpertParallelSpec | None = Field(default=None, exclude_if=lambda value: value is None)
    # wall-clock times, apart from what identical searches reproduce (None: an older plan, or none measured)
    timing: SearchTiming | None = Field(default=None, exclude_if=lambda value: value is None)

    @property
    def solver_wall_time_s(self) -> float | None:
        """The micro-batch sweep's wall-clock seconds, from `timing` (or an older plan's solver record)."""
        return self.timing.solver_s if self.timing is not None else self.solver.wall_time_s

    def tp_degree_wall_times_s(self) -> list[float | None]:
        """Each of `solver.tp_degrees`' sweeps in wall-clock seconds (None where the plan does not say)."""
        if self.timing is not None and len(self.timing.tp_degrees_s) == len(self.solver.tp_degrees):
            return list(self.timing.tp_degrees_s)
        return [entry.wall_time_s for entry in self.solver.tp_degrees]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The whole plan as plain data (what the JSON file holds)."""
        return self.model_dump(mode="json")

    def unit_table(self) -> list[dict[str, Any]]:
        """One flat row per unit, in execution order: its decision and its predicted bytes and seconds."""
        return [{"module": unit.module, "sharding": unit.sharding, "checkpoint": unit.checkpoint,
                 "offload": unit.offload, "reshard_after_forward": unit.reshard_after_forward, "params": unit.params,
                 **unit.predicted.model_dump()} for unit in self.units]

    def timeline_table(self) -> list[dict[str, Any]]:
        """One row per point of the predicted per-rank memory timeline, bytes by category."""
        return [{"point": p.point, "total_bytes": p.total_bytes, **p.breakdown.model_dump()}
                for p in self.predicted.timeline]

    def table(self) -> str:
        """The readable report: decisions, peak memory by category, step time, baselines."""
        return format_plan(self)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython / Jupyter display
        printer.text(self.table())

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        return load_plan(path)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan file; every failure is a PlanFileError that says what is wrong."""
    data = read_versioned_json(path, "plan file", PLAN_SCHEMA_VERSION, PlanFileError, "make the plan again")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        unknown = _unknown_option(exc, data)
        if unknown:
            raise PlanFileError(f"plan file {path}: {unknown}") from exc
        raise PlanFileError(f"plan file {path} is corrupt or incomplete:\n{exc}") from exc


def _unknown_option(exc: ValidationError, data: dict) -> str | None:
    """The first option name in the plan that no registered row has, said with where it is."""
    for error in exc.errors():
        if error["type"] != UNKNOWN_OPTION:
            continue
        loc, what = error["loc"], (error.get("ctx") or {})["what"]
        where = "in the training settings"
        if len(loc) >= 2 and loc[0] == "units" and isinstance(loc[1], int):
            unit = data["units"][loc[1]]
            module = unit.get("module") if isinstance(unit, dict) else None
            where = f"in unit {module or '<root>'}" if isinstance(module, str) else f"in unit #{loc[1]}"
        registry = {"sharding": SHARDING_KINDS, "checkpoint": CHECKPOINT_MODES, "dtype": PRECISIONS,
                    "optimizer": OPTIMIZERS}[what]
        return unknown_message(what, error["input"], registry, where)
    return None


def plan_json_schema() -> dict:
    return Plan.model_json_schema()


if __name__ == "__main__":
    print(json.dumps(plan_json_schema(), indent=2, sort_keys=True))
