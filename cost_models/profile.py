"""Device profiles: the one place device-specific numbers live (peak FLOP/s, bandwidth, collectives).

A datasheet profile gives peaks and link bandwidths; a measured one (`autoplan profile`) adds per-op
timings, per-family fits and fitted collective curves. Both share this schema, so the cost models
read either without change. Finding and reading profile files is `autoplan.profile_store`'s job.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PROFILE_SCHEMA_VERSION", "Provenance", "DeviceIdentity", "Link", "Topology", "CollectiveFit", "OpTiming", "OpFit",
    "MatmulShape", "AttentionRate", "Overlap", "FsdpOverhead", "LossParallel", "TpDispatch", "HostLink", "DeviceProfile",
]

PROFILE_SCHEMA_VERSION = 1

Collective = Literal["all_gather", "reduce_scatter", "all_reduce"]
Scope = Literal["intra_node", "inter_node"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Provenance(_Strict):
    description: str
    host: str | None = None
    device_name: str | None = None
    torch_version: str | None = None
    date: str | None = None
    settings: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    sources: dict[str, str] = Field(default_factory=dict)
    """Where each achievable figure comes from: the profile field it sets (e.g. "matmul_efficiency",
    "links.inter_node", "host_link.h2d_bytes_s") -> the published measurement or datasheet it is read
    from (document, table or figure, and the number there). `autoplan profiles` prints them."""


class DeviceIdentity(_Strict):
    """The device a profile was measured on (measured) or describes (datasheet): what `search` and `apply`
    compare with the machine they run on, and what a reader checks before trusting the figures. GPU fields
    are None for a CPU profile and the CPU ones describe its host; a CPU profile's `cpu_features` name the
    matrix and vector units its op timings depend on (a bf16 matmul runs on AMX or AVX512-BF16 units where
    the CPU has them, and is emulated, many times slower, where it has AVX2 only)."""

    name: str
    """The device as its driver names it: "NVIDIA A100-SXM4-80GB", or the CPU's model name."""
    memory_bytes: int | None = Field(default=None, gt=0)
    sm_count: int | None = Field(default=None, gt=0)
    """Streaming multiprocessors (GPU): what a kernel's thread blocks are scheduled on, one wave at a time."""
    boost_clock_mhz: float | None = Field(default=None, gt=0)
    """The clock the datasheet's peak FLOP/s is quoted at (GPU)."""
    power_limit_w: float | None = Field(default=None, gt=0)
    cpu_model: str | None = None
    cpu_cores: int | None = Field(default=None, gt=0)
    cpu_features: list[str] = Field(default_factory=list)
    """Of the host's matrix and vector features, those that decide op speed: amx_bf16, avx512_bf16, avx512f, avx2."""


class Link(_Strict):
    """A ring collective's bus bandwidth and per-call latency over one kind of link."""

    bus_bandwidth_bytes_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class Topology(_Strict):
    """How the GPUs of a node and the nodes are connected, for collectives no measured fit covers
    (cost_models/comm.py): NCCL's ring (and, for all-reduce across nodes, its tree) over these links, with
    NCCL's own latency model (src/graph/tuning.cc: a base latency per call, one per ring step inside a node
    and one per step between nodes)."""

    intra_node: Literal["nvswitch", "nvlink_pairs", "pcie"]
    """nvswitch: every GPU reaches every other at full NVLink rate (SXM boards); nvlink_pairs: PCIe cards
    with NVLink bridges between pairs (a ring across the node crosses PCIe); pcie: PCIe only."""
    intra_bus_bytes_s: float = Field(gt=0)
    """A ring across the node's GPUs: NCCL's bus bandwidth (nccl-tests' busbw) for large messages."""
    pair_bus_bytes_s: float | None = Field(default=None, gt=0)
    """nvlink_pairs: the bus bandwidth between the two GPUs of a bridged pair."""
    nics_per_node: int = Field(ge=1)
    nic_bytes_s: float = Field(gt=0)
    """What one NIC delivers to NCCL (bytes/s, one direction), not its line rate."""
    base_latency_s: float = Field(ge=0)
    intra_hop_latency_s: float = Field(ge=0)
    inter_hop_latency_s: float = Field(ge=0)


