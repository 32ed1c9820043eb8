"""What one option of one unit costs: its bytes per rank and its seconds per micro-batch (`OptionCost`), priced
by `UnitPricer` from the unit's ops, a device profile and the mesh.

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
re-runs in its backward the forward ops that mode does not keep. Selectively checkpointed (an op-level policy),
each of its working ops also costs the profile's per-op time of torch's selective checkpoint, forward and backward
(FsdpOverhead.selective_*_s_per_op), in the unit's overhead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.activations import kept_outputs
from cost_models.choices import Option
from cost_models.mesh import Mesh
from cost_models.options import OptimizerKind, Precision, Recompute, ShardGroup
from cost_models.profile import DeviceProfile
from cost_models.records import OpRecord, Unit
from cost_models.training import Training

from .comm import CommModel
from .compute import ComputeModel
from .large_buffers import gather_copy_s, optimizer_first_touch_s, reduce_copy_s

__all__ = ["OptionCost", "UnitPricer", "gloo_copy_bytes", "local_numel", "working_ops", "pending_reduce_bytes",
           "per_tensor_optimizer_scratch_bytes", "reduce_peak_bytes"]


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
    selective_ops: int = 0  # selectively checkpointed: its working ops, each passed through the policy's dispatch mode

    def changed(self, **changes) -> OptionCost:
        """dataclasses.replace without re-running __init__: a pipelined mesh copies every option's costs per kind of
        stage and micro-batch, and a pipelined rank's variants again."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


def working_ops(unit_ops: list[OpRecord]) -> int:
    """The ops that run a kernel (FLOPs or bytes in their forward), not views or Python on sizes: a proxy for the
    aten ops a dispatch mode sees (llama's block: 24 of its 42 traced ops, 70 aten ops; GPT-2's: 10 of 22, 32)."""
    return sum(1 for op in unit_ops if op.fwd_flops > 0 or op.fwd_bytes > 0)


def local_numel(unit: Unit, shard: int) -> int:
    """Elements of the unit's parameters on one rank, with FSDP2's dim-0 padding."""
    total = 0
    for param in unit.params:
        shape = param.shape or (1,)
        rows = math.ceil(shape[0] / shard)
        total += rows * math.prod(shape[1:])
    return total


def optimizer_temp_bytes(unit: Unit, shard: int, precision: Precision, optimizer: OptimizerKind,
                          device_type: str) -> int:
    """Scratch of the optimizer step on CUDA, where torch's optimizers run foreach and allocate
    state-sized temporaries over all parameters of a group (AdamW: one, the sqrt of the second moment).
    On the CPU it runs one tensor at a time: see `per_tensor_optimizer_scratch_bytes`."""
    if device_type == "cuda":
        return local_numel(unit, shard) * optimizer.step_temporaries * precision.state_bytes
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


def gloo_copy_bytes(reduction_input: int, shard: int, device_type: str) -> int:
    """On the CPU, gloo's reduce-scatter works on a copy of its input (measured with autoplan.memtrack:
    a second reduce-dtype buffer of the input's size); NCCL reduces in place."""
    return reduction_input if device_type != "cuda" and shard > 1 else 0


def reduce_peak_bytes(reduction_input: int, unsharded_grad: int, reduced_grad: int, gloo_copy: int) -> int:
    """FSDP2's post-backward (foreach_reduce) copies the unsharded gradients into the reduction input
    and frees them, then allocates the reduction output (the new sharded gradient) and reduces, on
    gloo's copy of the input while the call runs."""
    return reduction_input + max(unsharded_grad, reduced_grad + gloo_copy)


def pending_reduce_bytes(reduction_input: int, gloo_copy: int) -> int:
    """What a unit's reduction leaves alive through the next unit's backward: FSDP2 keeps the reduction
    input until the next post-backward (reduce_scatter_max_input_buffers=1). Gloo's copy of it is
    freed by gloo's worker thread once it lets go of the finished call, as late as the scheduler runs
    that thread: measured alive well into the next unit's backward in about one step of fifty (two
    ranks on two cores). A plan must fit then too, so the copy is counted."""
    return reduction_input + gloo_copy


