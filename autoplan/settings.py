"""One settings record per request: what `search` and `estimate` are asked, validated in one place.

The Python API and the command line share these records, so they share every default and every check:
`autoplan.search(model, mem, **fields)` builds a `SearchSettings`, and `autoplan search`'s flags are generated from
the same fields (`autoplan.cli.flags`), with the docstring under each field as the flag's help. A field's name is
the API parameter; the CLI flag is `--` + the name with dashes (or the `Flag` named in its annotation). Errors name
the parameter in backticks (`seq_len`), and the CLI shows the flag there instead (`--seq-len`).

The options a field can take (precisions, optimizers, sharding kinds) come from the one registry,
`cost_models.options`, when the record is validated, so an option registered there is accepted here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from autoplan.errors import UsageError
from autoplan.settings_flags import (FIT_TO, GRANULARITIES, POSITIVE_SETTINGS, Flag, check_choice, choices_of,
                                     document_fields)
from autoplan.sizes import check_mem_limit, parse_mem_bytes
from cost_models.allocator_conf import modelled_options
from cost_models.attention import KERNEL_ALIASES
from cost_models.mesh import DEFAULT_GPUS_PER_NODE, Mesh, MeshError
from cost_models.options import DEFAULT_OPTIMIZER, DEFAULT_PRECISION, checkpoint_of_bool

__all__ = [
    "DEFAULT_HEADROOM", "DEFAULT_MODEL", "DEFAULT_PROFILE", "DEFAULT_TIME_LIMIT_S", "FIT_TO", "GRANULARITIES",
    "MAX_GPUS", "MAX_GPUS_PER_NODE", "MAX_HEADROOM", "EstimateSettings", "Flag", "PlanningSettings",
    "SearchSettings", "check_choice", "check_mem_limit", "choices_of", "mesh_of", "settings_error"]

DEFAULT_MODEL = "gpt2-1.5b"
DEFAULT_PROFILE = "a100-sxm4-80gb"
# plans are made to this fraction below the limit: predicted peaks land within ~1% of measured ones in a
# typical step (see benchmarks/RESULTS.md), and now and then a buffer freed late by another thread
# (gloo's) lifts a step's peak by up to ~2% more
DEFAULT_HEADROOM = 0.02
MAX_HEADROOM = 0.5
DEFAULT_TIME_LIMIT_S = 10.0
# the largest cluster planned: more GPUs in a node is a missing `nodes` (nodes hold 8 to 16; NVLink domains 72)
MAX_GPUS_PER_NODE = 128
MAX_GPUS = 2 ** 20


def mesh_of(gpus: int | None, nodes: int | None, gpus_per_node: int | None) -> Mesh:
    """The mesh of a request's cluster (cost_models.mesh.Mesh.of); UsageError where the counts disagree."""
    try:
        return Mesh.of(gpus, nodes, gpus_per_node)
    except MeshError as exc:
        raise UsageError(str(exc)) from None


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, validate_default=False,
                              defer_build=True)  # built when first validated: a search builds SearchSettings' alone

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        document_fields(cls)  # each field's help is the docstring under it (before the schema is built)

    @classmethod
    def create(cls, base: _Settings | None = None, **fields: Any):
        """The record from keyword fields (None means "not given": the default, or `base`'s value);
        bad input raises UsageError naming the parameter."""
        given = {name: value for name, value in fields.items() if value is not None}
        data = {name: getattr(base, name) for name in base.model_fields_set} if base is not None else {}
        data.update(given)
        try:
            return cls(**data)
        except ValidationError as exc:
            raise settings_error(cls, exc) from None

    def replace(self, **fields: Any):
        """A copy with `fields` changed (validated again)."""
        return type(self).create(self, **fields)

    @property
    def cluster_is_default(self) -> bool:
        """No cluster was asked for: the plan is for the default one (one node of 8 A100s)."""
        return all(getattr(self, name) is None for name in ("gpus", "nodes", "gpus_per_node", "profile"))

    @field_validator("mem", "host_mem", mode="before", check_fields=False)
    @classmethod
    def _mem_bytes(cls, value):
        return value if value is None else parse_mem_bytes(value)

    @field_validator("checkpoint", mode="before", check_fields=False)
    @classmethod
    def _checkpoint_name(cls, value):
        """`checkpoint=True` (and a bare `--checkpoint`) is full checkpointing; False is none."""
        return checkpoint_of_bool(value)

    @model_validator(mode="before")
    @classmethod
    def _spelled(cls, data):  # `inputs`: example inputs read by name; Hugging Face's names for the kernels
        if isinstance(data, dict) and data.get("inputs") is not None:
            if data.get("example_inputs") not in (None, data["inputs"]):
                raise UsageError("give `inputs` (a spec) or `example_inputs` (tensors), not both")
            data = {**data, "example_inputs": data["inputs"]}
        if isinstance(data, dict) and data.get("attention") in KERNEL_ALIASES:
            data = {**data, "attention": KERNEL_ALIASES[data["attention"]]}
        return data

    @model_validator(mode="after")
    def _check(self):
        for name in POSITIVE_SETTINGS:
            value = getattr(self, name, None)
            if value is not None and value < 1:
                raise UsageError(f"`{name}` must be at least 1, got {value}")
        for name in ("dtype", "optimizer", "granularity", "strategy", "checkpoint", "sequence_parallel", "fit_to",
                     "attention", "schedule"):
            value = getattr(self, name, None)
            if value is not None:
                check_choice(name, value, choices_of(name))
        if any(getattr(self, name, None) is not None for name in ("gpus", "nodes", "gpus_per_node")):
            m = mesh_of(self.gpus, self.nodes, self.gpus_per_node)  # the counts agree (checked in the mesh)
            self._check_cluster_size(m.nodes, m.gpus_per_node, None if self.nodes or self.gpus_per_node else self.gpus)
        try:
            modelled_options(self.allocator_conf or "")
        except ValueError as exc:
            raise UsageError(f"`allocator_conf` {self.allocator_conf!r}: {exc}") from None
        return self

    @staticmethod
    def _check_cluster_size(nodes: int, per_node: int, gpus_alone: int | None) -> None:
        """UsageError for more than MAX_GPUS GPUs, or a node of more than MAX_GPUS_PER_NODE (`gpus` given alone)."""
        if nodes * per_node > MAX_GPUS:
            raise UsageError(f"a cluster of {nodes * per_node:,} GPUs is more than the {MAX_GPUS:,} autoplan plans for")
        if per_node > MAX_GPUS_PER_NODE:
            even = gpus_alone and not gpus_alone % DEFAULT_GPUS_PER_NODE
            hint = f"; give the node count too, e.g. `nodes` {gpus_alone // DEFAULT_GPUS_PER_NODE}" if even else ""
            raise UsageError(f"{per_node:,} GPUs on one node is more than a node holds (at most {MAX_GPUS_PER_NODE}): "
                             f"`gpus` is the whole cluster, spread over `nodes`{hint}")


