"""Tensor (and sequence) parallelism inside a node: what one rank of a tensor-parallel group runs and holds.

Under the Megatron layout of degree t, a block's q/k/v and gate/up projections are split by output
features (column-wise) and its o/down projections by input features (row-wise): each rank computes
1/t of the heads and of the MLP's hidden width, and the row-wise outputs are partial sums that a
collective completes. With sequence parallelism the norms and the residual stream between the
blocks are split along the sequence too (1/t of their activations), and the collectives are an
all-gather before each column-wise group and a reduce-scatter after each row-wise projection instead
of one all-reduce. The embedding table and the output head can be split by vocabulary rows (the loss
then runs on vocabulary-parallel logits: torch's loss_parallel).

The search reuses the whole data-parallel machinery on this per-rank view: `tp_ops` and `tp_units`
turn the traced ops and the units into what one rank of a TP group runs and owns, and the cost table is
built for the data-parallel ranks (world / t, gpus_per_node / t per node); what tensor parallelism adds in
time (its collectives, the network links the data-parallel groups share) is in cost_models.tp_time.

The layout itself (which module plays which role) is found by autoplan from the model's modules and
handed here as plain data (`TpLayout`); this module imports nothing from autoplan and nothing from torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from cost_models.options import MeshShape
from cost_models.records import LOSS_NODE, OpRecord, ParamInfo, Unit

__all__ = [
    "TpLayout", "TpRole", "UnitLayout", "data_parallel_kinds", "expert_op", "op_role", "owners", "parallelized_modules",
    "regions_per_unit", "tp_keep_bytes", "tp_ops", "tp_units", "unit_layouts",
]


class TpRole(str, Enum):
    """What a module is under the layout; its ops (and parameters) are transformed by it."""

    COLWISE = "colwise"  # Linear split by output features (q, k, v, gate, up; the vocabulary-parallel head)
    ROWWISE = "rowwise"  # Linear split by input features (o, down): its output is a partial sum
    SHARDED = "sharded"  # ops between a column-wise and a row-wise projection (attention heads, the MLP's hidden)
    SEQUENCE = "sequence"  # norms and the residual stream: split along the sequence with sequence parallelism
    VOCAB_EMBED = "vocab_embed"  # embedding table split by vocabulary rows; its output is completed by a collective
    # a mixture of experts' stacked experts, each split by its hidden width (gate/up by rows, down by columns);
    # the dispatch and the combine run whole on every rank, the combine's output is a partial sum (`expert_op`)
    EXPERTS = "experts"


class UnitLayout(str, Enum):
    """How a unit runs under the layout, as the plan records it (None: data-parallel only, replicated
    across the tensor-parallel group)."""

    MEGATRON = "megatron"  # holds column/row-wise attention or MLP, norms replicated
    MEGATRON_SP = "megatron_sp"  # the same with sequence-parallel norms and residual stream
    VOCAB = "vocab"  # a vocabulary-parallel embedding or head (the loss on vocabulary-parallel logits)
    SEQUENCE = "sequence"  # only sequence-parallel norms (the final norm in the root)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TpLayout:
    """The layout of one model at one degree: module path -> role, and where the collectives are."""

    degree: int
    sequence_parallel: bool
    hidden: int  # the residual stream's width: TP collectives move [micro-batch, seq, hidden]
    roles: Mapping[str, TpRole]  # module path -> role; a module's ops take its role (or its nearest ancestor's)
    regions: tuple[str, ...]  # attention and MLP module paths: one collective pair each, forward and backward
    split_params: Mapping[str, int]  # parameter name -> the dimension split over the group
    embedding: str | None = None  # the vocabulary-parallel embedding's path
    head: str | None = None  # the vocabulary-parallel head's path (the loss runs loss-parallel)
    notes: tuple[str, ...] = field(default_factory=tuple)  # what stays data-parallel, and why
    # experts module path -> the hidden widths (whole) its column-wise projections write (gate/up, or the fused
    # gate_up and its halves): the ops on tensors of these widths hold 1/t of them
    expert_widths: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # parameter name -> the sections its split dimension concatenates (a fused q/k/v or gate/up projection):
    # each section is split over the group, so a rank holds its share of each (its rows reordered at apply)
    fused: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def role_of(self, module: str) -> TpRole | None:
        path = module
        while True:
            role = self.roles.get(path)
            if role is not None or not path:
                return role
            path = path.rpartition(".")[0]


_BYTE_FIELDS = ("out_bytes", "fwd_bytes", "bwd_bytes", "saved_bytes", "fwd_max_alloc_bytes", "fwd_transient_bytes",
                "bwd_in_bytes", "bwd_live_bytes")


def _with(op: OpRecord, **changes) -> OpRecord:
    """A copy of the op with `changes` (dataclasses.replace without re-running __init__: a 405B model's tables
    transform some 160,000 ops per mesh searched)."""
    new = OpRecord.__new__(OpRecord)
    new.__dict__.update(op.__dict__)
    new.__dict__.update(changes)
    return new


def _divided(op: OpRecord, t: int, fields: tuple[str, ...]) -> OpRecord:
    """The op with `fields` divided by t, its key marked as 1/t of the traced op's work: a timing measured for
    the traced (whole) op is not this op's, which the fits then price from its divided FLOPs and bytes."""
    return _with(op, variant=f"{op.variant}[tp 1/{t}]", **{name: -(-getattr(op, name) // t) for name in fields})


def _loss_parallel(op: OpRecord, t: int) -> OpRecord:
    """The loss on vocabulary-parallel logits (torch's loss_parallel): its tensors are the rank's vocabulary
    shard, 1/t of the traced loss's, and each pass holds one fp32 shard more than the fused loss would on
    them. Its forward (torch/distributed/tensor/parallel/loss.py, _log_softmax) holds the fp32 logits, their
    shifted copy and its exp at once, where the fused log_softmax holds its input and output; its backward
    (_nll_loss_and_log_softmax_backward) holds zeros_like(x), exp(x) and their sum, then the sum and its
    product with the incoming gradient, three fp32 shards where the fused backward holds two (nll_loss's
    gradient and log_softmax's). Measured with autoplan.memtrack seeing inside DTensor's ops on torch 2.13's
    fake group, [128, 512] bf16 logits at t = 2 (one fp32 shard 131,072 B): the forward peaks 3.01 shards
    over its bf16 input (the fused loss on the same local logits 2.00), the backward 3.03 over its start
    (2.00). On an H200 (torch 2.11) the same four fp32 shards were alive at llama3-8b's peak at 8192 tokens
    (benchmarks/results/gpu_truth_cuda_run3/, peak_blocks)."""
    local = _divided(op, t, _BYTE_FIELDS + ("fwd_flops", "bwd_flops"))
    shard = -(-op.fwd_max_alloc_bytes // t)  # one fp32 logits shard: the largest tensor the loss allocates
    return _with(local, fwd_transient_bytes=local.fwd_transient_bytes + shard,
                 bwd_live_bytes=local.bwd_live_bytes + shard)


def tp_op(op: OpRecord, layout: TpLayout, role: TpRole | None | str = "") -> OpRecord:
    """One op as a rank of the group runs it. Bytes and FLOPs divide by t where the tensors they count do:
    a column-wise projection keeps its (whole) input saved and writes 1/t of the output; a row-wise one reads
    1/t and writes a whole partial sum; the ops between them work on 1/t of the heads or hidden width;
    norms and residual adds on 1/t of the sequence with sequence parallelism, all of it without. `role`: the
    op's (`op_role`), where the caller knows it already."""
    t = layout.degree
    if t == 1:
        return op
    flops = ("fwd_flops", "bwd_flops")
    if op.name == LOSS_NODE:
        return _loss_parallel(op, t) if layout.head else op
    role = layout.role_of(op.module) if role == "" else role
    if role is TpRole.COLWISE:
        return _divided(op, t, tuple(f for f in _BYTE_FIELDS if f != "saved_bytes") + flops + ("param_grad_bytes",))
    if role is TpRole.ROWWISE:
        return _divided(op, t, tuple(f for f in _BYTE_FIELDS if f not in ("out_bytes", "fwd_max_alloc_bytes"))
                        + flops + ("param_grad_bytes",))
    if role is TpRole.SHARDED:
        return _divided(op, t, _BYTE_FIELDS + flops + ("param_grad_bytes",))
    if role is TpRole.SEQUENCE:
        return _divided(op, t, _BYTE_FIELDS + flops) if layout.sequence_parallel else op
    if role is TpRole.VOCAB_EMBED:
        return _divided(op, t, ("param_grad_bytes",))
    if role is TpRole.EXPERTS:
        return expert_op(op, layout)
    return op


def _expert_widths(layout: TpLayout, module: str) -> tuple[int, ...]:
    path = module
    while path not in layout.expert_widths and path:
        path = path.rpartition(".")[0]
    return layout.expert_widths.get(path, ())


def expert_op(op: OpRecord, layout: TpLayout) -> OpRecord:
    """An op of experts split by width (per expert, as torchtitan's TensorParallel for grouped experts without
    expert parallelism), told apart by its input shapes: a grouped matmul by a stacked weight writing one of
    the experts' widths is column-wise (its input, the dispatch buffer, whole and saved whole); one by a weight
    writing the model's width is row-wise (reads 1/t, writes a whole partial sum); the other ops on a stacked
    weight or on tensors of the experts' widths (the activation, the gate times up) hold 1/t; the router's
    scores, the dispatch gather and the combine run whole on every rank. Where an expert's width equals the
    model's, the ops between the projections are priced whole (an over-estimate)."""
    t, hidden = layout.degree, layout.hidden
    widths = {w for w in _expert_widths(layout, op.module) if w != hidden}
    stacked = [shape for shape in op.input_shapes if len(shape) == 3]
    flops = ("fwd_flops", "bwd_flops")
    if op.is_matmul and stacked and stacked[0][-1] in widths:
        return _divided(op, t, tuple(f for f in _BYTE_FIELDS if f != "saved_bytes") + flops + ("param_grad_bytes",))
    if op.is_matmul and stacked and stacked[0][-1] == hidden:
        return _divided(op, t, tuple(f for f in _BYTE_FIELDS if f not in ("out_bytes", "fwd_max_alloc_bytes"))
                        + flops + ("param_grad_bytes",))
    if stacked or any(shape and shape[-1] in widths for shape in op.input_shapes):
        return _divided(op, t, _BYTE_FIELDS + flops + ("param_grad_bytes",))
    return op


def op_role(op: OpRecord, layout: TpLayout, roles: dict[str, TpRole | None] | None = None) -> TpRole | str | None:
    """What decides how tp_op transforms the op: its module's role, or LOSS_NODE for the loss. `roles`: a cache
    of module path -> role."""
    if op.name == LOSS_NODE:
        return LOSS_NODE
    if roles is None:
        return layout.role_of(op.module)
    if op.module not in roles:
        roles[op.module] = layout.role_of(op.module)
    return roles[op.module]


def tp_ops(ops: list[OpRecord], layout: TpLayout, ids: list[int] | None = None) -> list[OpRecord]:
    """Each op as a rank of the group runs it. `ids`: per op, a number equal for ops alike in everything but name
    and module and of one role (`op_role`): each kind is transformed once and copied under the other ops' names
    (as records.extrapolate_ops makes them)."""
    roles: dict[str, TpRole | None] = {}
    if ids is None:
        return [tp_op(op, layout, op_role(op, layout, roles)) for op in ops]
    if len(ops) != len(ids):
        raise ValueError(f"tp_ops: {len(ops)} ops, {len(ids)} ids")
    result, made, new = [], {}, object.__new__
    for op, kind in zip(ops, ids):
        fields = made.get(kind)
        if fields is None:  # the kind's first op: transformed (False where tp_op leaves it as it is)
            record = tp_op(op, layout, op_role(op, layout, roles))
            made[kind] = fields = record.__dict__ if record is not op else False
        elif fields is False:
            record = op
        else:  # a copy of the transformed kind under this op's name
            record, copied = new(OpRecord), fields.copy()
            copied["name"], copied["module"] = op.name, op.module
            record.__dict__ = copied
        result.append(record)
    return result


def tp_units(units: list[Unit], layout: TpLayout) -> list[Unit]:
    """The units with each split parameter's local shape (what FSDP then shards over the data-parallel ranks)."""
    t = layout.degree
    if t == 1:
        return units
    out = []
    for unit in units:
        params = []
        for param in unit.params:
            dim = layout.split_params.get(param.name)
            if dim is None:
                params.append(param)
                continue
            if param.shape[dim] % t:
                raise ValueError(f"parameter {param.name} {list(param.shape)}: dimension {dim} does not divide by "
                                 f"the tensor-parallel degree {t}")
            shape = list(param.shape)
            shape[dim] //= t
            params.append(ParamInfo(param.name, tuple(shape)))
        out.append(replace(unit, params=params))
    return out


def owners(units: list[Unit]):
    """A function of a module path: the index of the innermost unit whose module holds it (its own path or
    its nearest ancestor's that is a unit's)."""
    index = {unit.path: i for i, unit in enumerate(units)}

    def owner(path: str) -> int | None:
        while path not in index:
            if not path:
                return None
            path = path.rpartition(".")[0]
        return index[path]

    return owner


def unit_layouts(units: list[Unit], layout: TpLayout) -> list[UnitLayout | None]:
    """Per unit, how it runs under the layout (what the plan records)."""
    tags: list[UnitLayout | None] = [None] * len(units)
    if layout.degree == 1:
        return tags
    owner = owners(units)
    for region in layout.regions:
        tags[owner(region)] = UnitLayout.MEGATRON_SP if layout.sequence_parallel else UnitLayout.MEGATRON
    for path in (layout.embedding, layout.head):
        if path is not None and tags[owner(path)] is None:
            tags[owner(path)] = UnitLayout.VOCAB
    if layout.sequence_parallel:
        for path, role in layout.roles.items():
            if role is TpRole.SEQUENCE and tags[owner(path)] is None:
                tags[owner(path)] = UnitLayout.SEQUENCE
    return tags


def parallelized_modules(layout: TpLayout) -> list[str]:
    """The modules a run parallelizes under the layout (autoplan.run.tp gives each a DTensor style): every
    column- and row-wise projection (the vocabulary-parallel head among them) and the vocabulary-parallel
    embedding; with sequence parallelism also each norm (SequenceParallel; a block's own path holds the
    SEQUENCE role for its residual adds and is not one) and each region's input (PrepareModuleInput)."""
    styled = (TpRole.COLWISE, TpRole.ROWWISE, TpRole.VOCAB_EMBED)
    modules = [path for path, role in layout.roles.items() if role in styled]
    if layout.sequence_parallel:
        blocks = {region.rpartition(".")[0] for region in layout.regions}
        modules += [path for path, role in layout.roles.items() if role is TpRole.SEQUENCE and path not in blocks]
        modules += list(layout.regions)
    return modules


def data_parallel_kinds(table):
    """A cost table with only the options that run beside tensor parallelism: kinds sharding over the whole
    data-parallel dimension (replicate and hybrid would need a three-dimensional mesh that apply does not
    build), without offload (not offered beside DTensor's parameters)."""
    keep = [[i for i, o in enumerate(opts) if o.kind.mesh == MeshShape.WORLD and not o.offload]
            for opts in table.options]
    return replace(table, options=[[opts[i] for i in k] for opts, k in zip(table.options, keep)],
                   costs=[[costs[i] for i in k] for costs, k in zip(table.costs, keep)])


def tp_keep_bytes(keep_all: int, keep_cheap: int, layout_of_unit: UnitLayout | None, layout: TpLayout,
                  regions: int = 0, activation_bytes: int = 0) -> tuple[int, int]:
    """What a checkpointed unit keeps per rank (full checkpointing, selective): its input, divided by t
    where sequence-parallel; selectively also its matmul and attention outputs, of split heads and hidden
    widths (divided by t) but for each region's row-wise projection (o, down), whose output is a whole
    partial sum (`activation_bytes`; of the kept outputs, up to one per region: after its backward's
    recomputation only the last region's stays), and the outputs of its `regions`' collectives (of
    `activation_bytes` each: the all-reduce's, or the all-gather's and the reduce-scatter's 1/t), which a
    selective checkpoint keeps. Measured at 16k tokens (TP 2, two selective llama blocks): counting the
    row-wise outputs 1/t under-predicted the forward by 8.4 MB a block."""
    t = layout.degree
    if t == 1 or layout_of_unit is None:
        return keep_all, keep_cheap
    kept_input = -(-keep_all // t) if layout.sequence_parallel else keep_all
    collectives = regions * (activation_bytes + (-(-activation_bytes // t) if layout.sequence_parallel else 0))
    outputs = max(0, keep_cheap - keep_all)
    partial_sums = min(outputs, regions * activation_bytes)
    return kept_input, kept_input + partial_sums + -(-(outputs - partial_sums) // t) + collectives


def regions_per_unit(units: list[Unit], layout: TpLayout) -> list[int]:
    """How many attention and MLP regions each unit owns."""
    counts = [0] * len(units)
    owner = owners(units)
    for region in layout.regions:
        counts[owner(region)] += 1
    return counts