class CollectiveFit(_Strict):
    """time_s = alpha_s + beta_s_per_byte * bytes, where bytes is the full (unsharded) buffer size."""

    collective: Collective
    group_size: int = Field(ge=2)
    scope: Scope
    alpha_s: float = Field(ge=0)
    beta_s_per_byte: float = Field(ge=0)


class OpTiming(_Strict):
    """A measured op: key is autoplan.trace.OpRecord.key (op kind, input shapes, dtype)."""

    key: str
    fwd_s: float = Field(ge=0)
    bwd_s: float = Field(ge=0)


class OpFit(_Strict):
    """time_s = intercept_s + s_per_unit * work, work being FLOPs or bytes moved, per op family.

    family is an op kind ("Linear", "gelu") or a generic family ("matmul", "memory"); dtype is the
    traced compute dtype the points were measured in (None: any dtype), since a bf16 matmul can run
    at several times the FLOP/s of an fp32 one on the same device."""

    family: str
    direction: Literal["fwd", "bwd"]
    work: Literal["flops", "bytes"]
    dtype: str | None = None
    intercept_s: float = Field(ge=0)
    s_per_unit: float = Field(ge=0)
    min_alloc_bytes: int = Field(default=0, ge=0)
    """0: the family's fit over all its points. Above 0: a second fit, made on (and used for) the ops whose
    largest allocation in that direction (compute.largest_alloc_bytes) is at least this. On the CPU that is the
    allocator's mmap threshold (`first_touch_min_bytes`): such tensors are mapped fresh at every
    allocation and their first write pays page faults, so a 32k-vocabulary loss runs at a third of the
    per-byte rate of the small ones that dominate the family's fit."""
    max_work: float | None = Field(default=None, gt=0)
    """The largest work among the fit's points (None: not recorded, as in profiles made before it was). An op
    more than `cost_models.compute.FIT_REACH` times this is priced by the next fit that reaches it (the
    generic family's, else the roofline): a kind measured only at small sizes, where every point sits at the
    launch floor, has an intercept and a slope that say nothing of a large op (an H200's `getitem` backward
    fitted 7 GB/s, 600 times slower than its copies)."""


class MatmulShape(_Strict):
    """A GPU matmul's efficiency by shape (NVIDIA, "Matrix Multiplication Background User's Guide", tile and
    wave quantization): cuBLAS covers the M x N output with thread-block tiles and runs them in waves of one
    tile per SM, so a product whose tiles do not fill the last wave (or whose edges fill their tiles
    partly) runs at the fraction of the full-wave rate its useful tiles make up. `full_wave_efficiency`:
    the fraction of the peak a product reaches at full waves."""

    sm_count: int = Field(gt=0)
    tiles: list[tuple[int, int]] = Field(default_factory=lambda: [(256, 128), (128, 256), (128, 128)])
    full_wave_efficiency: float = Field(gt=0, le=1)


class AttentionRate(_Strict):
    """A fused (flash) attention kernel's measured rate, forward and backward together, at one shape: FLOP/s
    with a causal mask's FLOPs counted once (the half it computes), as flash-attention's benchmarks count."""

    head_dim: int = Field(gt=0)
    causal: bool
    seq_len: int = Field(gt=0)
    flops_s: float = Field(gt=0)


class Overlap(_Strict):
    """Whether FSDP2 runs a unit's collectives concurrently with compute (CUDA: collectives on their
    own streams; CPU + gloo: no, the unit waits for its all-gather, and comm and compute add up), and
    the slowdown factors (>= 1) of compute and of communication while the two run concurrently."""

    enabled: bool = True
    compute_slowdown: float = Field(default=1.0, ge=1.0)
    comm_slowdown: float = Field(default=1.0, ge=1.0)
    comm_sm_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """The share of the GPU's SMs a running NCCL collective holds (its CTAs do not share an SM with compute
    kernels): compute runs at 1 - this while a collective runs (cost_models/step.py)."""


