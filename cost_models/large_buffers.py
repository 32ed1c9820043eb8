"""FSDP2's own copies and the CPU's freshly mapped memory: time that no traced op and no collective has.

Per unit and micro-batch FSDP2 copies every parameter twice on the way in (the copy-in of the shard,
cast to the compute dtype, into the all-gather input; the copy-out of the all-gather output into each
parameter's unsharded storage) and every gradient once on the way out (the concatenation, cast to the
reduce dtype, into the reduce-scatter input; gloo copies that input again). On a small model these
are part of the per-unit cost the calibration fits. At real sizes they are not small, and on the CPU
each buffer above the allocator's mmap threshold is mapped fresh at every allocation, so writing it
first pays a page fault per page (`DeviceProfile.first_touch_s_per_byte`): gpt2 124M's tied
50,257 x 768 embedding alone makes 77-154 MB buffers, each costing 40-80 ms to touch on this
project's machine. AdamW's single-tensor CPU step allocates two temporaries per parameter tensor,
which pay the same for a large tensor.

On a GPU the caching allocator reuses its blocks (no first touch), and of the copies those on the compute
stream count: the copy-out after each all-gather (torch 2.13, _fsdp_param_group.wait_for_unshard) and the
copy of the unsharded gradients into the reduction input (_fsdp_collectives.foreach_reduce, before it hands
the buffer to the reduce-scatter stream), each a read and a write at the profile's copy bandwidth; the
all-gather's copy-in (a shard) runs on a stream of its own and is not priced.
"""

from __future__ import annotations

import math

from cost_models.options import OptimizerKind, Precision
from cost_models.profile import DeviceProfile
from cost_models.records import Unit


def buffer_s(nbytes: int, profile: DeviceProfile) -> float:
    """One buffer written by a copy: its bytes read and written at the profile's copy bandwidth, and
    its first touch where it is mapped fresh. 0 on a GPU profile."""
    if profile.device_type != "cpu" or nbytes <= 0:
        return 0.0
    bandwidth = profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency
    fresh = nbytes * profile.first_touch_s_per_byte if nbytes >= profile.first_touch_min_bytes else 0.0
    return 2 * nbytes / bandwidth + fresh


def _hbm_s(nbytes: int, profile: DeviceProfile) -> float:
    """Bytes read and written by a GPU copy kernel, at the profile's copy bandwidth."""
    return nbytes / (profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency)


def _local_elements(unit: Unit, shard: int) -> list[int]:
    """Each parameter's elements on one rank (FSDP2 pads dim 0 to a multiple of the shard group)."""
    return [math.ceil((p.shape or (1,))[0] / shard) * math.prod((p.shape or (1,))[1:]) for p in unit.params]


def gather_copy_s(unit: Unit, shard: int, precision: Precision, profile: DeviceProfile) -> float:
    """FSDP2's copies around one all-gather of the unit: the copy-in (the shard in the compute dtype,
    one flat buffer; per parameter without a shard group), the all-gather output (one flat buffer,
    shard > 1), the copy-out into each parameter's unsharded storage (freed at reshard, so allocated
    again at each gather). With a shard group, gloo's own flat output too: gloo gathers into a buffer it
    allocates and copies that into the output (ProcessGroupGloo's AsyncAllgatherWork). The collective's
    fit, timed on buffers mostly below the mmap threshold that the heap reuses, holds that copy there;
    above it the buffer is mapped fresh at every call, so it is charged here (gpt2 124M's root, 79 MB
    bf16 over 2 ranks: 70-77 ms measured against the fit's 34)."""
    local = _local_elements(unit, shard)
    if not local:
        return 0.0
    cb = precision.compute_bytes
    gathered = sum(local) * shard * cb
    if profile.device_type == "cuda":  # the copy-out into each parameter's unsharded storage
        return _hbm_s(2 * gathered, profile)
    copy_in = buffer_s(sum(local) * cb, profile) if shard > 1 else sum(buffer_s(n * cb, profile) for n in local)
    output = buffer_s(gathered, profile) if shard > 1 else 0.0
    gloo_output = output if shard > 1 and gathered >= profile.first_touch_min_bytes else 0.0
    return copy_in + output + gloo_output + sum(buffer_s(n * shard * cb, profile) for n in local)


def reduce_copy_s(unit: Unit, shard: int, replicas: int, precision: Precision, profile: DeviceProfile) -> float:
    """FSDP2's copies around the unit's gradient reduction: the reduce-scatter input (the gradients
    concatenated in the reduce dtype); with a shard group, gloo's copy of it and the reduced shard."""
    local = sum(_local_elements(unit, shard))
    if not local or (shard == 1 and replicas == 1):
        return 0.0
    rb = precision.reduce_bytes
    if profile.device_type == "cuda":  # the unsharded gradients read, the reduction input written
        return _hbm_s(local * shard * (precision.compute_bytes + rb), profile)
    total = buffer_s(local * shard * rb, profile)
    if shard > 1:
        total += buffer_s(local * shard * rb, profile) + buffer_s(local * rb, profile)
    return total


def optimizer_first_touch_s(unit: Unit, shard: int, precision: Precision, optimizer: OptimizerKind,
                            profile: DeviceProfile) -> float:
    """The first touch of the CPU optimizer's per-tensor temporaries (AdamW: two, see
    table.per_tensor_optimizer_scratch_bytes) for the unit's parameters whose shard is mapped fresh."""
    if profile.device_type != "cpu" or not optimizer.step_temporaries:
        return 0.0
    temporaries = optimizer.step_temporaries + 1
    sizes = [n * precision.state_bytes for n in _local_elements(unit, shard)]
    return sum(temporaries * size * profile.first_touch_s_per_byte for size in sizes
               if size >= profile.first_touch_min_bytes)
