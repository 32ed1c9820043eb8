"""Per-(unit, option) cost numbers for one micro-batch size: the data both the evaluator and the solver read.

`build_cost_table` prices every unit's options (cost_models.option_cost: FSDP2's bytes and seconds per
option) and cuts the ops into segments (cost_models.segments: each one's backward peak), the two things
the memory timeline and the step time are made of. A model's repeated blocks are priced once
(`unit_classes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

from cost_models.activations import Segment, loss_kept_bytes
from cost_models.choices import Option
from cost_models.mesh import Mesh
from cost_models.op_index import OpIndex, op_index
from cost_models.option_cost import OptionCost, pending_reduce_bytes, reduce_peak_bytes
from cost_models.options import Precision, Recompute
from cost_models.profile import DeviceProfile
from cost_models.records import OpRecord, Unit
from cost_models.segments import build_segments
from cost_models.training import MicroBatch, Training
from cost_models.unit_prices import UnitPrices, copied, op_content

__all__ = ["CostTable", "OptionCost", "TableInputs", "build_cost_table", "op_content", "unit_classes", "without_gloo_copy"]


@dataclass
class CostTable:
    units: list[Unit]
    options: list[list[Option]]
    costs: list[list[OptionCost]]  # [unit][option index]
    segments: list[Segment]
    micro_batch_size: int
    grad_accum_steps: int
    seq_len: int
    mesh: Mesh  # the data-parallel ranks the options shard over, and the tensor-parallel degree taken off them
    precision: Precision
    root: int  # index of the root unit
    overlap_compute: float
    overlap_comm: float
    overlap_enabled: bool = True  # False: a unit's collectives and compute add up (CPU + gloo)
    comm_sm_fraction: float = 0.0  # the SMs a running collective holds (see step.py)
    model_flops: float = 0.0  # a rank's FLOPs of one micro-batch's forward and backward, no recompute (MFU's)
    peak_flops: float = 0.0  # the profile's peak FLOP/s in the compute dtype
    host_limit_bytes: int | None = None  # host memory per rank for offloaded state (node's / GPUs per node)
    device_mem_bytes: int = 0  # the profile's device memory (what the allocator's cache can grow to); 0: unknown
    # the native caching allocator's margin per time point that the plan is fitted to (cost_models.allocator_margin.
    # PointMargin: the solver's rows and `evaluate`'s fit figure include it); None: the live bytes
    allocator: object | None = None

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step over the data-parallel ranks (a tensor-parallel group shares its rows)."""
        return self.micro_batch_size * self.grad_accum_steps * self.mesh.dp


@dataclass
class TableInputs:
    """What a cost table is built from at one micro-batch: the units, the ops as one rank runs them, and what
    each way of checkpointing keeps (see autoplan.solve.tables, which extrapolates them from two traces)."""

    units: list[Unit]
    ops: list[OpRecord]
    keep: dict[Recompute, list[int]]  # per unit: what a checkpointed unit keeps (activations.activation_keep_bytes)
    backward_keep: dict[Recompute, list[int]]  # of that, what is still held after its recomputation
    kept_saved: dict[Recompute, dict[str, int]]  # per op: the saved bytes a checkpointed unit keeps
    # per op, a number equal for ops alike in everything their costs read here (op_content and kept_saved), where
    # the source knows it for every micro-batch at once; None: unit_classes compares the ops themselves
    op_ids: list[int] | None = None


def without_gloo_copy(table: CostTable) -> CostTable:
    """`table` as a backend that reduces in place holds it (NCCL; torch's fake process group, which
    allocates nothing): every option's reduction peak and pending reduction without gloo's copy of the
    input, all else (the profile's optimizer scratch, times) as costed. Memory only: the times still
    include gloo's collectives."""
    reduce_bytes = table.precision.reduce_bytes
    costs = [[replace(c, reduce_peak_bytes=reduce_peak_bytes(c.reduce_buffer_bytes, c.unsharded_grad_bytes,
                                                               c.local_numel * reduce_bytes, 0),
                      pending_reduce_bytes=pending_reduce_bytes(c.reduce_buffer_bytes, 0))
              for c in unit_costs] for unit_costs in table.costs]
    return replace(table, costs=costs)


