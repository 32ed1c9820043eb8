"""FLOPs per aten op: torch's FlopCounter registry, formulas registered for the ops it lacks, and the ops
no formula prices.

torch.utils.flop_counter counts matmuls, convolutions and attention kernels. Ops it has no formula for
are memory-bound (elementwise, reductions, copies, indexing, norms: priced by the bytes they move) or
they are not, and then a count of 0 would make them free. So:
- `aten._grouped_mm` (mixture-of-experts experts: one matmul per expert over its rows, the groups given
  by offsets) gets a formula here, registered in torch's own registry;
- any other op without a formula that is not a view, not tagged pointwise or reduction by torch, and not
  one of the memory-bound families below is *unpriced*: the trace keeps its name and a guess of its work
  (2 x output elements x the largest size an input has that the output lacks: a matmul's contraction), and the
  plan and the report list it. Its time is not priced; the guess only says how much may be missing.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["EFFICIENT", "FLASH_CPU", "FLASH_CPU_BWD", "GROUPED_MM", "MATMUL_OPS", "aten_flops", "unpriced_guess"]

_aten = torch.ops.aten
FLASH_CPU = _aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
EFFICIENT = _aten._scaled_dot_product_efficient_attention.default
GROUPED_MM = _aten._grouped_mm

MATMUL_OPS = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.matmul, _aten.convolution, _aten._grouped_mm,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention_for_cpu_backward,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_efficient_attention_backward, _aten.convolution_backward,
}


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Each group is a matmul (m_g x k_g) @ (k_g x n_g); summed over the groups the count is 2 x the output's
    elements x the contraction, except 2-D x 2-D, which groups the contraction itself (a weight gradient:
    output [groups, m, n], contraction summed over the groups)."""
    out = 1
    for dim in out_shape:
        out *= dim
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * (out // out_shape[0]) * a_shape[-1]
    return 2 * out * a_shape[-1]


if _aten._grouped_mm not in flop_registry:
    register_flop_formula(_aten._grouped_mm)(_grouped_mm_flop)


def _kv_heads_widened(func, args: tuple) -> tuple:
    """An attention op's arguments with key and value widened to the query's heads (grouped-query attention:
    each query head reads its group's key/value head, so the FLOPs are those of the widened op). Older torch's
    formulas (2.11) assert equal heads; 2.13's count the groups themselves, the same figure."""
    name = func._overloadpacket.__name__
    at = 1 if "backward" in name else 0  # backward ops take the output's gradient first
    heads = 2 if name.startswith(("_flash_attention", "_efficient_attention")) else 1  # [b, s, h, d] or [b, h, s, d]
    if len(args) < at + 3:
        return args
    query, key, value = args[at:at + 3]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return args
    h_q, h_kv = query.shape[heads], key.shape[heads]
    if h_kv == h_q or h_kv == 0 or h_q % h_kv:
        return args

    def widened(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[heads] = h_q
        return torch.empty(shape, dtype=t.dtype, device="meta")

    return (*args[:at + 1], widened(key), widened(value), *args[at + 3:])


def aten_flops(func, args, kwargs, out) -> int:
    """torch's FLOP count of one aten op (0 where it has no formula)."""
    if func is FLASH_CPU:
        query, key, value = _kv_heads_widened(func, args)[:3]
        return sdpa_flop_count(query.shape, key.shape, value.shape)
    if func is FLASH_CPU_BWD:
        grad_out, query, key, value = _kv_heads_widened(func, args)[:4]
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    counter = flop_registry.get(func._overloadpacket)
    if counter is None:
        return 0
    if "attention" in func._overloadpacket.__name__:
        args = _kv_heads_widened(func, args)
    return int(counter(*args, **(kwargs or {}), out_val=out))


# memory-bound families without a FLOP formula (by the op's name without overload): embeddings, norms,
# softmax and losses, copies and creation, indexing, sorting, concatenation, dropout's random masks
_MEMORY_BOUND = {
    "embedding", "embedding_dense_backward", "_softmax", "_softmax_backward_data", "_log_softmax",
    "_log_softmax_backward_data", "_safe_softmax", "native_layer_norm", "native_layer_norm_backward",
    "_fused_rms_norm", "_fused_rms_norm_backward", "native_group_norm", "native_group_norm_backward",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "sort", "topk",
    "cumsum", "cumprod", "histc", "bincount", "index", "index_put", "index_put_", "_index_put_impl_",
    "index_select", "index_add", "index_add_", "index_copy", "gather", "scatter", "scatter_add", "scatter_add_",
    "scatter_", "scatter_reduce", "masked_scatter", "masked_select", "cat", "stack", "split", "split_with_sizes",
    "unbind", "chunk", "_to_copy", "copy_", "copy", "clone", "contiguous", "fill_", "fill", "zero_", "zeros",
    "zeros_like", "ones", "ones_like", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "new_zeros", "new_ones", "full", "full_like", "new_full", "arange", "scalar_tensor", "lift_fresh", "one_hot",
    "repeat", "repeat_interleave", "roll", "flip", "tril", "triu", "argmax", "argmin", "max", "min", "amax",
    "amin", "logsumexp", "native_dropout", "native_dropout_backward", "bernoulli", "bernoulli_", "rand", "randn",
    "randint", "uniform_", "normal_", "nonzero", "unique", "_unique2", "bucketize", "searchsorted",
    "slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter", "slice_backward",
    "select_backward", "index_select_backward", "_unsafe_index", "_unsafe_index_put", "constant_pad_nd",
    "pad", "unfold", "unfold_backward", "im2col", "col2im", "upsample_nearest2d", "upsample_bilinear2d",
    "_local_scalar_dense", "item", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "count_nonzero",
    "_assert_async", "_assert_tensor_metadata", "set_", "resize_", "detach", "alias", "_unsafe_view",
    "expand_copy", "view_copy", "permute_copy", "t_copy", "transpose_copy", "squeeze_copy", "unsqueeze_copy",
    "all", "any", "equal", "is_nonzero", "linalg_vector_norm", "norm", "std", "var", "var_mean", "std_mean",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "cudnn_batch_norm",
    "cudnn_batch_norm_backward", "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d",
    "avg_pool2d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "sum", "mean", "prod",
    "_foreach_add", "_foreach_mul", "_pdist_forward", "_cdist_forward", "_weight_norm_interface",
    "_fused_adam", "_fused_adamw", "floor_divide", "remainder", "fmod", "bitwise_and", "bitwise_or", "lt", "le", "gt",
    "ge", "eq", "ne", "logical_not", "logical_and", "logical_or", "clamp", "where", "polar", "view_as_complex",
    "view_as_real", "complex", "argsort",
}
_TAGS = (torch.Tag.pointwise, torch.Tag.reduction)


def unpriced_guess(func, args, kwargs, outputs: list[torch.Tensor]) -> int | None:
    """None for an op that is priced (it has a FLOP formula) or memory-bound; else a guess of its FLOPs."""
    if func in (FLASH_CPU, FLASH_CPU_BWD) or func._overloadpacket in flop_registry or func.is_view:
        return None
    if any(tag in func.tags for tag in _TAGS) or func._overloadpacket.__name__ in _MEMORY_BOUND:
        return None
    if not outputs:
        return None
    inputs = [t for t in list(args) + list((kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    out_dims = Counter(outputs[0].shape)
    # an input's sizes the output does not have (counted with repeats): a matmul's contraction
    contracted = max((d for t in inputs for d in (Counter(t.shape) - out_dims).elements()), default=1)
    return 2 * sum(t.numel() for t in outputs) * contracted
