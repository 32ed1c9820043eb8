"""What each checkpoint mode keeps from a block's forward for its backward, measured, against the cost model.

A block of a tiny model runs its forward and backward on the CPU with its checkpoint mode applied as
`autoplan apply` applies it (autoplan.run.ac.apply_ac); the live tensor storages are counted around its
forward (autoplan.run.memtrack). What the forward leaves alive, less its output, plus its input (alive
before, and kept by every mode), is what the block keeps for its backward: the figure the cost model
predicts as `activation_keep_bytes` (and, unchecked, the ops' saved bytes).
"""

import pytest
import torch

from autoplan.models.zoo import build_model, get_config
from autoplan.run.ac import apply_ac, saved_by_selective_ops, selective_policy
from autoplan.run.memtrack import LiveTensorTracker
from autoplan.tracing.attention import AttentionPolicy
from autoplan.tracing.fx_tracer import trace_model
from autoplan.tracing.trace_options import TraceOptions
from autoplan.tracing.units import build_units
from cost_models.activations import activation_keep_bytes
from cost_models.options import CHECKPOINT_MODES, CheckpointMode, Recompute, registered

BATCH, SEQ = 2, 32


def kept_by_block(model_name: str, block: str, mode: str) -> tuple[int, torch.Tensor]:
    """Bytes the block keeps from its forward to its backward in `mode`, and the loss's gradient of the
    input ids' embedding (to compare the modes' numerics)."""
    torch.manual_seed(0)
    model = build_model(get_config(model_name), device="cpu")
    module = model.get_submodule(block)
    apply_ac(module, CHECKPOINT_MODES[mode])
    tracker, seen = LiveTensorTracker(), {}

    def before(_, args, kwargs):
        seen.setdefault("before", tracker.live_bytes)  # the first call: a checkpoint's recompute calls it again
        seen.setdefault("input", args[0].untyped_storage().nbytes())

    def after(_, args, kwargs, output):
        seen.setdefault("after", tracker.live_bytes)
        seen.setdefault("output", output.untyped_storage().nbytes())

    module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    module.register_forward_hook(after, with_kwargs=True)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with tracker:
        tracker.track(*model.parameters(), *model.buffers())
        model(ids).float().pow(2).mean().backward()
    kept = seen["after"] - seen["before"] - seen["output"] + seen["input"]
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return kept, grads


def predicted_keep(model_name: str, block: str) -> dict[Recompute, int]:
    model = build_model(model_name)
    cpu_kernels = TraceOptions(attention=AttentionPolicy(device="cpu"))  # the kernels of this run
    trace = trace_model(model, BATCH, SEQ, "fp32", options=cpu_kernels)
    units = build_units(model, trace)
    index = [unit.path for unit in units].index(block)
    unit = units[index]
    predicted = {mode: activation_keep_bytes(trace, units, mode)[index]
                 for mode in (Recompute.CHEAP, Recompute.ALTERNATE, Recompute.ALL)}
    # not checkpointed: every activation its ops saved (and the input, which its first norm saves)
    predicted[Recompute.NOTHING] = sum(trace.op(name).saved_bytes for name in unit.ops)
    return predicted


@pytest.mark.parametrize(("model_name", "block"), [("llama-tiny", "layers.1"), ("gpt2-tiny", "transformer.h.1")])
def test_selective_keeps_less_than_none_and_more_than_full_as_the_cost_model_says(model_name, block):
    measured = {mode: kept_by_block(model_name, block, mode) for mode in CHECKPOINT_MODES}
    kept = {CHECKPOINT_MODES[mode].recompute: value for mode, (value, _) in measured.items()}
    assert kept[Recompute.ALL] < kept[Recompute.ALTERNATE] < kept[Recompute.CHEAP] < kept[Recompute.NOTHING]
    predicted = predicted_keep(model_name, block)
    for recompute, value in kept.items():
        assert value == pytest.approx(predicted[recompute], rel=0.02), recompute
    # recomputation changes what is kept, never the numbers
    reference = measured["none"][1]
    for _, grads in measured.values():
        torch.testing.assert_close(grads, reference, rtol=1e-5, atol=1e-7)


def test_selective_keep_of_a_llama_block_counted_by_hand():
    # llama-tiny: d_model 64, 4 heads of 16, 2 kv heads, ffn 176; batch 2 x seq 32, fp32 (4 bytes)
    tokens, word = BATCH * SEQ, 4
    by_hand = tokens * word * (
        64  # the block's input (the checkpoint's)
        + 64 + 32 + 32  # wq, wk, wv outputs (mm)
        + 64 + 4  # attention: its output and the log-sum-exp per head and position (fp32)
        + 64  # wo
        + 176 + 176 + 64  # w1, w3, w2
    )
    measured, _ = kept_by_block("llama-tiny", "layers.1", "selective")
    assert measured == by_hand == predicted_keep("llama-tiny", "layers.1")[Recompute.CHEAP]


def test_torchtitans_selective_op_keep_of_a_llama_block_counted_by_hand():
    # every other matmul's output, the 1st, 3rd, ...: wq, wv, w1, w2 kept; wk, wo, w3 recomputed
    tokens, word = BATCH * SEQ, 4
    by_hand = tokens * word * (
        64  # the block's input
        + 64 + 32  # wq, wv
        + 64 + 4  # attention: its output and the log-sum-exp
        + 176 + 64  # w1, w2
    )
    measured, _ = kept_by_block("llama-tiny", "layers.1", "selective_op")
    assert measured == by_hand == predicted_keep("llama-tiny", "layers.1")[Recompute.ALTERNATE]


def test_a_new_checkpoint_row_runs_by_its_recompute_property():
    with registered(CheckpointMode("sel2", Recompute.CHEAP, "+sel2")):
        assert kept_by_block("llama-tiny", "layers.1", "sel2")[0] == kept_by_block("llama-tiny", "layers.1",
                                                                                    "selective")[0]


def test_policy_keeps_matmuls_attention_and_collectives_only():
    ops = torch.ops
    assert {ops.aten.mm, ops.aten.addmm, ops.aten._scaled_dot_product_flash_attention_for_cpu,
            ops._c10d_functional.reduce_scatter_tensor} <= saved_by_selective_ops()
    assert selective_policy(None, ops.aten.mm.default).name == "MUST_SAVE"
    for cheap in (ops.aten.silu.default, ops.aten.mul.Tensor, ops.aten.add.Tensor, ops.aten._softmax.default):
        assert selective_policy(None, cheap).name == "PREFER_RECOMPUTE"