def settings_error(cls: type[BaseModel], exc: ValidationError) -> UsageError:
    """A pydantic error as a UsageError that names the parameter and what it takes."""
    first = exc.errors()[0]
    name = ".".join(str(part) for part in first["loc"]) or "settings"
    if first["type"] == "extra_forbidden":
        known = ", ".join(n for n in cls.model_fields)
        return UsageError(f"unknown setting `{name}`; the settings are: {known}")
    return UsageError(f"`{name}`: {first['msg'].lower()}, got {first.get('input')!r}")


class PlanningSettings(_Settings):
    """What a search and an estimate are both asked: the model, the cluster and the training setup."""

    model: Annotated[Any, Flag()] = None
    """zoo name (see `autoplan models`), hf:path/to/config.json (a Hugging Face config, nothing downloaded) or
    package.module:factory; in Python also an nn.Module or a TracedModel (default gpt2-1.5b; for an estimate of a
    plan, the plan's model)"""

    gpus: int | None = None
    """total GPUs, the world size (default 8: one node of 8)"""
    nodes: int | None = None
    """number of nodes (default 1)"""
    gpus_per_node: int | None = None
    """GPUs per node (default: gpus / nodes, else 8)"""
    profile: str | None = None
    """device profile name or path (see `autoplan profiles`; default a100-sxm4-80gb)"""
    seq_len: int | None = None
    """sequence length (default: the model's context)"""
    batch_size: int | None = None
    """micro-batch per GPU (default: a search sweeps it, an estimate takes 1 or the plan's)"""
    global_batch: int | None = None
    """samples per optimizer step over all GPUs (gradient accumulation fills the gap)"""

    dtype: Annotated[str | None, Flag(kind="choice")] = None
    """training precision (default bf16-mixed, or the plan's)"""

    optimizer: Annotated[str | None, Flag(kind="choice")] = None
    """optimizer (default adamw, or the plan's)"""

    granularity: Annotated[str | None, Flag(kind="choice")] = None
    """unit size: one per block (default), attention/MLP apart (fine), every module (leaf), the root alone (root)"""

    wrap_policy: Annotated[Any, Flag()] = None
    """an FSDP auto-wrap policy whose modules (and the root) are the units: size:N (size_based_auto_wrap_policy's
    min_num_params) or class:NAME[,NAME] (transformer_auto_wrap_policy's layer classes)"""

    host_mem: Annotated[int | None, Flag(kind="mem")] = None
    """host memory per node that offloaded parameters, gradients and optimizer states may use (default: the
    profile's figure; for a CPU profile this machine's memory)"""

    allocator_conf: str | None = None
    """the PYTORCH_CUDA_ALLOC_CONF a CUDA run uses, which decides what torch's caching allocator needs beyond the
    live bytes (default: the environment's, else expandable_segments:True, which `autoplan apply` sets)"""

    attention: Annotated[str | None, Flag(kind="choice")] = None
    """attention kernel: flash, efficient (CUDA's memory-efficient), math (S x S scores), or as Hugging Face
    names them (default: torch's pick for each call on the profile's device)"""

    capacity_factor: float | None = None
    """expert (mixture-of-experts) matmuls priced for this many times their routed tokens (default 1)"""

    allow_unpriced: bool = False
    """plan a model whose ops without a FLOP formula are more than 1% of its FLOPs (they are listed, not timed)"""

    inputs: Annotated[str | None, Flag()] = None
    """forward inputs other than token ids: `name=dtype[dims] ...` (batch, seq named) or a JSON file of them"""

    tp: int | None = None
    """tensor-parallel degree inside a node (a divisor of `gpus_per_node`, at most 8; 1: FSDP alone); default: a
    search tries 1, 2, 4, 8 on 8-GPU nodes where the model's blocks take the Megatron layout, an estimate 1"""

    sequence_parallel: Annotated[str | None, Flag(kind="choice")] = None
    """with tensor parallelism: norms and residual stream split along the sequence (on) or not (off); default: a
    search tries both, an estimate off"""

    ep: int | None = None
    """expert-parallel degree of a mixture-of-experts model (divides its expert count and the data-parallel ranks);
    default: a search tries each such degree, an estimate 1"""
    cp: int | None = None
    """context-parallel degree (ring attention over `cp` ranks a sequence); default: searched from 16k tokens up"""
    pp: int | None = None
    """pipeline degree, stages of whole nodes or parts of each (1: none; default: searched where one may pay)"""
    schedule: Annotated[str | None, Flag(kind="choice")] = None
    """pipeline schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv); default: the fastest torch runs"""

    example_inputs: Annotated[Any, Flag(api_only=True)] = None
    """inputs of a model whose forward does not take token ids [batch, seq] (a tensor, a tuple or a dict;
    batch in dim 0, sequence in dim 1; only shapes and dtypes matter)"""

    pins: Annotated[Any, Flag()] = None
    """pins file (YAML or JSON: `pins:` mapping module-path patterns to decisions, e.g. `transformer.h.*:
    shard+ckpt`) fixing those units; the solver completes the rest (in Python also a mapping)"""

    pin: Annotated[tuple[str, ...] | None, Flag()] = None
    """a pin PATTERN=DECISION, repeatable: `*` one path component, `**` any depth, 0-11 a range, <root> the
    root; the decision an option's label (shard+ckpt) or fields (checkpoint=full)"""

    @field_validator("pins", "wrap_policy", mode="before")
    @classmethod
    def _pins_file(cls, value, info):
        from autoplan.pins import PinSet
        from autoplan.pins.wrap import WrapPolicy

        return None if value is None else PinSet.of(value) if info.field_name == "pins" else WrapPolicy.of(value)

    @field_validator("pin", mode="before")
    @classmethod
    def _pin_texts(cls, value):
        from autoplan.pins import parse_pin

        if value is None:
            return None
        texts = (value,) if isinstance(value, str) else tuple(value)
        for text in texts:
            parse_pin(text)  # refused here, before any tracing
        return texts

    @property
    def pin_set(self):
        """The pins file's pins, then `pin`'s (an autoplan.pins.PinSet; None when there are none)."""
        from autoplan.pins import PinSet, parse_pin

        pins = (self.pins or PinSet()) + PinSet(parse_pin(text) for text in self.pin or ())
        return pins if len(pins) else None

    @property
    def model_or_default(self) -> Any:
        return DEFAULT_MODEL if self.model is None else self.model

    @property
    def dtype_or_default(self) -> str:
        return self.dtype or DEFAULT_PRECISION

    @property
    def optimizer_or_default(self) -> str:
        return self.optimizer or DEFAULT_OPTIMIZER

    @property
    def granularity_or_default(self) -> str:  # a wrap policy's units are the root and the modules it wraps
        return self.granularity or ("root" if self.wrap_policy or getattr(self.pins, "wrap", None) else "block")


