"""Memory and time model checked against numbers computed by hand."""

import pytest
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.zoo import build_model, count_params
from autoplan.solve.cluster import resolve_cluster
from autoplan.solve.solver import solve_min_time
from autoplan.solve.tables import CostTables
from cost_models.evaluate import evaluate, uniform_choices


@pytest.fixture(scope="module")
def tiny_gpt2_trace():
    model = build_model("gpt2-tiny")
    return model, CostTables(model, seq_len=64, compute_dtype="fp32", granularity="block")


def _table(traced, gpus, micro_batch=2, dtype="bf16-mixed", optimizer="adamw"):
    cluster = resolve_cluster(gpus, None, None, "a100-sxm4-80gb")
    return traced.table(micro_batch, 1, cluster, 64, dtype, optimizer)


def _step_point(result):
    return next(p for p in result.points if p.label == "optimizer step")


def test_all_shard_persistent_bytes_are_exactly_a_world_fraction(tiny_gpt2_trace):
    # every gpt2-tiny parameter's first dimension is even: FSDP2 pads nothing over 2 ranks
    model, traced = tiny_gpt2_trace
    n_params = count_params(model)
    table = _table(traced, gpus=2)
    parts = _step_point(evaluate(table, uniform_choices(table, "shard", False))).parts
    # fp32 master params (4 B) + fp32 grads (4 B) + AdamW's two fp32 states (8 B), over 2 ranks
    assert parts["params"] == n_params * 4 // 2
    assert parts["grads"] == n_params * 4 // 2
    assert parts["optimizer"] == n_params * 8 // 2
    assert parts["params"] + parts["grads"] + parts["optimizer"] == n_params * 16 // 2


def test_all_replicate_holds_everything_and_pure_bf16_halves_it(tiny_gpt2_trace):
    model, traced = tiny_gpt2_trace
    n_params = count_params(model)
    table = _table(traced, gpus=2)
    parts = _step_point(evaluate(table, uniform_choices(table, "replicate", False))).parts
    assert parts["params"] + parts["grads"] + parts["optimizer"] == n_params * 16
    bf16 = _table(traced, gpus=2, dtype="bf16")
    parts = _step_point(evaluate(bf16, uniform_choices(bf16, "replicate", False))).parts
    assert parts["params"] + parts["grads"] + parts["optimizer"] == n_params * 8
    sgd = _table(traced, gpus=2, optimizer="sgd")
    parts = _step_point(evaluate(sgd, uniform_choices(sgd, "replicate", False))).parts
    assert parts["optimizer"] == 0


