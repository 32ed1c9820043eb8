"""The one registry of options: sharding kinds, checkpoint modes, training precisions and optimizers, one row each.

Every other place that needs an option's name or one of its properties reads it from here: the cost
table (bytes and seconds per option), the solver's per-unit choices, the plan schema (which names a
plan file may hold), `apply` (the device mesh, FSDP2's `reshard_after_forward`, the mixed-precision
policy, the torch optimizer class) and the command line's choices. So adding an option is adding one
row: to `SHARDING_KINDS`, `CHECKPOINT_MODES`, `PRECISIONS` or `OPTIMIZERS` below, or at run time with `register(row)`
(`registered(row)` for a block, e.g. a test). A row says what an option *is* in declarative terms
(how many ranks share a parameter, which dtypes, how many state elements); the code that turns those
terms into numbers or torch calls never names an option.

The registries are module-level dicts that `register` changes in place, so a module that imported
them (`from cost_models.options import OPTIMIZERS`) sees rows registered later. This module imports
nothing from autoplan and nothing from torch: it is data, read by the cost models and by autoplan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

__all__ = [
    "CHECKPOINT_MODES", "CheckpointMode", "DEFAULT_CHECKPOINT", "checkpoint_of_bool", "DEFAULT_OPTIMIZER", "DEFAULT_PRECISION",
    "DEFAULT_SHARDING", "Dtype", "MESH_OF_GROUP", "MeshShape", "OPTIMIZERS", "OptimizerKind", "PRECISIONS",
    "Precision", "Recompute", "Row", "SAVED_BY_SELECTIVE_ATEN", "SAVED_BY_SELECTIVE_KINDS", "SHARDING_KINDS",
    "ShardGroup", "ShardingKind", "UnknownOptionError", "find", "register", "registered", "registry_of",
    "unknown_message",
]


class _Category(str, Enum):
    """A value from a fixed set that is also the plain string it names (JSON, dict keys, f-strings)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)


class ShardGroup(_Category):
    """How many ranks one parameter is split over. The ranks of the world that do not share a
    parameter's shards hold copies of it (a replicate group) and all-reduce its gradients."""

    WORLD = "world"  # over every rank (ZeRO-3 style)
    NODE = "node"  # over the GPUs of one node, replicated across nodes (HSDP)
    ONE = "one"  # not split: a full copy on every rank (DDP style)


class MeshShape(_Category):
    """The device mesh FSDP2's `fully_shard` gets, as apply builds it over the ranks that run the plan."""

    WORLD = "world"  # 1-D over all ranks: FSDP2 shards over it
    REPLICATE = "replicate"  # (world_size, 1), named ("replicate", "shard"): full copies
    HYBRID = "hybrid"  # (nodes, gpus_per_node), named ("replicate", "shard"): shards within a node


# The mesh is a function of the shard group, not a field of its own: the cost model's group and the
# mesh apply builds can then never disagree.
MESH_OF_GROUP = {ShardGroup.WORLD: MeshShape.WORLD, ShardGroup.ONE: MeshShape.REPLICATE,
                 ShardGroup.NODE: MeshShape.HYBRID}


class Dtype(_Category):
    """An element type, by its short name (the names device profiles and traces use)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def bytes(self) -> int:
        """Bytes per element."""
        return 4 if self is Dtype.FP32 else 2

    @property
    def torch_name(self) -> str:
        """The attribute of `torch` that is this dtype (`getattr(torch, dtype.torch_name)`)."""
        return {Dtype.FP32: "float32", Dtype.BF16: "bfloat16", Dtype.FP16: "float16"}[self]


@dataclass(frozen=True)
class ShardingKind:
    """One way to place a unit's parameters, gradients and optimizer states on the ranks."""

    name: str
    """What plans, the command line (`--strategy`) and reports call it."""
    shard_group: ShardGroup
    """How many ranks share one parameter's shards; the rest of the world holds replicas."""
    reshard_after_forward: bool
    """FSDP2's flag: False keeps the gathered parameters from the forward to the backward (ZeRO-2-like:
    no second all-gather, more memory held). Never offered for the root (see `options_for`)."""
    multi_node_only: bool = False
    """Offered only on clusters of two or more nodes (on one node it is the same as another kind)."""
    description: str = ""
    """One line for help texts and reports."""

    def __post_init__(self):
        object.__setattr__(self, "shard_group", ShardGroup(self.shard_group))

    @property
    def mesh(self) -> MeshShape:
        """The device mesh apply hands `fully_shard` for this kind (see MESH_OF_GROUP)."""
        return MESH_OF_GROUP[self.shard_group]