class SearchSettings(PlanningSettings):
    """`autoplan.search` / `autoplan search`: the fastest plan whose predicted peak fits `mem`."""

    mem: Annotated[int | None, Flag(kind="mem")] = None
    """per-GPU memory limit in bytes, or a size such as 8GB, 8GiB, 8000MB, 8e9 (default: the profile's
    device memory)"""

    headroom: float = DEFAULT_HEADROOM
    """fraction of `mem` kept free against prediction error and run-to-run variation (default 0.02: plans fit
    98% of `mem`)"""

    time_limit_s: Annotated[float, Flag(name="--time-limit")] = DEFAULT_TIME_LIMIT_S
    """solver seconds per micro-batch size, in CP-SAT's deterministic time (the plan does not depend on the load)"""

    strategy: Annotated[str | None, Flag(kind="choice")] = None
    """no solver: every unit takes this sharding (a uniform plan to run or compare)"""

    checkpoint: Annotated[str | None, Flag(kind="choice", bare="full")] = None
    """with `strategy`: this checkpoint mode on every unit but the root (none, selective: keep matmul and
    attention outputs, selective_op: torchtitan's policy, every other matmul's output kept, full: keep inputs
    only; given without a mode: full)"""

    offload: bool = False
    """with `strategy`: parameters, gradients and optimizer states of every unit in host memory (FSDP2
    CPUOffloadPolicy; the profile must price the host link)"""

    allow_over_device_mem: bool = False
    """accept a `mem` above the profile's device memory (a plan that could not run on that device; the report
    says so)"""

    fit_to: Annotated[str, Flag(kind="choice")] = "needed"
    """on a CUDA profile, what the plan fits in `mem`: what torch's caching allocator needs to run the step
    (needed: live bytes plus its rounding, per-stream pages and fragmentation), or the live bytes alone
    (allocated: the fit of autoplan 0.1 plans, which can run out on a GPU)"""

    @model_validator(mode="after")
    def _check_search(self):
        if not 0 <= self.headroom < MAX_HEADROOM:
            raise UsageError(f"`headroom` must be a fraction of the limit in [0, {MAX_HEADROOM}), got "
                             f"{self.headroom:g} (e.g. 0.02 plans to 98% of `mem`)")
        if not self.time_limit_s > 0:
            raise UsageError(f"`time_limit_s` must be positive, got {self.time_limit_s}")
        if self.checkpoint is not None and self.strategy is None:
            raise UsageError("`checkpoint` goes with `strategy`; without it the solver decides checkpointing per unit")
        if self.offload and self.strategy is None:
            raise UsageError("`offload` goes with `strategy`; without it the solver decides offload per unit")
        return self