class FsdpOverhead(_Strict):
    """How a real FSDP2 training step differs from the sum of its separately timed parts.

    unit_*_s: each unit's own time per micro-batch beyond its ops and collectives (hooks, DTensor
    handling, copy-in/copy-out);
    collective_*_s: each collective call's cost inside a step beyond its time on idle ranks (waiting
    for the peers at the synchronisation point, the collective's threads competing for the cores);
    compute_*_scale: how much longer the ops take inside a step than timed one at a time (ranks'
    collectives competing for the cores, cold caches); compute_recompute_scale: the same for the
    forward ops a checkpointed unit re-runs in its backward (None: as the backward's);
    selective_*_s_per_op: what torch's selective checkpoint adds per op of a selectively checkpointed
    unit (see the fields). Fitted by `autoplan profile` on whole training steps of a calibration model
    (profiling/calibration.py), whose record `calibration` keeps; 0 and 1 = not modelled."""

    unit_fwd_s: float = Field(default=0.0, ge=0)
    unit_bwd_s: float = Field(default=0.0, ge=0)
    collective_fwd_s: float = Field(default=0.0, ge=0)
    collective_bwd_s: float = Field(default=0.0, ge=0)
    compute_fwd_scale: float = Field(default=1.0, gt=0)
    compute_bwd_scale: float = Field(default=1.0, gt=0)
    compute_recompute_scale: float | None = Field(default=None, gt=0)
    selective_fwd_s_per_op: float = Field(default=0.0, ge=0)
    """Seconds per micro-batch that each working op (one that runs a kernel) of a selectively checkpointed
    unit's forward costs beyond the op: torch's selective checkpoint runs its forward under a Python dispatch
    mode that decides, op by op, what to keep (torch.utils.checkpoint.create_selective_checkpoint_contexts).
    0: not measured (profiles calibrated before it, datasheet profiles)."""
    selective_bwd_s_per_op: float = Field(default=0.0, ge=0)
    """The same in the backward, where the recompute passes every forward op through the dispatch mode again
    (the kept ones are read back from its cache)."""
    calibration: dict | None = None


class LossParallel(_Strict):
    """What torch's loss_parallel (cross-entropy on vocabulary-parallel logits) costs one rank beyond the
    fused cross-entropy on the same local logits, its collectives apart (priced on the collective fits):
    it runs log-softmax and the target's pick as separate ops (max, subtract, exp, sum, log, a masked
    gather) through DTensor's dispatch, each a pass over the logits, forward and backward. Linear in the
    rank's logits (tokens x vocabulary / t), fitted by autoplan/profiling/loss_parallel.py; absent where
    not measured (a datasheet profile: the loss then costs as the fused one on 1/t of the logits)."""

    fwd_s: float = Field(ge=0)
    """Fixed forward cost per micro-batch (DTensor's dispatch of the decomposed ops), seconds."""
    fwd_s_per_logit: float = Field(ge=0)
    """Forward seconds per local logit (fp32 element) beyond the fused loss."""
    bwd_s: float = Field(ge=0)
    bwd_s_per_logit: float = Field(ge=0)


class TpDispatch(_Strict):
    """What a tensor-parallel plan's modules cost one rank beyond their ops and collectives: DTensor's
    dispatch (sharding propagation, redistribution and the from/to_local wrapping in Python) for every
    module the layout parallelizes (each column- and row-wise projection, the vocabulary-parallel embedding
    and head; with sequence parallelism also each sequence-parallel norm and each region's input
    preparation), per micro-batch. Fitted by autoplan/profiling/tp_dispatch.py from whole FSDP2 + TP steps
    of a small Llama on the fake process group against the same steps without TP; measured on the CPU, where
    this time is the step's (a GPU launches asynchronously and hides it behind its kernels while they are
    longer: absent there, the modules cost as their ops)."""

    fwd_s_per_module: float = Field(ge=0)
    """Forward seconds per parallelized module, tensor parallelism without sequence parallelism."""
    bwd_s_per_module: float = Field(ge=0)
    sp_fwd_s_per_module: float = Field(ge=0)
    """The same with sequence parallelism (its modules include the norms and the regions' inputs)."""
    sp_bwd_s_per_module: float = Field(ge=0)

    def per_module(self, sequence_parallel: bool) -> tuple[float, float]:
        """(forward, backward) seconds per module under the layout's mode."""
        if sequence_parallel:
            return self.sp_fwd_s_per_module, self.sp_bwd_s_per_module
        return self.fwd_s_per_module, self.bwd_s_per_module