class Recompute(_Category):
    """What a checkpointed unit recomputes in its backward (and so what it keeps from its forward)."""

    NOTHING = "nothing"  # no checkpointing: every activation its ops save is kept
    CHEAP = "cheap"  # keeps its inputs and the outputs of matmuls, attention and collectives; re-runs the rest
    ALTERNATE = "alternate"  # as CHEAP but keeps only every other matmul's output (the 1st, 3rd, ...)
    ALL = "all"  # keeps its inputs only; re-runs its whole forward

    @property
    def keeps_outputs(self) -> bool:
        """An op-level (selective) policy: some of the unit's op outputs are kept from its forward."""
        return self in (Recompute.CHEAP, Recompute.ALTERNATE)


# The ops a selective checkpoint saves, by what the trace knows of an op (OpRecord.is_matmul, its kind) and,
# for apply, by the aten ops that do that work: torchtitan's list for selective activation checkpointing.
SAVED_BY_SELECTIVE_KINDS = ("scaled_dot_product_attention",)
SAVED_BY_SELECTIVE_ATEN = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)


@dataclass(frozen=True)
class CheckpointMode:
    """How a unit trades recomputation for activation memory."""

    name: str
    """What plans, `--checkpoint` and reports call it."""
    recompute: Recompute
    """What the unit's backward re-runs (see Recompute)."""
    label: str = ""
    """The suffix reports and pins write after the sharding kind ("+ckpt"); "" for none."""
    description: str = ""
    """One line for help texts and reports."""
    searched: bool = True
    """Offered to the solver's search. False for a mode that exists to price and run a configuration as
    others run it (torchtitan's policy): `--checkpoint`, pins and plan files still take it, and the search
    keeps its problem (a block's options) as it was."""

    def __post_init__(self):
        object.__setattr__(self, "recompute", Recompute(self.recompute))

    @property
    def checkpoints(self) -> bool:
        """True when the unit is wrapped in activation checkpointing at all."""
        return self.recompute is not Recompute.NOTHING


@dataclass(frozen=True)
class Precision:
    """A training precision: the dtype of each tensor class, and from it the bytes per element."""

    name: str
    """What plans and `--dtype` call it."""
    master_dtype: Dtype
    """Sharded parameters and reduced gradients: what the optimizer updates. Apply casts a model to it
    where it is not fp32 (the dtype models are built in)."""
    compute_dtype: Dtype
    """Activations and gathered parameters (FSDP2 MixedPrecisionPolicy.param_dtype where it differs from
    the master dtype); also the dtype the tracer runs the model in and a profile's FLOP/s are read for."""
    reduce_dtype: Dtype
    """Gradient reduction (FSDP2 MixedPrecisionPolicy.reduce_dtype where it differs from the compute dtype)."""
    state_dtype: Dtype | None = None
    """Each optimizer state element; None: the master dtype (torch keeps states in the parameter's dtype)."""
    description: str = ""
    """One line for help texts."""

    def __post_init__(self):
        for name in ("master_dtype", "compute_dtype", "reduce_dtype"):
            object.__setattr__(self, name, Dtype(getattr(self, name)))
        object.__setattr__(self, "state_dtype", Dtype(self.state_dtype or self.master_dtype))

    @property
    def master_bytes(self) -> int:
        return self.master_dtype.bytes

    @property
    def compute_bytes(self) -> int:
        return self.compute_dtype.bytes

    @property
    def reduce_bytes(self) -> int:
        return self.reduce_dtype.bytes

    @property
    def state_bytes(self) -> int:
        return self.state_dtype.bytes


