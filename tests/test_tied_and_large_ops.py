"""Real vocabularies op by op: a tied weight's gradient sum (tracing.counting.summed_grad_params,
profiling.ops) and the fits over ops whose tensors are mapped fresh (profiling.fit, cost_models.compute)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autoplan
from autoplan.profile_store import load_profile
from autoplan.profiling.fit import OpPoint, fit_op_families
from autoplan.profiling.ops import collect_cases, measure_case, zoo_workload
from autoplan.profiling.timing import Repeats
from cost_models.compute import ComputeModel, largest_alloc_bytes
from cost_models.records import OpRecord, extrapolate_ops

ONCE = Repeats(0, 1, 1, 0.0)
MIB = 1 << 20


def _embedding_keys(model: str, tracer: str) -> list[str]:
    trace = autoplan.trace(model, seq_len=32, tracer=tracer).traces("bf16").at_1
    return [op.key for op in trace.ops if op.kind == "Embedding"]


def test_a_tied_embedding_is_keyed_apart_by_both_tracers():
    for tracer in ("fx", "dispatch"):
        tied = _embedding_keys("gpt2-tiny", tracer)
        untied = _embedding_keys("gpt2-tiny[tie_embeddings=False]", tracer)
        # the token embedding (first user of the tied weight) sums the LM head's gradient; positions do not
        assert tied[0].endswith("[grads summed: 1]") and not tied[1].endswith("]")
        assert tied[0] == untied[0] + "[grads summed: 1]" and tied[1] == untied[1]


class _Adds(TorchDispatchMode):
    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add.Tensor and tuple(args[0].shape) == self.shape:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_profiler_times_a_tied_embedding_with_the_gradient_sum_it_runs_in_a_model():
    cases = {case.record.name: case for case in collect_cases(zoo_workload("gpt2-tiny", (1,), 32), "fp32")}
    wte, head = cases["transformer_wte"], cases["lm_head"]
    assert len(wte.summed_params) == 1 and not head.summed_params
    for case, adds in ((wte, 1), (cases["transformer_wpe"], 0)):
        weight = case.target.weight
        with _Adds(weight.shape) as mode:
            measure_case(case, torch.device("cpu"), ONCE)
        # one timed backward (no warm-up), summing the pending gradient once
        assert mode.count == adds, case.key


def _op(kind: str, fwd_bytes: int, max_alloc: int) -> OpRecord:
    return OpRecord("x", kind, "", ((max_alloc // 4,),), "fp32", fwd_bytes=fwd_bytes, bwd_bytes=fwd_bytes,
                    fwd_max_alloc_bytes=max_alloc, bwd_live_bytes=max_alloc)


def test_ops_mapped_fresh_take_their_kinds_fit_over_large_points():
    points = [OpPoint("cross_entropy", "memory", "fp32", "fwd", 0, n, n / rate, n // 2)
              for n, rate in ((1 * MIB, 20e9), (4 * MIB, 20e9), (16 * MIB, 20e9), (64 * MIB, 6e9), (256 * MIB, 6e9))]
    fits = [report.fit for report in fit_op_families(points, 32 * MIB)]
    large = [fit for fit in fits if fit.min_alloc_bytes]
    # one per kind, none for the generic family (its large points would mix kinds)
    assert [(fit.family, fit.min_alloc_bytes) for fit in large] == [("cross_entropy", 32 * MIB)]
    assert abs(1 / large[0].s_per_unit - 6e9) / 6e9 < 0.01
    assert not [r for r in fit_op_families(points, None) if r.fit.min_alloc_bytes]  # a GPU profile: none
    profile = load_profile("cpu-gloo-2").model_copy(update={"op_times": [], "op_fits": fits})
    model = ComputeModel(profile, "fp32")
    small, big = _op("cross_entropy", 8 * MIB, 2 * MIB), _op("cross_entropy", 512 * MIB, 128 * MIB)
    assert abs(model.op_time_s(big, "fwd") - 512 * MIB / 6e9) / (512 * MIB / 6e9) < 0.02
    assert model.op_time_s(small, "fwd") < 8 * MIB / 15e9
    assert largest_alloc_bytes(big, "bwd") == 128 * MIB  # the held bytes, bounded by the forward's tensor


def test_the_shipped_cpu_profile_prices_a_32k_vocabulary_loss_as_measured():
    """cross_entropy over [3 x 128 x 32000] bf16 logits, timed alone on this project's machine (1 thread) with
    freed memory kept mapped, as apply's ranks run: 20 ms forward, 26 ms backward (42 and 58 with glibc's
    default malloc, which maps the 49 MB logits fresh each time); the fit over all points said 11 and 13."""
    model = ComputeModel(load_profile("cpu-gloo-2"), "bf16")
    pair = autoplan.trace("llama-tiny[n_layers=1,d_model=64,n_heads=2,n_kv_heads=1,ffn_hidden=128,vocab_size=32000]",
                          seq_len=128).traces("bf16")
    loss = next(op for op in extrapolate_ops(pair.at_1.ops, pair.at_2.ops, 3) if op.kind == "cross_entropy")
    # the fp32 logits are 49 MB: priced by the fits over ops of such sizes
    assert largest_alloc_bytes(loss, "fwd") >= 32 * MIB and largest_alloc_bytes(loss, "bwd") >= 32 * MIB
    assert 0.016 < model.op_time_s(loss, "fwd") < 0.026 and 0.02 < model.op_time_s(loss, "bwd") < 0.032
    assert all(fit.family not in ("matmul", "memory") for fit in model.profile.op_fits if fit.min_alloc_bytes)