class HostLink(_Strict):
    """The device's link to host memory, for offloaded parameters, gradients and optimizer states
    (FSDP2's CPUOffloadPolicy): pinned copy bandwidth each way, whether those copies run alongside
    compute (CUDA copy engines: yes; a CPU "device" moves nothing), and the host side that runs the
    optimizer step of offloaded parameters."""

    h2d_bytes_s: float = Field(gt=0)
    """Host-to-device copy bandwidth, pinned memory, one large copy, bytes/s."""
    d2h_bytes_s: float = Field(gt=0)
    """Device-to-host copy bandwidth, pinned memory, bytes/s."""
    overlaps_compute: bool = True
    """True where the copies run on their own engine/stream alongside compute (a unit's copy then hides
    behind compute like its collectives); False: a copy adds to the unit's time."""
    cpu_optimizer_bytes_s: float = Field(gt=0)
    """The host's optimizer throughput over offloaded state (bytes of state touched per second, as
    `optimizer_bytes_s`), with `cpu_threads` threads per rank."""
    cpu_threads: int = Field(default=1, ge=1)
    """The torch thread count per rank `cpu_optimizer_bytes_s` was measured (or is assumed) with."""
    host_mem_bytes: int | None = Field(default=None, gt=0)
    """Host memory per node that offloaded state may use (None: the search asks for `--host-mem`,
    or takes this machine's memory for a CPU profile)."""


class DeviceProfile(_Strict):
    schema_version: int = PROFILE_SCHEMA_VERSION
    name: str
    source: Literal["datasheet", "measured"]
    provenance: Provenance
    device_type: Literal["cuda", "cpu"]
    identity: DeviceIdentity | None = None  # None: an older profile that did not record it
    mem_bytes: int = Field(gt=0)
    peak_flops: dict[str, float]  # dtype name ("bf16", "fp16", "fp32") -> FLOP/s
    matmul_efficiency: float = Field(gt=0, le=1)  # fraction of peak a large matmul reaches
    mem_bandwidth_bytes_s: float = Field(gt=0)
    mem_bandwidth_efficiency: float = Field(gt=0, le=1)
    op_overhead_s: float = Field(ge=0)  # per-op launch / dispatch cost
    links: dict[Scope, Link]
    topology: Topology | None = None  # None: collectives without a fit go by `links`
    collectives: list[CollectiveFit] = Field(default_factory=list)
    matmul: MatmulShape | None = None  # None: every matmul at `matmul_efficiency`
    attention: list[AttentionRate] = Field(default_factory=list)  # empty: attention as a matmul
    overlap: Overlap = Field(default_factory=Overlap)
    optimizer_bytes_s: float | None = Field(default=None, gt=0)  # measured AdamW throughput, bytes of state touched
    # the optimizer step's fixed cost per parameter tensor (per-tensor kernels, DTensor dispatch)
    optimizer_tensor_s: float = Field(default=0.0, ge=0)
    first_touch_s_per_byte: float = Field(default=0.0, ge=0)
    """Seconds per byte of first writing a freshly mapped allocation of at least `first_touch_min_bytes`
    (the CPU: page faults and the kernel's zeroing; 0 where an allocator reuses its blocks, CUDA's).
    Charged for FSDP2's large gather and reduction buffers and the optimizer's large temporaries
    (cost_models/large_buffers.py)."""
    first_touch_min_bytes: int = Field(default=32 << 20, ge=0)
    """The allocation size from which memory is mapped fresh each time (glibc: 32 MiB at most)."""
    fsdp: FsdpOverhead = Field(default_factory=FsdpOverhead)
    loss_parallel: LossParallel | None = None  # None: no cost beyond the fused loss on 1/t of the logits
    tp_dispatch: TpDispatch | None = None  # None: a TP plan's modules cost as their ops (not measured: a GPU's)
    host_link: HostLink | None = None  # None: offload is not costed (the search does not offer it)
    op_times: list[OpTiming] = Field(default_factory=list)
    op_fits: list[OpFit] = Field(default_factory=list)