@dataclass(frozen=True)
class OptimizerKind:
    """A torch optimizer, as the cost model counts it and as apply builds it."""

    name: str
    """What plans and `--optimizer` call it."""
    torch_class: str
    """The class in `torch.optim` (apply builds `getattr(torch.optim, torch_class)(params, lr=..., **kwargs)`)."""
    states: int
    """State elements kept per parameter element (AdamW: 2, the two moments; plain SGD: 0)."""
    touches: int
    """Elements one step reads and writes per parameter element, in master-dtype words: the optimizer's
    time is these bytes over the profile's optimizer rate (AdamW reads p, g, m, v and writes p, m, v: 7)."""
    step_temporaries: int = 0
    """State-sized temporaries its step allocates over a parameter group on CUDA, where torch runs the
    foreach implementation (AdamW: 1, the square root of the second moment). On the CPU only the largest
    parameter's is alive at once (see cost_models.table.per_tensor_optimizer_scratch_bytes)."""
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    """Constructor arguments beyond the parameters and the learning rate (none: torch's defaults)."""
    description: str = ""
    """One line for help texts."""

    def __post_init__(self):
        object.__setattr__(self, "kwargs", dict(self.kwargs))  # a copy: the caller's dict may change


Row = Union[ShardingKind, CheckpointMode, Precision, OptimizerKind]

SHARDING_KINDS: dict[str, ShardingKind] = {
    kind.name: kind
    for kind in (
        ShardingKind("shard", ShardGroup.WORLD, True,
                     description="every unit sharded, resharded after its forward (ZeRO-3, FSDP FULL_SHARD)"),
        ShardingKind("shard_keep", ShardGroup.WORLD, False,
                     description="every unit sharded, parameters kept gathered from forward to backward (ZeRO-2-like)"),
        ShardingKind("replicate", ShardGroup.ONE, True,
                     description="every unit replicated, gradients all-reduced (DDP-like)"),
        ShardingKind("hybrid", ShardGroup.NODE, True, multi_node_only=True,
                     description="sharded within a node, replicated across nodes (HSDP)"),
    )
}

CHECKPOINT_MODES: dict[str, CheckpointMode] = {
    mode.name: mode
    for mode in (
        CheckpointMode("none", Recompute.NOTHING, description="no activation checkpointing"),
        CheckpointMode("selective", Recompute.CHEAP, "+sel",
                       description="selective checkpointing: keeps matmul, attention and collective outputs, "
                                   "recomputes the rest (torch.utils.checkpoint's selective policy)"),
        CheckpointMode("full", Recompute.ALL, "+ckpt",
                       description="full activation checkpointing: keeps the unit's inputs, recomputes its forward"),
        CheckpointMode("selective_op", Recompute.ALTERNATE, "+selop", searched=False,
                       description="torchtitan's selective op policy: keeps attention and collective outputs and "
                                   "every other matmul's output (the 1st, 3rd, ... of the unit's forward), recomputes "
                                   "the rest (torch.utils.checkpoint's selective policy)"),
    )
}

PRECISIONS: dict[str, Precision] = {
    precision.name: precision
    for precision in (
        Precision("bf16-mixed", master_dtype=Dtype.FP32, compute_dtype=Dtype.BF16, reduce_dtype=Dtype.FP32,
                  description="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); fp32 master "
                              "weights and optimizer states"),
        Precision("bf16-reduce", master_dtype=Dtype.FP32, compute_dtype=Dtype.BF16, reduce_dtype=Dtype.BF16,
                  description="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16); fp32 master "
                              "weights and optimizer states, gradients reduced in bf16 (FSDP1's bf16 policies, "
                              "Composer's PURE)"),
        Precision("bf16", master_dtype=Dtype.BF16, compute_dtype=Dtype.BF16, reduce_dtype=Dtype.BF16,
                  description="the model cast to bf16: weights, gradients and optimizer states"),
        Precision("fp32", master_dtype=Dtype.FP32, compute_dtype=Dtype.FP32, reduce_dtype=Dtype.FP32,
                  description="everything in fp32"),
    )
}