class EstimateSettings(PlanningSettings):
    """`autoplan.estimate` / `autoplan estimate`: peak memory and step time of a fixed strategy or a plan."""

    strategy: Annotated[str | None, Flag(kind="choice")] = None
    """the option every unit takes (default shard)"""

    checkpoint: Annotated[str | None, Flag(kind="choice", bare="full")] = None
    """checkpoint mode on every unit but the root (none, selective: keep matmul and attention outputs, selective_op:
    torchtitan's policy, every other matmul's output kept, full: keep inputs only; given without a mode: full)"""

    offload: bool = False
    """parameters, gradients and optimizer states of every unit in host memory (FSDP2 CPUOffloadPolicy)"""

    plan: Annotated[Any, Flag()] = None
    """a plan file from `autoplan search` (in Python also a Plan): estimate its decisions, model and settings"""

    mem: Annotated[int | None, Flag(kind="mem")] = None
    """a per-GPU limit to compare with (default: the profile's device memory)"""

    allow_over_device_mem: bool = False
    """accept a `mem` (or a plan's limit) above the profile's device memory"""

    @model_validator(mode="after")
    def _check_estimate(self):
        if self.plan is not None and (self.strategy is not None or self.checkpoint is not None or self.offload):
            raise UsageError("give either `strategy` (with or without `checkpoint` and `offload`) or `plan`, not both: "
                             "a plan says per unit how it shards, where it checkpoints and what it offloads")
        if self.plan is not None and (self.tp is not None or self.sequence_parallel is not None or self.ep or self.cp):
            raise UsageError("`tp`, `ep`, `cp`, `sequence_parallel` go with a `strategy`; a plan keeps its own mesh")
        if self.sequence_parallel == "on" and (self.tp or 1) == 1:
            raise UsageError("`sequence_parallel` on needs `tp` above 1")
        return self