def test_padding_follows_fsdp2_dim0_chunks(tiny_gpt2_trace):
    # over 3 ranks, a (512, 64) embedding holds ceil(512/3) = 171 rows per rank
    _, traced = tiny_gpt2_trace
    table = _table(traced, gpus=3)
    shard = uniform_choices(table, "shard", False)
    expected = sum(-(-(p.shape or (1,))[0] // 3) * max(1, p.numel // (p.shape or (1,))[0])
                   for unit in table.units for p in unit.params)
    assert sum(table.costs[u][c].local_numel for u, c in enumerate(shard)) == expected


def test_checkpointing_keeps_less_and_recomputes(tiny_gpt2_trace):
    _, traced = tiny_gpt2_trace
    table = _table(traced, gpus=2, micro_batch=4)
    plain = evaluate(table, uniform_choices(table, "shard", False))
    ckpt = evaluate(table, uniform_choices(table, "shard", True))
    fwd_end = lambda r: max(p.parts["activations"] for p in r.points)  # noqa: E731
    assert fwd_end(ckpt) < fwd_end(plain)
    assert ckpt.step_time_s > plain.step_time_s
    block = next(u for u, unit in enumerate(table.units) if unit.path == "transformer.h.0")
    costs = {o.label: c for o, c in zip(table.options[block], table.costs[block])}
    assert costs["shard+ckpt"].bwd_s == pytest.approx(costs["shard"].bwd_s + costs["shard"].fwd_s)


def test_activations_scale_linearly_with_micro_batch(tiny_gpt2_trace):
    _, traced = tiny_gpt2_trace
    acts = []
    for micro_batch in (1, 2, 4):
        table = _table(traced, gpus=2, micro_batch=micro_batch)
        result = evaluate(table, uniform_choices(table, "shard", False))
        acts.append(max(p.parts["activations"] for p in result.points))
    assert acts[2] - acts[1] == 2 * (acts[1] - acts[0])


def test_solver_objective_is_the_cost_model_prediction(tiny_gpt2_trace):
    _, traced = tiny_gpt2_trace
    table = _table(traced, gpus=2, micro_batch=4)
    shard = evaluate(table, uniform_choices(table, "shard", False))
    result = solve_min_time(table, shard.peak_mem_bytes)
    chosen = evaluate(table, result.choices)
    assert result.status == "OPTIMAL"
    assert chosen.step_time_s == pytest.approx(result.objective, abs=1e-8)
    assert chosen.peak_mem_bytes <= shard.peak_mem_bytes
    assert chosen.step_time_s <= shard.step_time_s + 1e-9


def _with_profile(cluster, **changes):
    from dataclasses import replace

    return replace(cluster, profile=cluster.profile.model_copy(update=changes, deep=True))


def test_fsdp_unit_overhead_and_per_tensor_optimizer_cost_add_per_unit(tiny_gpt2_trace):
    from cost_models.profile import FsdpOverhead
    from cost_models.step import unit_step_s

    _, traced = tiny_gpt2_trace
    cluster = resolve_cluster(2, None, None, "a100-sxm4-80gb")
    bare = _with_profile(cluster, fsdp=FsdpOverhead(), optimizer_tensor_s=0.0)
    loaded = _with_profile(cluster, fsdp=FsdpOverhead(unit_fwd_s=1e-3, unit_bwd_s=2e-3), optimizer_tensor_s=1e-4)
    base = traced.table(2, 1, bare, 64, "bf16-mixed", "adamw")
    more = traced.table(2, 1, loaded, 64, "bf16-mixed", "adamw")
    for unit in range(len(base.units)):
        for option, (a, b) in enumerate(zip(unit_step_s(base, unit), unit_step_s(more, unit))):
            tensors = len(base.units[unit].params)  # a checkpointed unit's recompute adds no unit cost
            assert b - a == pytest.approx(1e-3 + 2e-3 + tensors * 1e-4)


def test_compute_scales_stretch_ops_and_recompute_not_collectives(tiny_gpt2_trace):
    from cost_models.profile import FsdpOverhead

    _, traced = tiny_gpt2_trace
    # no launch cost: the tiny model's ops would be bound by the CPU issuing them, which no scale stretches
    cluster = _with_profile(resolve_cluster(2, None, None, "a100-sxm4-80gb"), op_overhead_s=0.0)
    base = traced.table(2, 1, _with_profile(cluster, fsdp=FsdpOverhead()), 64, "bf16-mixed", "adamw")
    scaled = traced.table(2, 1, _with_profile(cluster, fsdp=FsdpOverhead(compute_fwd_scale=1.5, compute_bwd_scale=1.2)),
                          64, "bf16-mixed", "adamw")
    for unit in range(len(base.units)):
        plain = next(c for c, o in zip(base.costs[unit], base.options[unit]) if o.checkpoint == "none")
        for option, (a, b) in enumerate(zip(base.costs[unit], scaled.costs[unit])):
            assert b.fwd_s == pytest.approx(1.5 * a.fwd_s)
            # without a scale of its own, the recomputed forward runs at the backward's
            mode = base.options[unit][option].checkpoint
            recompute_s = plain.fwd_s if mode == "full" else 0.0
            assert b.bwd_s == pytest.approx(1.2 * a.bwd_s)
            if mode in ("selective", "selective_op"):  # re-runs only the ops it does not keep: between none and full
                assert plain.bwd_s < a.bwd_s < plain.bwd_s + plain.fwd_s
            else:
                assert a.bwd_s == pytest.approx(plain.bwd_s + recompute_s)
            assert (b.comm_fwd_s, b.comm_bwd_s) == (a.comm_fwd_s, a.comm_bwd_s)
    # a profile calibrated on checkpointed steps gives the recompute its own scale
    own = traced.table(2, 1, _with_profile(cluster, fsdp=FsdpOverhead(
        compute_fwd_scale=1.5, compute_bwd_scale=1.2, compute_recompute_scale=2.0)), 64, "bf16-mixed", "adamw")
    for unit in range(len(base.units)):
        plain = next(c for c, o in zip(base.costs[unit], base.options[unit]) if o.checkpoint == "none")
        for option, (a, c) in enumerate(zip(base.costs[unit], own.costs[unit])):
            if base.options[unit][option].checkpoint in ("selective", "selective_op"):
                continue
            recompute_s = plain.fwd_s if base.options[unit][option].checkpoint == "full" else 0.0
            assert c.bwd_s == pytest.approx(1.2 * plain.bwd_s + 2.0 * recompute_s)


def test_without_overlap_compute_and_communication_add_up(tiny_gpt2_trace):
    from cost_models.profile import FsdpOverhead, Overlap
    from cost_models.step import unit_step_s

    _, traced = tiny_gpt2_trace
    cluster = resolve_cluster(2, None, None, "a100-sxm4-80gb")
    serial = _with_profile(cluster, fsdp=FsdpOverhead(), optimizer_tensor_s=0.0,
                           overlap=Overlap(enabled=False, compute_slowdown=1.5, comm_slowdown=2.0))
    table = traced.table(2, 1, serial, 64, "bf16-mixed", "adamw")
    assert not table.overlap_enabled
    for unit in range(len(table.units)):
        for option, cost in enumerate(table.costs[unit]):
            expected = (cost.fwd_s + cost.bwd_s + cost.comm_fwd_s + cost.comm_bwd_s + cost.overhead_fwd_s
                        + cost.overhead_bwd_s + cost.optimizer_s)
            assert unit_step_s(table, unit)[option] == pytest.approx(expected)
    # the slowdowns of concurrent compute and communication do not apply when nothing runs concurrently
    plain = traced.table(2, 1, _with_profile(cluster, fsdp=FsdpOverhead(), optimizer_tensor_s=0.0,
                                             overlap=Overlap(enabled=False)), 64, "bf16-mixed", "adamw")
    assert [[c.fwd_s for c in u] for u in table.costs] == [[c.fwd_s for c in u] for u in plain.costs]


def test_backward_holds_the_previous_units_reduction_input(tiny_gpt2_trace):
    # FSDP2 keeps a unit's reduce-scatter input alive until the next unit's post-backward frees it
    # (reduce_scatter_max_input_buffers=1): the backward of h.0 holds h.1's, measured with
    # autoplan.memtrack on 2 gloo ranks. The reduce point of h.0 holds only its own.
    _, traced = tiny_gpt2_trace
    table = _table(traced, gpus=2, micro_batch=4)
    for checkpoint in (False, True):
        choices = uniform_choices(table, "shard", checkpoint)
        points = {p.label: p.parts for p in evaluate(table, choices).points}
        index = {unit.path: u for u, unit in enumerate(table.units)}
        cost = {path: table.costs[u][choices[u]] for path, u in index.items()}
        seg = next(s for s in table.segments if s.unit == index["transformer.h.0"])
        peak = seg.bwd_peak_checkpointed if checkpoint else seg.bwd_peak
        assert points["bwd transformer.h.0"]["temporaries"] == (
            peak.temporaries + seg.outer_grad_bytes + cost["transformer.h.1"].reduce_buffer_bytes)
        running = cost["transformer.h.0"].unsharded_grad_bytes + cost[""].unsharded_grad_bytes
        assert points["reduce transformer.h.0"]["temporaries"] == (
            running + cost["transformer.h.0"].reduce_buffer_bytes)
    # nothing is reduced before the last block's backward
    blocks = [unit.path for unit in table.units if unit.path.startswith("transformer.h.")]
    last = max(blocks, key=lambda path: int(path.rsplit(".", 1)[1]))
    seg = next(s for s in table.segments if s.unit == index[last])
    assert points[f"bwd {last}"]["temporaries"] == seg.bwd_peak_checkpointed.temporaries + seg.outer_grad_bytes


class Mlp(nn.Module):
    """embed -> up (8 -> 32) -> gelu -> down (32 -> 8) -> head (8 -> 16); traced in bf16 at micro-batch 2,
    sequence 4, a [2, 4, 8] activation is 128 bytes and a [2, 4, 32] one 512."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32, bias=False)
        self.down = nn.Linear(32, 8, bias=False)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        return self.head(self.down(F.gelu(self.up(self.embed(ids)))))


def test_tracer_follows_the_backwards_gradients_and_parameter_gradients():
    from autoplan.tracing.fx_tracer import trace_model

    ops = {op.name: op for op in trace_model(Mlp(), 2, 4, "bf16").ops}
    # the loss's scalar gradient (4 bytes) lives through the whole backward
    # down: receives d(down out) [2,4,8] and produces d(gelu out) [2,4,32]; its weight gradient apart
    assert (ops["down"].bwd_in_bytes, ops["down"].bwd_live_bytes, ops["down"].param_grad_bytes) == (
        4 + 128, 4 + 128 + 512, 32 * 8 * 2)
    # gelu: d(down out) is consumed by then; receives d(gelu out), produces d(up out)
    assert (ops["gelu"].bwd_in_bytes, ops["gelu"].bwd_live_bytes, ops["gelu"].param_grad_bytes) == (
        4 + 512, 4 + 512 + 512, 0)
    assert (ops["up"].saved_bytes, ops["gelu"].saved_bytes, ops["down"].saved_bytes) == (128, 512, 512)


def test_backward_peak_frees_each_ops_saved_activations_once_its_backward_ran():
    from autoplan.tracing.fx_tracer import trace_model
    from cost_models.activations import BackwardPeak, Segment, backward_peak, backward_points

    ops = trace_model(Mlp(), 2, 4, "bf16").ops
    assert [op.name for op in ops] == ["embed", "up", "gelu", "down", "head", "loss"]
    owners = [0, 1, 1, 1, 0, 0]  # a unit of up, gelu and down inside the root
    seg = Segment(1, 1, 3, saved_bytes=128 + 512 + 512, fwd_temp_bytes=512)
    points = dict(backward_points(ops, owners, seg, checkpointed=False))
    down_grad, up_grad = 32 * 8 * 2, 8 * 32 * 2
    # down: every saved activation (x, up's output, gelu's output) alive, gradients in flight
    assert points["down"] == BackwardPeak(128 + 512 + 512, 4 + 128 + 512 + down_grad)
    # gelu: down's backward freed gelu's output it saved; d(up out) is being produced
    assert points["gelu"] == BackwardPeak(128 + 512, 4 + 512 + 512 + down_grad)
    assert points["up"] == BackwardPeak(128, 4 + 512 + 128 + down_grad + up_grad)
    assert backward_peak(ops, owners, seg, False) == points["down"]
    # the coarse charge (all saved + twice the largest gradient + all unit gradients) was 3200 bytes
    assert points["down"].total == 2308 < (128 + 512 + 512) + 2 * 512 + down_grad + up_grad
    # checkpointed: recomputed in down's backward (the last op that saves), with d(down out) alive;
    # the recomputation's forward holds no more than the backward of down
    checkpointed = dict(backward_points(ops, owners, seg, checkpointed=True))
    assert checkpointed["recompute down"] == BackwardPeak(128 + 512 + 512, 4 + 128 + 128)
    assert backward_peak(ops, owners, seg, True) == points["down"]


def test_the_loss_runs_with_nothing_gathered(tiny_gpt2_trace):
    # apply() passes reshard_after_forward explicitly, so FSDP2 reshards the root after its forward too;
    # the loss's forward and backward come between the model's forward and the root's pre-backward
    # all-gather (and the prefetch of the last block). Measured with autoplan.memtrack on 2 gloo ranks.
    _, traced = tiny_gpt2_trace
    table = _table(traced, gpus=2, micro_batch=4)
    for sharding in ("shard", "replicate"):
        points = {p.label: p.parts for p in evaluate(table, uniform_choices(table, sharding, False)).points}
        assert points["fwd loss"]["gathered"] == points["bwd loss"]["gathered"] == 0
        assert points["bwd <root>"]["gathered"] > 0


def test_gloo_reduce_scatter_holds_a_copy_of_its_input(tiny_gpt2_trace):
    # FSDP2's post-backward frees the unsharded gradients once copied into the reduction input, then
    # allocates the output; gloo reduces a copy of the input (NCCL in place). Measured with
    # autoplan.memtrack on 2 gloo ranks: input + copy + output at the reduce point.
    _, traced = tiny_gpt2_trace
    points = {}
    for profile in ("a100-sxm4-80gb", "cpu-gloo-2"):
        table = traced.table(4, 1, resolve_cluster(2, None, None, profile), 64, "bf16-mixed", "adamw")
        choices = uniform_choices(table, "shard", False)
        points[profile] = {p.label: p.parts for p in evaluate(table, choices).points}
        block = next(u for u, unit in enumerate(table.units) if unit.path == "transformer.h.1")
        cost = table.costs[block][choices[block]]
        output = cost.local_numel * 4  # fp32 reduction of a bf16-mixed plan
        copy = cost.reduce_buffer_bytes if profile == "cpu-gloo-2" else 0
        assert cost.reduce_peak_bytes == cost.reduce_buffer_bytes + max(cost.unsharded_grad_bytes, output + copy)
    assert (points["cpu-gloo-2"]["reduce transformer.h.1"]["temporaries"]
            - points["a100-sxm4-80gb"]["reduce transformer.h.1"]["temporaries"] == cost.reduce_buffer_bytes)
    # gloo's worker thread frees that copy after the call returns, as late as it gets scheduled: measured
    # alive into the next unit's backward now and then, so the next backward counts it (NCCL: nothing)
    assert (points["cpu-gloo-2"]["bwd transformer.h.0"]["temporaries"]
            - points["a100-sxm4-80gb"]["bwd transformer.h.0"]["temporaries"] == cost.reduce_buffer_bytes)


def test_per_tensor_optimizer_step_holds_the_largest_local_shards_scratch(tiny_gpt2_trace):
    # On the CPU AdamW steps one tensor at a time, holding two temporaries of that tensor's local shard
    # (measured with autoplan.memtrack: gpt2 124M's embedding sharded over 2 ranks, 2 x 77.2 MB). The
    # step's scratch is the largest over the plan's parameters, as sharded by each one's unit.
    _, traced = tiny_gpt2_trace
    table = traced.table(2, 1, resolve_cluster(2, None, None, "cpu-gloo-2"), 64, "bf16-mixed", "adamw")
    shard, replicate = uniform_choices(table, "shard", False), uniform_choices(table, "replicate", False)
    mixed = [replicate[u] if unit.is_root else shard[u] for u, unit in enumerate(table.units)]
    state = ("params", "grads", "optimizer")
    for choices in (shard, replicate, mixed):
        largest = max(-(-p.shape[0] // (1 if table.options[u][c].sharding == "replicate" else 2))
                      * (p.numel // p.shape[0]) for u, c in enumerate(choices) for p in table.units[u].params)
        step = max((p for p in evaluate(table, choices).points if p.label.startswith("optimizer step")),
                   key=lambda p: sum(p.parts.values()))
        assert step.parts["temporaries"] == 2 * largest * 4
        assert sum(step.parts[k] for k in state) == sum(
            table.costs[u][c].param_bytes + table.costs[u][c].grad_bytes + table.costs[u][c].optimizer_bytes
            for u, c in enumerate(choices))
    # on CUDA the step runs foreach: one state-sized temporary over every parameter, no per-tensor scratch
    gpu = traced.table(2, 1, resolve_cluster(2, None, None, "a100-sxm4-80gb"), 64, "bf16-mixed", "adamw")
    choices = uniform_choices(gpu, "shard", False)
    assert _step_point(evaluate(gpu, choices)).parts["temporaries"] == sum(
        gpu.costs[u][c].local_numel * 4 for u, c in enumerate(choices))
