"""Per-(unit, option) cost numbers for one micro-batch size: the data both the evaluator and the solver read.

Memory follows FSDP2's allocations (per rank):
- a parameter of shape (d0, ...) sharded over g ranks holds ceil(d0 / g) rows on each (FSDP2 pads
  dim 0), in the master dtype, with its reduced gradient of the same size and the optimizer states;
- while a unit runs, its parameters are all-gathered in the compute dtype (g * ceil(d0/g) rows);
- its backward holds the unsharded gradients (compute dtype) and the reduce-scatter input (reduce
  dtype) until the reduction ends.
Offloaded (FSDP2's CPUOffloadPolicy), the sharded parameters, reduced gradients and optimizer states
live in (pinned) host memory instead: each all-gather first copies the shard host-to-device, the
reduced gradient goes device-to-host, and the optimizer step runs on the host (profile.host_link).
Checkpointed, a unit keeps what its checkpoint mode keeps (activations.activation_keep_bytes) and
re-runs in its backward the forward ops that mode does not keep.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from cost_models.activations import Segment, backward_peak, loss_kept_bytes, saved_by_selective
from cost_models.choices import Option, options_for
from cost_models.options import OPTIMIZERS, PRECISIONS, OptimizerKind, Precision, Recompute, ShardGroup
from cost_models.profile import DeviceProfile
from cost_models.records import LOSS_NODE, OpRecord, Unit

from .comm import CommModel
from .compute import ComputeModel
from .large_buffers import gather_copy_s, optimizer_first_touch_s, reduce_copy_s


@dataclass(frozen=True)
class ClusterShape:
    world_size: int
    nodes: int
    gpus_per_node: int


@dataclass
class OptionCost:
    """One unit under one option. Bytes per rank; times per micro-batch (optimizer: per step)."""

    param_bytes: int
    optimizer_bytes: int
    grad_bytes: int
    gathered_bytes: int
    held_bytes: int  # gathered bytes kept from its forward to its backward (reshard_after_forward=False)
    activation_bytes: int  # saved for backward per micro-batch
    bwd_kept_bytes: int  # checkpointed: of activation_bytes, what is still held after its backward's recomputation
    unsharded_grad_bytes: int  # gradients as backward computes them (compute dtype, all rows)
    reduce_buffer_bytes: int  # reduce-scatter / all-reduce input FSDP2 copies them into (reduce dtype)
    reduce_peak_bytes: int  # the most its post-backward holds of these (see _reduce_peak_bytes)
    pending_reduce_bytes: int  # what its reduction leaves alive through the next unit's backward (see there)
    fwd_s: float
    bwd_s: float
    comm_fwd_s: float
    comm_bwd_s: float
    optimizer_s: float
    overhead_fwd_s: float  # FSDP2's per-unit time per micro-batch beyond ops and collectives
    overhead_bwd_s: float  # (both include the in-step cost of each collective call, see FsdpOverhead)
    optimizer_temp_bytes: int  # scratch the optimizer step allocates for this unit's parameters
    tensor_scratch_bytes: int  # per-tensor (CPU) optimizer step: the scratch of its largest local parameter
    local_numel: int
    collectives_fwd: int = 0  # collective calls across ranks per micro-batch (groups of one excluded)
    collectives_bwd: int = 0
    host_bytes: int = 0  # offloaded: parameters, gradients and optimizer states in host memory, per rank
    copy_s: float = 0.0  # offloaded: host<->device copies per micro-batch (in comm or overhead, see build)
    loss_kept_bytes: int = 0  # checkpointed: its kept outputs among the loss's forward transients (activations)


@dataclass
class CostTable:
    units: list[Unit]
    options: list[list[Option]]
    costs: list[list[OptionCost]]  # [unit][option index]
    segments: list[Segment]
    micro_batch_size: int
    grad_accum_steps: int
    seq_len: int
    cluster: ClusterShape
    precision: Precision
    root: int  # index of the root unit
    overlap_compute: float
    overlap_comm: float
    overlap_enabled: bool = True  # False: a unit's collectives and compute add up (CPU + gloo)
    host_limit_bytes: int | None = None  # host memory per rank for offloaded state (node's / GPUs per node)

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.cluster.world_size


def _shard_group(option: Option, cluster: ClusterShape) -> int:
    group = option.kind.shard_group
    return {ShardGroup.WORLD: cluster.world_size, ShardGroup.NODE: cluster.gpus_per_node, ShardGroup.ONE: 1}[group]


def _scope(group_size: int, cluster: ClusterShape, spans_nodes: bool) -> str:
    return "inter_node" if cluster.nodes > 1 and (spans_nodes or group_size > cluster.gpus_per_node) else "intra_node"


def _local_numel(unit: Unit, shard: int) -> int:
    """Elements of the unit's parameters on one rank, with FSDP2's dim-0 padding."""
    total = 0
    for param in unit.params:
        shape = param.shape or (1,)
        rows = math.ceil(shape[0] / shard)
        total += rows * math.prod(shape[1:])
    return total


def _optimizer_temp_bytes(unit: Unit, shard: int, precision: Precision, optimizer: OptimizerKind,
                          device_type: str) -> int:
    """Scratch of the optimizer step on CUDA, where torch's optimizers run foreach and allocate
    state-sized temporaries over all parameters of a group (AdamW: one, the sqrt of the second moment).
    On the CPU it runs one tensor at a time: see `per_tensor_optimizer_scratch_bytes`."""
    if device_type == "cuda":
        return _local_numel(unit, shard) * optimizer.step_temporaries * precision.state_bytes
    return 0


def per_tensor_optimizer_scratch_bytes(unit: Unit, shard: int, precision: Precision, optimizer: OptimizerKind,
                                       device_type: str) -> int:
    """On the CPU, AdamW steps one tensor at a time (torch's single-tensor path): only one parameter's
    temporaries are alive at once, so the step's scratch is that of the largest local parameter shard
    of the whole plan (memory.timeline takes the maximum over units). That path allocates one more than
    foreach: `(exp_avg_sq.sqrt() / bias_correction2_sqrt)` holds the square root and the quotient
    together, where foreach divides in place (measured with autoplan.memtrack on torch 2.13: 2.0 and 1.0
    tensors of scratch). gpt2 124M's tied 50257 x 768 embedding, sharded over 2 ranks: 2 x 77.2 MB."""
    temporaries = optimizer.step_temporaries
    if device_type == "cuda" or not temporaries or not unit.params:
        return 0
    largest = max(math.ceil((p.shape or (1,))[0] / shard) * math.prod((p.shape or (1,))[1:]) for p in unit.params)
    return largest * (temporaries + 1) * precision.state_bytes


def _gloo_copy_bytes(reduction_input: int, shard: int, device_type: str) -> int:
    """On the CPU, gloo's reduce-scatter works on a copy of its input (measured with autoplan.memtrack:
    a second reduce-dtype buffer of the input's size); NCCL reduces in place."""
    return reduction_input if device_type != "cuda" and shard > 1 else 0


def _reduce_peak_bytes(reduction_input: int, unsharded_grad: int, reduced_grad: int, gloo_copy: int) -> int:
    """FSDP2's post-backward (foreach_reduce) copies the unsharded gradients into the reduction input
    and frees them, then allocates the reduction output (the new sharded gradient) and reduces, on
    gloo's copy of the input while the call runs."""
    return reduction_input + max(unsharded_grad, reduced_grad + gloo_copy)


def _pending_reduce_bytes(reduction_input: int, gloo_copy: int) -> int:
    """What a unit's reduction leaves alive through the next unit's backward: FSDP2 keeps the reduction
    input until the next post-backward (reduce_scatter_max_input_buffers=1). Gloo's copy of it is
    freed by gloo's worker thread once it lets go of the finished call, as late as the scheduler runs
    that thread: measured alive well into the next unit's backward in about one step of fifty (two
    ranks on two cores). A plan must fit then too, so the copy is counted."""
    return reduction_input + gloo_copy


def without_gloo_copy(table: CostTable) -> CostTable:
    """`table` as a backend that reduces in place holds it (NCCL; torch's fake process group, which
    allocates nothing): every option's reduction peak and pending reduction without gloo's copy of the
    input, all else (the profile's optimizer scratch, times) as costed. Memory only: the times still
    include gloo's collectives."""
    reduce_bytes = table.precision.reduce_bytes
    costs = [[replace(c, reduce_peak_bytes=_reduce_peak_bytes(c.reduce_buffer_bytes, c.unsharded_grad_bytes,
                                                               c.local_numel * reduce_bytes, 0),
                      pending_reduce_bytes=_pending_reduce_bytes(c.reduce_buffer_bytes, 0))
              for c in unit_costs] for unit_costs in table.costs]
    return replace(table, costs=costs)


def build_cost_table(
    units: list[Unit],
    ops: list[OpRecord],
    keep_bytes: list[int],
    profile: DeviceProfile,
    cluster: ClusterShape,
    micro_batch_size: int,
    grad_accum_steps: int,
    seq_len: int,
    dtype: str,
    optimizer: str,
    kept_saved: dict[Recompute, dict[str, int]] | dict[str, int] | None = None,
    offload: bool = False,
    host_limit_bytes: int | None = None,
    backward_keep: dict[Recompute, list[int]] | None = None,
) -> CostTable:
    """`keep_bytes` (per checkpointing Recompute, per unit) and `kept_saved` (per Recompute, per op, see
    activations.kept_saved_bytes) at this micro-batch; a plain list and dict are full checkpointing's.
    `backward_keep` (per Recompute, per unit, see activations.backward_keep_bytes): what of the kept bytes
    is still held after the unit's backward recomputed its forward (default: all of it).
    `offload`: offer host offload (the profile must have a host link); `host_limit_bytes`: per rank."""
    if not isinstance(keep_bytes, dict):
        keep_bytes = {Recompute.ALL: keep_bytes, Recompute.CHEAP: keep_bytes}
    backward_keep = {**keep_bytes, **(backward_keep or {})}
    if kept_saved is None or not all(isinstance(k, Recompute) for k in kept_saved):
        kept_saved = {Recompute.ALL: kept_saved or {}, Recompute.CHEAP: kept_saved or {}}
    host = profile.host_link
    if offload and host is None:
        raise ValueError(f"profile {profile.name} has no host_link: offload cannot be priced on it")
    host_is_device = profile.device_type == "cpu"
    precision, optimizer_kind = PRECISIONS[dtype], OPTIMIZERS[optimizer]
    compute = ComputeModel(profile, precision.compute_dtype)
    comm = CommModel(profile)
    op_index = {op.name: i for i, op in enumerate(ops)}
    by_name = {op.name: op for op in ops}
    root = next(i for i, unit in enumerate(units) if unit.is_root)
    overlap = profile.overlap.enabled
    # slowdowns apply only where compute and communication run at the same time
    cs, ms = (profile.overlap.compute_slowdown, profile.overlap.comm_slowdown) if overlap else (1.0, 1.0)
    unit_fwd, unit_bwd = profile.fsdp.unit_fwd_s, profile.fsdp.unit_bwd_s
    fwd_scale, bwd_scale = profile.fsdp.compute_fwd_scale, profile.fsdp.compute_bwd_scale
    recompute_scale = profile.fsdp.compute_recompute_scale or bwd_scale
    call_fwd, call_bwd = profile.fsdp.collective_fwd_s, profile.fsdp.collective_bwd_s
    opt_rate = profile.optimizer_bytes_s or profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency

    all_options: list[list[Option]] = []
    all_costs: list[list[OptionCost]] = []
    for index, unit in enumerate(units):
        unit_ops = [by_name[name] for name in unit.ops]
        # ops as they run inside a training step, not one at a time (see FsdpOverhead)
        fwd_s = fwd_scale * sum(compute.op_time_s(op, "fwd") for op in unit_ops)
        bwd_s = bwd_scale * sum(compute.op_time_s(op, "bwd") for op in unit_ops)
        recompute_s = {
            Recompute.NOTHING: 0.0,
            Recompute.ALL: recompute_scale * sum(compute.op_time_s(op, "fwd") for op in unit_ops),
            Recompute.CHEAP: recompute_scale * sum(compute.op_time_s(op, "fwd") for op in unit_ops
                                                   if not saved_by_selective(op)),
        }
        saved = sum(op.saved_bytes for op in unit_ops)
        options = options_for(unit.is_leaf, unit.is_root, cluster.nodes, offload, bool(unit.params))
        costs = []
        for option in options:
            shard = _shard_group(option, cluster)
            replicas = cluster.world_size // shard
            local = _local_numel(unit, shard)
            padded = local * shard
            gathered = padded * precision.compute_bytes
            all_gather = comm.collective_s("all_gather", gathered, shard, _scope(shard, cluster, False))
            reduction_input = padded * precision.reduce_bytes
            gloo_copy = _gloo_copy_bytes(reduction_input, shard, profile.device_type)
            reduce_scatter = comm.collective_s("reduce_scatter", reduction_input, shard, _scope(shard, cluster, False))
            replicas_span_nodes = shard == 1 or option.kind.shard_group == ShardGroup.NODE
            all_reduce = comm.collective_s(
                "all_reduce", local * precision.reduce_bytes, replicas, _scope(replicas, cluster, replicas_span_nodes)
            )
            regathers = option.kind.reshard_after_forward  # the root too: apply sets the flag explicitly
            regather = all_gather if regathers else 0.0
            comm_fwd, comm_bwd = all_gather, regather + reduce_scatter + all_reduce
            has_params = bool(unit.params)
            calls_fwd = int(has_params and shard > 1)
            calls_bwd = int(has_params and shard > 1) * (1 + int(regathers)) + int(has_params and replicas > 1)
            # a checkpointed unit re-runs (some of) its forward ops within the backward, at their in-backward
            # speed (calibrated); no further per-unit time or collectives (the recompute finds it gathered)
            recompute = option.recompute
            bwd_total = bwd_s + recompute_s[recompute]
            state = (local * precision.master_bytes, local * precision.master_bytes,
                     local * optimizer_kind.states * precision.state_bytes)  # parameters, gradients, states
            # FSDP2's own copies around its collectives (CPU profiles; see large_buffers)
            gather_copies = gather_copy_s(unit, shard, precision, profile)
            copies_fwd = gather_copies
            copies_bwd = (gather_copies if regathers else 0.0) + reduce_copy_s(unit, shard, replicas, precision, profile)
            copy_fwd = copy_bwd = 0.0
            # offloaded state leaves the device only where the device is not the host (on a CPU profile it
            # stays in the same memory, and FSDP2's copies to the "device" are no-ops)
            off_device = option.offload and not host_is_device
            if off_device:
                # each gather copies the shard host-to-device first (staged on the device while gathering);
                # each reduction's output goes device-to-host
                h2d = local * precision.master_bytes / host.h2d_bytes_s
                copy_fwd = h2d
                copy_bwd = (h2d if regathers else 0.0) + local * precision.reduce_bytes / host.d2h_bytes_s
                if host.overlaps_compute:  # on the copy engines, beside the collectives
                    comm_fwd, comm_bwd = comm_fwd + copy_fwd, comm_bwd + copy_bwd
            costs.append(OptionCost(
                param_bytes=0 if off_device else state[0],
                optimizer_bytes=0 if off_device else state[2],
                grad_bytes=0 if off_device else state[1],
                gathered_bytes=gathered + (local * precision.master_bytes if off_device else 0),
                held_bytes=0 if option.kind.reshard_after_forward else gathered,
                activation_bytes=keep_bytes[recompute][index] if option.mode.checkpoints else saved,
                bwd_kept_bytes=backward_keep[recompute][index] if option.mode.checkpoints else 0,
                unsharded_grad_bytes=padded * precision.compute_bytes,
                reduce_buffer_bytes=reduction_input,
                reduce_peak_bytes=_reduce_peak_bytes(reduction_input, padded * precision.compute_bytes,
                                                     local * precision.reduce_bytes, gloo_copy),
                pending_reduce_bytes=_pending_reduce_bytes(reduction_input, gloo_copy),
                fwd_s=fwd_s * (cs if comm_fwd > 0 else 1.0),
                bwd_s=bwd_total * (cs if comm_bwd > 0 else 1.0),
                comm_fwd_s=comm_fwd * (ms if fwd_s > 0 else 1.0),
                comm_bwd_s=comm_bwd * (ms if bwd_total > 0 else 1.0),
                optimizer_s=local * optimizer_kind.touches * precision.master_bytes
                / (host.cpu_optimizer_bytes_s if option.offload else opt_rate)
                + (len(unit.params) * profile.optimizer_tensor_s if unit.params else 0.0)
                + optimizer_first_touch_s(unit, shard, precision, optimizer_kind, profile),
                overhead_fwd_s=unit_fwd + calls_fwd * call_fwd + copies_fwd + (0.0 if host is None or host.overlaps_compute
                                                                  else copy_fwd),
                overhead_bwd_s=unit_bwd + calls_bwd * call_bwd + copies_bwd + (0.0 if host is None or host.overlaps_compute
                                                                  else copy_bwd),
                optimizer_temp_bytes=0 if off_device else _optimizer_temp_bytes(
                    unit, shard, precision, optimizer_kind, profile.device_type),
                tensor_scratch_bytes=0 if off_device else per_tensor_optimizer_scratch_bytes(
                    unit, shard, precision, optimizer_kind, profile.device_type),
                local_numel=local,
                collectives_fwd=calls_fwd,
                collectives_bwd=calls_bwd,
                host_bytes=sum(state) if option.offload else 0,
                copy_s=copy_fwd + copy_bwd,
            ))
        all_options.append(options)
        all_costs.append(costs)

    owner = {}
    for index, unit in enumerate(units):
        for name in unit.ops:
            owner[name] = index
    segments: list[Segment] = []
    for op in ops:
        position = op_index[op.name]
        if segments and segments[-1].unit == owner[op.name] and op.name != LOSS_NODE:
            seg = segments[-1]
            seg.last_op = position
        else:
            seg = Segment(owner[op.name], position, position, 0, 0, outside_model=op.name == LOSS_NODE)
            segments.append(seg)
        seg.saved_bytes += op.saved_bytes
        seg.fwd_temp_bytes = max(seg.fwd_temp_bytes, op.fwd_max_alloc_bytes, op.fwd_transient_bytes)
    for (u, recompute), kept_bytes in loss_kept_bytes(ops, owner, kept_saved).items():
        for option, cost in zip(all_options[u], all_costs[u]):
            if option.mode.checkpoints and option.recompute is recompute:
                cost.loss_kept_bytes = kept_bytes
    owners = [owner[op.name] for op in ops]
    positions: dict[int, list[int]] = {}  # unit -> where its ops are: a deep model must not scan every op per segment
    for position, u in enumerate(owners):
        positions.setdefault(u, []).append(position)
    by_start = sorted(range(len(units)), key=lambda u: units[u].first_op)
    spanning: list[tuple[int, int]] = []  # (last_op, unit) of the units whose ops span the segment's start
    started = 0
    for seg in segments:  # in op order: a sweep over the units' spans
        seg.bwd_peak = backward_peak(ops, owners, seg, checkpointed=False, positions=positions[seg.unit])
        seg.bwd_peak_checkpointed = backward_peak(ops, owners, seg, checkpointed=True,
                                                  kept_saved=kept_saved[Recompute.ALL], positions=positions[seg.unit])
        seg.bwd_peak_selective = backward_peak(ops, owners, seg, checkpointed=True,
                                               kept_saved=kept_saved[Recompute.CHEAP], positions=positions[seg.unit])
        while started < len(by_start) and units[by_start[started]].first_op <= seg.first_op:
            heapq.heappush(spanning, (units[by_start[started]].last_op, by_start[started]))
            started += 1
        while spanning and spanning[0][0] < seg.first_op:
            heapq.heappop(spanning)
        around = [u for _, u in spanning if u != seg.unit]
        seg.outer_grad_bytes = sum(ops[p].param_grad_bytes for u in around for p in positions.get(u, [])
                                   if p > seg.last_op)

    return CostTable(
        units=units, options=all_options, costs=all_costs, segments=segments,
        micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps, seq_len=seq_len,
        cluster=cluster, precision=precision, root=root, overlap_compute=cs, overlap_comm=ms,
        overlap_enabled=overlap, host_limit_bytes=host_limit_bytes,
    )