OPTIMIZERS: dict[str, OptimizerKind] = {
    optimizer.name: optimizer
    for optimizer in (
        OptimizerKind("adamw", "AdamW", states=2, touches=7, step_temporaries=1,
                      description="torch.optim.AdamW: two moments per element"),
        OptimizerKind("adam", "Adam", states=2, touches=7, step_temporaries=1,
                      description="torch.optim.Adam: two moments per element"),
        OptimizerKind("sgd", "SGD", states=0, touches=3,
                      description="torch.optim.SGD without momentum: no state"),
    )
}

DEFAULT_SHARDING = "shard"  # offered to every unit on every cluster: the fallback of uniform plans
DEFAULT_CHECKPOINT = "none"


def checkpoint_of_bool(value: Any) -> Any:
    """The checkpoint mode a bool stands for, where the API (`checkpoint=True`) and plans written before
    checkpoint modes (`"checkpoint": true`) give one: True is full checkpointing, False none; anything else
    is returned as it is."""
    return {True: "full", False: DEFAULT_CHECKPOINT}[value] if isinstance(value, bool) else value
DEFAULT_PRECISION = "bf16-mixed"
DEFAULT_OPTIMIZER = "adamw"

_REGISTRIES: dict[type, tuple[str, dict]] = {
    ShardingKind: ("sharding", SHARDING_KINDS),
    CheckpointMode: ("checkpoint", CHECKPOINT_MODES),
    Precision: ("dtype", PRECISIONS),  # what plans and the command line call a precision
    OptimizerKind: ("optimizer", OPTIMIZERS),
}


class UnknownOptionError(ValueError):
    """A name that no registered row has (see `unknown_message`)."""


def registry_of(row: Row) -> tuple[str, dict]:
    """(what the rows are called, the registry dict) for a row's type."""
    try:
        return _REGISTRIES[type(row)]
    except KeyError:
        raise TypeError(f"not an option row: {row!r} (expected ShardingKind, CheckpointMode, Precision or OptimizerKind)") from None


def unknown_message(what: str, name: object, registry: Mapping[str, Row], where: str = "") -> str:
    """The one wording for a name this autoplan does not know, e.g. in a plan file from a newer one."""
    where = f" {where}" if where else ""
    return (f"unknown {what} {name!r}{where}; this autoplan knows: {', '.join(registry)}; "
            "was the plan made by a newer autoplan?")


def find(registry: Mapping[str, Row], name: str) -> Row:
    """The row called `name`; UnknownOptionError (saying which names there are) when none is."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        what = next((w for w, r in _REGISTRIES.values() if r is registry), "option")
        raise UnknownOptionError(unknown_message(what, name, registry)) from None


def register(row: Row) -> Row:
    """Add a row to its registry (by its type); a name already taken there is refused."""
    what, registry = registry_of(row)
    if not isinstance(row.name, str) or not row.name or any(c.isspace() or c == "+" for c in row.name):
        raise ValueError(f"{what} name {row.name!r}: a non-empty name without spaces or '+' is needed")
    if row.name in registry:
        raise ValueError(f"a {what} named {row.name!r} is registered already ({registry[row.name]!r}); "
                         "pick another name")
    registry[row.name] = row
    return row


@contextmanager
def registered(row: Row) -> Iterator[Row]:
    """`register(row)` for the block, removed again on leaving it (for tests and experiments)."""
    _, registry = registry_of(row)
    register(row)
    try:
        yield row
    finally:
        if registry.get(row.name) is row:
            del registry[row.name]