def build_cost_table(inputs: TableInputs, profile: DeviceProfile, mesh: Mesh, micro_batch: MicroBatch,
                     training: Training, offload: bool = False, host_limit_bytes: int | None = None) -> CostTable:
    """Every unit's options and what each costs at `micro_batch`, on `mesh`'s data-parallel ranks (its
    tensor-parallel degree is already in `inputs`: see autoplan.solve.tables). `offload`: offer host offload
    (the profile must have a host link); `host_limit_bytes`: the host memory per rank for offloaded state.

    Units alike in everything their costs read (a model's repeated blocks: unit_classes) are priced once."""
    if offload and profile.host_link is None:
        raise ValueError(f"profile {profile.name} has no host_link: offload cannot be priced on it")
    prices = UnitPrices.on(profile, mesh, training, offload)
    units, ops = inputs.units, inputs.ops
    index = op_index(tuple(map(_name, ops)), units, inputs.op_ids)
    classes = unit_classes(inputs, index)
    all_options: list[list[Option]] = []
    all_costs: list[list[OptionCost]] = []
    flops: dict[int, int] = {}  # per class, its ops' FLOPs (whole numbers: summed in any order, the same)
    for u in range(len(units)):
        alike = classes[u]
        if alike != u:  # the same unit again: its own copies (later steps adjust a unit's costs in place)
            all_options.append(list(all_options[alike]))
            all_costs.append([copied(cost) for cost in all_costs[alike]])
            continue
        unit_ops = [ops[p] for p in index.unit_positions[u]]
        options, costs = prices.of(inputs, u, unit_ops)
        all_options.append(options)
        all_costs.append(costs)
        flops[u] = sum(op.fwd_flops + op.bwd_flops for op in unit_ops)
    for (u, recompute), kept_bytes in loss_kept_bytes(ops, index, inputs.kept_saved).items():
        for option, cost in zip(all_options[u], all_costs[u]):
            if option.mode.checkpoints and option.recompute is recompute:
                cost.loss_kept_bytes = kept_bytes
    precision = training.precision
    cs, ms = prices.pricer.slowdowns
    return CostTable(
        units=units, options=all_options, costs=all_costs, segments=build_segments(inputs, index, classes),
        micro_batch_size=micro_batch.size, grad_accum_steps=micro_batch.grad_accum_steps, seq_len=training.seq_len,
        mesh=mesh, precision=precision, root=next(i for i, unit in enumerate(units) if unit.is_root),
        overlap_compute=cs, overlap_comm=ms, overlap_enabled=profile.overlap.enabled, host_limit_bytes=host_limit_bytes,
        comm_sm_fraction=profile.overlap.comm_sm_fraction,
        model_flops=float(_model_flops(flops, classes, ops)),
        peak_flops=prices.pricer.compute.peak_flops, device_mem_bytes=profile.mem_bytes,
    )


def unit_classes(inputs: TableInputs, index: OpIndex | None = None) -> list[int]:
    """Per unit, the first unit alike in everything its costs and its segments' backward peaks read: its ops'
    contents and relative positions, its parameters' shapes, whether it is the root or a leaf, what each way
    of checkpointing keeps of it and of each of its ops. A model's repeated blocks form one class. `index`:
    the inputs' (op_index), where the caller has it."""
    if index is None:
        index = op_index(tuple(map(_name, inputs.ops)), inputs.units, inputs.op_ids)
    modes = sorted(inputs.keep)
    shapes = index.op_shapes
    if shapes is None:  # no ids: the ops compared themselves
        op_key = [(op_content(op), tuple(inputs.kept_saved[m].get(op.name) for m in modes)) for op in inputs.ops]
        shapes = [tuple((p - where[0], op_key[p]) for p in where) for where in index.unit_positions]
    first: dict[tuple, int] = {}
    classes = []
    for u, unit in enumerate(inputs.units):
        signature = (
            unit.is_root, unit.is_leaf, tuple(p.shape for p in unit.params), shapes[u],
            tuple((inputs.keep[m][u], inputs.backward_keep[m][u]) for m in modes),
        )
        classes.append(first.setdefault(signature, u))
    return classes


_name = attrgetter("name")


def _model_flops(flops: dict[int, int], classes: list[int], ops: list[OpRecord]) -> int | float:
    """The ops' FLOPs, from each class's (`flops`) where they are whole numbers (any order sums them alike), else
    summed op by op as before."""
    if all(type(count) is int for count in flops.values()):
        return sum(flops[alike] for alike in classes)
    return sum(op.fwd_flops + op.bwd_flops for op in ops)