class UnitPricer:
    """The per-table constants of pricing one unit's options on a profile and a mesh."""

    def __init__(self, profile: DeviceProfile, mesh: Mesh, training: Training, offload: bool):
        self.profile, self.mesh, self.offload = profile, mesh, offload
        self.precision, self.optimizer = training.precision, training.optimizer_kind
        self.compute = ComputeModel(profile, self.precision.compute_dtype)
        self.comm = CommModel(profile, mesh.gpus_per_node, mesh.dp_per_node)
        # slowdowns apply only where compute and communication run at the same time
        overlap = profile.overlap
        self.slowdowns = (overlap.compute_slowdown, overlap.comm_slowdown) if overlap.enabled else (1.0, 1.0)
        self.opt_rate = profile.optimizer_bytes_s or profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency

    def unit_times(self, unit_ops: list[OpRecord]) -> tuple[float, float, dict[Recompute, float], int, int]:
        """The unit's forward and backward compute, its recomputation per way of checkpointing, its saved bytes,
        its working ops (see working_ops). Ops as they run inside a training step, not one at a time (see
        FsdpOverhead)."""
        fsdp, compute = self.profile.fsdp, self.compute
        recompute_scale = fsdp.compute_recompute_scale or fsdp.compute_bwd_scale
        fwd_s = compute.ops_time_s(unit_ops, "fwd", fsdp.compute_fwd_scale)
        bwd_s = compute.ops_time_s(unit_ops, "bwd", fsdp.compute_bwd_scale)
        recompute_s = {Recompute.NOTHING: 0.0, Recompute.ALL: compute.ops_time_s(unit_ops, "fwd", recompute_scale)}
        for mode in (Recompute.CHEAP, Recompute.ALTERNATE):
            kept = kept_outputs(unit_ops, mode)  # once per mode, not once per op
            rerun = [op for op in unit_ops if op.name not in kept]
            recompute_s[mode] = compute.ops_time_s(rerun, "fwd", recompute_scale)
        return fwd_s, bwd_s, recompute_s, sum(op.saved_bytes for op in unit_ops), working_ops(unit_ops)

    def option_cost(self, unit: Unit, option: Option, times: tuple, keep: dict[Recompute, list[int]],
                    backward_keep: dict[Recompute, list[int]], index: int) -> OptionCost:
        """One option of one unit (the `index`-th): its bytes, its times (see the module docstring)."""
        profile, mesh, precision = self.profile, self.mesh, self.precision
        fwd_s, bwd_s, recompute_s, saved, ops = times
        cs, ms = self.slowdowns
        shard = mesh.shard_size(option.kind.shard_group)
        replicas = mesh.fsdp_ranks // shard
        local = local_numel(unit, shard)
        comm = self._collectives(unit, option, local, shard, replicas)
        # a checkpointed unit re-runs (some of) its forward ops within the backward, at their in-backward
        # speed (calibrated); no further per-unit time or collectives (the recompute finds it gathered)
        recompute = option.recompute
        bwd_total = bwd_s + recompute_s[recompute]
        state = (local * precision.master_bytes, local * precision.master_bytes,
                 local * self.optimizer.states * precision.state_bytes)  # parameters, gradients, states
        # offloaded state leaves the device only where the device is not the host (on a CPU profile it
        # stays in the same memory, and FSDP2's copies to the "device" are no-ops)
        off_device = option.offload and profile.device_type != "cpu"
        comm_fwd, comm_bwd, copy_fwd, copy_bwd = self._offload_copies(comm, local, off_device,
                                                                      option.kind.reshard_after_forward)
        overhead_fwd, overhead_bwd = self._overheads(unit, shard, replicas, comm, copy_fwd, copy_bwd,
                                                     option.kind.reshard_after_forward)
        selective_ops = ops if recompute.keeps_outputs else 0  # run under the selective policy's dispatch mode
        overhead_fwd += selective_ops * profile.fsdp.selective_fwd_s_per_op
        overhead_bwd += selective_ops * profile.fsdp.selective_bwd_s_per_op
        padded, reduction_input = local * shard, comm.reduction_input
        gloo_copy = gloo_copy_bytes(reduction_input, shard, profile.device_type)
        return OptionCost(
            param_bytes=0 if off_device else state[0],
            optimizer_bytes=0 if off_device else state[2],
            grad_bytes=0 if off_device else state[1],
            gathered_bytes=comm.gathered + (local * precision.master_bytes if off_device else 0),
            held_bytes=0 if option.kind.reshard_after_forward else comm.gathered,
            activation_bytes=keep[recompute][index] if option.mode.checkpoints else saved,
            bwd_kept_bytes=backward_keep[recompute][index] if option.mode.checkpoints else 0,
            unsharded_grad_bytes=padded * precision.compute_bytes,
            reduce_buffer_bytes=reduction_input,
            reduce_peak_bytes=reduce_peak_bytes(reduction_input, padded * precision.compute_bytes,
                                                 local * precision.reduce_bytes, gloo_copy),
            pending_reduce_bytes=pending_reduce_bytes(reduction_input, gloo_copy),
            fwd_s=fwd_s * (cs if comm_fwd > 0 else 1.0),
            bwd_s=bwd_total * (cs if comm_bwd > 0 else 1.0),
            comm_fwd_s=comm_fwd * (ms if fwd_s > 0 else 1.0),
            comm_bwd_s=comm_bwd * (ms if bwd_total > 0 else 1.0),
            optimizer_s=self._optimizer_s(unit, local, shard, option.offload),
            overhead_fwd_s=overhead_fwd,
            overhead_bwd_s=overhead_bwd,
            optimizer_temp_bytes=0 if off_device else optimizer_temp_bytes(
                unit, shard, precision, self.optimizer, profile.device_type),
            tensor_scratch_bytes=0 if off_device else per_tensor_optimizer_scratch_bytes(
                unit, shard, precision, self.optimizer, profile.device_type),
            local_numel=local,
            collectives_fwd=comm.calls_fwd,
            collectives_bwd=comm.calls_bwd,
            host_bytes=sum(state) if option.offload else 0,
            copy_s=copy_fwd + copy_bwd,
            selective_ops=selective_ops,
        )

    def _collectives(self, unit: Unit, option: Option, local: int, shard: int, replicas: int) -> _Collectives:
        """FSDP2's collectives for the unit under the option: all-gathers (again in the backward where it
        reshards after the forward), the reduce-scatter, and the all-reduce across replicas."""
        mesh, precision, comm = self.mesh, self.precision, self.comm
        padded = local * shard
        gathered = padded * precision.compute_bytes
        all_gather = comm.collective_s("all_gather", gathered, shard, mesh.scope(shard))
        reduction_input = padded * precision.reduce_bytes
        reduce_scatter = comm.collective_s("reduce_scatter", reduction_input, shard, mesh.scope(shard))
        replicas_span_nodes = shard == 1 or option.kind.shard_group == ShardGroup.NODE
        all_reduce = comm.collective_s("all_reduce", local * precision.reduce_bytes, replicas,  # HSDP: a rank per node
                                       mesh.scope(replicas, replicas_span_nodes),
                                       ranks_per_node=1 if option.kind.shard_group == ShardGroup.NODE else None)
        regathers = option.kind.reshard_after_forward  # the root too: apply sets the flag explicitly
        has_params = bool(unit.params)
        calls_fwd = int(has_params and shard > 1)
        calls_bwd = int(has_params and shard > 1) * (1 + int(regathers)) + int(has_params and replicas > 1)
        return _Collectives(all_gather, (all_gather if regathers else 0.0) + reduce_scatter + all_reduce, gathered,
                            reduction_input, calls_fwd, calls_bwd)

    def _offload_copies(self, comm: _Collectives, local: int, off_device: bool,
                        regathers: bool) -> tuple[float, float, float, float]:
        """(communication forward, backward, host copies forward, backward): offloaded, each gather copies the
        shard host-to-device first (staged on the device while gathering), each reduction's output goes
        device-to-host; on the copy engines, beside the collectives, where the host link overlaps compute."""
        comm_fwd, comm_bwd = comm.fwd_s, comm.bwd_s
        if not off_device:
            return comm_fwd, comm_bwd, 0.0, 0.0
        host, precision = self.profile.host_link, self.precision
        h2d = local * precision.master_bytes / host.h2d_bytes_s
        copy_fwd = h2d
        copy_bwd = (h2d if regathers else 0.0) + local * precision.reduce_bytes / host.d2h_bytes_s
        if host.overlaps_compute:
            comm_fwd, comm_bwd = comm_fwd + copy_fwd, comm_bwd + copy_bwd
        return comm_fwd, comm_bwd, copy_fwd, copy_bwd

    def _overheads(self, unit: Unit, shard: int, replicas: int, comm: _Collectives, copy_fwd: float,
                   copy_bwd: float, regathers: bool) -> tuple[float, float]:
        """FSDP2's per-unit time beyond ops and collectives, forward and backward: its fixed cost, each
        collective call's in-step cost, its own copies around the collectives (large_buffers: on the compute stream),
        and host copies that do not overlap compute."""
        profile, precision, fsdp, host = self.profile, self.precision, self.profile.fsdp, self.profile.host_link
        gather_copies = gather_copy_s(unit, shard, precision, profile)
        copies_bwd = (gather_copies if regathers else 0.0) + reduce_copy_s(unit, shard, replicas, precision, profile)
        exposed = host is not None and not host.overlaps_compute
        return (fsdp.unit_fwd_s + comm.calls_fwd * fsdp.collective_fwd_s + gather_copies + (copy_fwd if exposed else 0.0),
                fsdp.unit_bwd_s + comm.calls_bwd * fsdp.collective_bwd_s + copies_bwd + (copy_bwd if exposed else 0.0))

    def _optimizer_s(self, unit: Unit, local: int, shard: int, offload: bool) -> float:
        """The optimizer step over the unit's local shard: memory-bound (on the host where offloaded), plus a
        fixed cost per parameter tensor and the first touch of its state (large_buffers)."""
        profile, precision, optimizer = self.profile, self.precision, self.optimizer
        rate = profile.host_link.cpu_optimizer_bytes_s if offload else self.opt_rate
        return (local * optimizer.touches * precision.master_bytes / rate
                + (len(unit.params) * profile.optimizer_tensor_s if unit.params else 0.0)
                + optimizer_first_touch_s(unit, shard, precision, optimizer, profile))


@dataclass(frozen=True)
class _Collectives:
    """A unit's FSDP2 collectives under one option: seconds forward and backward, the gathered parameters'
    and the reduction input's bytes, and the calls across ranks per micro-batch."""

    fwd_s: float
    bwd_s: float
    gathered: int
    reduction_input: int
    calls_fwd: int
    calls_bwd: int
