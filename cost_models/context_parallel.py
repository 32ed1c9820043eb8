"""Context parallelism: what one rank of a context-parallel group runs, holds and sends.

Under context parallelism of degree c each sequence is split over c ranks and every attention call runs
as ring attention (torch.distributed.tensor.experimental.context_parallel, as torchtitan runs it):

- **Work and activations divide by c.** Every op but attention works token by token, so a rank runs
  1/c of its FLOPs and holds 1/c of its activations. Attention is causal, and the sequence is cut into
  2c chunks, rank r holding chunks r and 2c - 1 - r (torch's head-tail load balancer), so that each
  rank's queries meet the same number of unmasked keys: 1/c of the causal attention's work each.
  Parameters and their gradients are whole on every rank (FSDP shards them over data x context
  parallel ranks: cost_models.mesh.Mesh.fsdp_ranks).
- **Keys and values travel.** torch 2.13's ring gathers the other ranks' K/V shards with one all-gather
  per attention call in the forward (its default rotate method, "allgather"; the c - 1 ring steps then
  read from it), and again in the backward, where the gradients of K and V travel the ring in fp32:
  c permutes (send to the next rank, receive from the previous) of the K/V shard's gradient. The
  all-gather overlaps the first ring step (the rank's own chunks: 1/c of its attention); each permute
  overlaps the next step's attention (1/c of it again), the last one is waited for at once. Only what
  the attention does not hide is added to the step (`ring_exposed_s`), on the interconnect the group
  spans (inside a node while c x tp ranks fit one: `Mesh.cp_scope`).
- **The ring's own kernels.** Each ring step's output is merged into the running one in fp32 (a cast, then
  about eight passes over the output: torch's `_SDPAMerger`), a step on half the queries copies the output
  whole to update half of it (`_partial_update`), and each step concatenates K and V to send them; the
  backward accumulates dq, dk and dv in fp32 and concatenates dK/dV for each permute. These run on the
  compute stream between the attention kernels, memory-bound: `ring_merge_bytes` counts what they read and
  write (from torch 2.13's code), priced at the profile's memory bandwidth, not hidden.
- **The ring's buffers.** An attention call holds the gathered K/V (c shards) and fp32 copies of its
  output and log-sum-exp while it merges the steps; its backward the gathered K/V, fp32 gradients of
  q, k and v, and two fp32 K/V-gradient buffers in flight (`ring_buffers`).

The search treats a degree as a transform of the table inputs (autoplan.solve.context_tables), the
way tensor parallelism is one; this module imports nothing from autoplan and nothing from torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from cost_models.comm import CommModel
from cost_models.records import OpRecord

__all__ = ["RingTime", "cp_op", "cp_ops", "is_ring_attention", "kv_shard_bytes", "ring_buffers", "ring_exposed_s",
           "ring_merge_bytes"]

_BYTE_FIELDS = ("out_bytes", "fwd_bytes", "bwd_bytes", "saved_bytes", "fwd_max_alloc_bytes", "fwd_transient_bytes",
                "bwd_in_bytes", "bwd_live_bytes")
_FP32 = 4
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "bfloat16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp64": 8, "float64": 8}


def is_ring_attention(op: OpRecord) -> bool:
    """Whether the op is an attention call that context parallelism runs as ring attention (SDPA, causal)."""
    return op.kind == "scaled_dot_product_attention" and "is_causal=True" in op.variant


def _elem(op: OpRecord) -> int:
    return _DTYPE_BYTES.get(op.dtype, 2)


def kv_shard_bytes(op: OpRecord, cp: int) -> int:
    """One rank's K and V of an attention call (the traced op's, whole sequence): 1/c of them."""
    k, v = op.input_shapes[1], op.input_shapes[2]
    return -(-(prod(k) + prod(v)) * _elem(op) // cp)


def ring_buffers(op: OpRecord, cp: int) -> tuple[int, int]:
    """(forward, backward) bytes the ring holds beyond the kernel's own while one attention call runs on a
    rank (see the module docstring): the gathered K/V and fp32 output and log-sum-exp forward; the gathered
    K/V, fp32 gradients of q, k, v and two fp32 K/V-gradient buffers backward."""
    kv = kv_shard_bytes(op, cp)
    q = -(-prod(op.input_shapes[0]) * _elem(op) // cp)
    q_shape = op.input_shapes[0]
    lse = -(-prod(q_shape[:-1]) * _FP32 // cp)
    to_fp32 = _FP32 // _elem(op) if _elem(op) < _FP32 else 1
    forward = cp * kv + q * to_fp32 + lse
    backward = cp * kv + (q + kv) * to_fp32 + 2 * kv * to_fp32
    return forward, backward


def ring_merge_bytes(op: OpRecord, cp: int) -> tuple[int, int]:
    """(forward, backward) bytes the ring's own kernels read and write on a rank for one attention call (see the
    module docstring): forward, per step after the first, the merge (about 8 passes over the fp32 output,
    partial steps' whole copy averaged in) and the K/V concatenation (read and write), plus the casts of the
    first and the final output; backward, per step, dq's accumulation and partial update (3.5 passes over
    fp32 q) and dk/dv's (5.5 passes over fp32 K/V: accumulation, partial update, concatenation to send), plus
    the K/V concatenation per step after the first."""
    if cp == 1:
        return 0, 0
    q_shape, v_shape = op.input_shapes[0], op.input_shapes[2]
    out32 = -(-prod(q_shape[:-1]) * v_shape[-1] * _FP32 // cp)
    q32 = -(-prod(q_shape) * _FP32 // cp)
    kv = kv_shard_bytes(op, cp)
    kv32 = kv * max(1, _FP32 // _elem(op))
    forward = (cp - 1) * (8 * out32 + 2 * kv) + 3 * out32
    backward = cp * (7 * q32 + 11 * kv32) // 2 + (cp - 1) * 2 * kv
    return forward, backward


def cp_op(op: OpRecord, cp: int) -> OpRecord:
    """The op as one rank of the group runs it: FLOPs and activation bytes 1/c (parameter gradients whole),
    and for a ring-attention call the ring's buffers on top of its transients."""
    if cp == 1:
        return op
    new = OpRecord.__new__(OpRecord)
    new.__dict__.update(op.__dict__)
    for name in _BYTE_FIELDS + ("fwd_flops", "bwd_flops", "unpriced_flops"):
        new.__dict__[name] = -(-getattr(op, name) // cp)
    new.variant = f"{op.variant}[cp 1/{cp}]"
    if is_ring_attention(op):
        forward, backward = ring_buffers(op, cp)
        new.fwd_transient_bytes += forward
        new.fwd_max_alloc_bytes = max(new.fwd_max_alloc_bytes, cp * kv_shard_bytes(op, cp))
        new.bwd_live_bytes += backward
    return new


def cp_ops(ops: list[OpRecord], cp: int) -> list[OpRecord]:
    return [cp_op(op, cp) for op in ops]


@dataclass(frozen=True)
class RingTime:
    """One attention call's ring traffic, in seconds, and the part its attention does not hide."""

    gather_s: float  # the K/V all-gather (forward, and again backward)
    permute_s: float  # one fp32 K/V-gradient send/receive (backward, c per call)
    fwd_exposed_s: float
    bwd_exposed_s: float


def ring_exposed_s(op: OpRecord, cp: int, comm: CommModel, scope: str, attention_s: tuple[float, float],
                   bandwidth: float = 0.0) -> RingTime:
    """The ring's collectives of one attention call (the traced op; `attention_s` the rank's forward and backward
    attention time) and what of them is exposed: the all-gather beyond the first ring step's attention
    (1/c of it), forward and backward; each but the last gradient permute beyond one step's backward
    attention, the last one whole; and the ring's own kernels (`ring_merge_bytes` at `bandwidth` bytes/s)."""
    if cp == 1:
        return RingTime(0.0, 0.0, 0.0, 0.0)
    kv = kv_shard_bytes(op, cp)
    gather = comm.collective_s("all_gather", cp * kv, cp, scope)
    grad_kv = kv * max(1, _FP32 // _elem(op))
    permute = comm.collective_s("all_gather", 2 * grad_kv, 2, scope)  # a 2-rank all-gather sends and receives one
    fwd_step, bwd_step = attention_s[0] / cp, attention_s[1] / cp
    merge_fwd, merge_bwd = (b / bandwidth for b in ring_merge_bytes(op, cp)) if bandwidth else (0.0, 0.0)
    fwd = max(0.0, gather - fwd_step) + merge_fwd
    bwd = max(0.0, gather - bwd_step) + (cp - 1) * max(0.0, permute - bwd_step) + permute + merge_bwd
    return RingTime(gather, permute, fwd, bwd)
