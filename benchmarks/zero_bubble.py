"""torch's zero-bubble schedules under FSDP2: the gradients they deliver and what they hold (RESULTS.md section 20).

    python benchmarks/zero_bubble.py        # one torchrun launch of 4 gloo ranks, then one process: ~45 s

The minimal reproduction of why `autoplan apply` once refused these schedules, at torch's level (no autoplan
apply): llama-tiny with 4 layers cut into 4 `StageModule`s on 2 pipeline ranks x 2 data-parallel ranks, every
layer and every stage `fully_shard`ed with reshard_after_forward true or false, torch's `PipelineStage` and
the schedule class, one step of 2 micro-batches. Each stage's gradients (gathered) are compared with one
process's gradient of the whole batch and of each micro-batch alone (scaled as the schedule scales them);
the verdict per stage is the closest of those, with its largest difference. With reshard_after_forward true
the input-gradient pass of a micro-batch whose stage ran a forward just before it collects the sharded
parameters (not in the graph) and its weight gradients are lost; false (what autoplan's pipelined plans
record and apply keeps under these schedules) delivers every micro-batch's.

Then, in this process, what the split backward holds that a full one does not (RESULTS.md section 20's memory
rows): one layer of the fidelity benchmark's llama (d_model 128, FFN 352, bf16), one micro-batch of 4 x 128,
the live bytes (autoplan.run.memtrack) above the forward's end at the backward's peak, full (torch's
`stage_backward`) and split (`stage_backward_input`, then `stage_backward_weight`), and what the split holds
between its two passes. Last, from each schedule class's own action order (built for every rank on torch's fake
process group, `pipeline_order` counted): the most stage-chunks (one stage's micro-batch) whose forward ran and
whose weight pass (or full backward) has not, per rank, beside interleaved 1F1B's, which the pricing once used for
zero bubble (cost_models.pipeline.in_flight); and one layer under FSDP2 (a gloo world of one) through two split
backwards: the weight pass leaves its gradients in bf16, which FSDP2 accumulates in fp32 only at the end of the
next input-gradient pass (cost_models.pipeline.split_backward prices both).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

PLACEMENT = {"zbv": [0, 1, 1, 0], "zero_bubble": [0, 1, 0, 1]}  # schedule -> each stage's pipeline rank
STAGES = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"]]
MICRO, ROWS, SEQ, SEED = 2, 2, 16, 1234  # micro-batches per step, rows per micro-batch and rank


def _model():
    from autoplan.models.zoo import build_model, get_config

    torch.manual_seed(SEED)
    return build_model(get_config("llama-tiny", n_layers=4), device="cpu")


def _reference(tokens: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """One process's gradients: of the whole batch, and of each micro-batch alone over 2 x the micro-batches."""
    from autoplan.run.named_inputs import next_token_loss

    cases = {"all micro-batches": tokens}
    per = tokens.size(0) // MICRO
    cases.update({f"micro-batch {m} only": tokens[m * per:(m + 1) * per] for m in range(MICRO)})
    grads = {}
    for name, rows in cases.items():
        model = _model()
        next_token_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        scale = 1.0 if name == "all micro-batches" else 1.0 / MICRO
        grads[name] = {n: p.grad * scale for n, p in model.named_parameters()}
    return grads


def _run(schedule: str, reshard: bool, mesh, tokens: torch.Tensor) -> dict[int, dict[str, torch.Tensor | None]]:
    """This rank's stages' gradients after one step (None: no gradient), by stage index."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.tensor import DTensor

    from autoplan.plan.pipeline_spec import PipelineSpec, StageSpec
    from autoplan.run.named_inputs import next_token_loss
    from autoplan.run.stage_module import StageModule, stage_parts
    from cost_models.schedules import SCHEDULES

    ranks, pp_rank, dp_rank = PLACEMENT[schedule], mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    spec = PipelineSpec(degree=2, schedule=schedule, microbatches=MICRO, stages=[
        StageSpec(rank=r, modules=m, units=m, peak_mem_bytes=0, fwd_s=0.0, bwd_s=0.0) for r, m in zip(ranks, STAGES)])
    model = _model()
    parts = stage_parts(model, spec)
    stages = [StageModule(model, parts[i], i, len(STAGES) - 1) for i, r in enumerate(ranks) if r == pp_rank]
    for stage in stages:
        for name, module in stage.named_modules():
            if name.startswith("layers.") and name.count(".") == 1:
                fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard)
    piped = [PipelineStage(s, s.stage_index, len(STAGES), torch.device("cpu"), group=mesh["pp"].get_group())
             for s in stages]
    runner = getattr(torch_schedules, SCHEDULES[schedule].torch_class)(piped, MICRO, loss_fn=next_token_loss)
    mine = torch.cat([tokens[(m * 2 + dp_rank) * ROWS:(m * 2 + dp_rank + 1) * ROWS] for m in range(MICRO)])
    has_first, has_last = any(s.stage_index == 0 for s in stages), any(s.is_last for s in stages)
    runner.step(*((mine[:, :-1],) if has_first else ()), target=mine[:, 1:] if has_last else None,
                losses=[] if has_last else None, return_outputs=False)
    out = {}
    for stage in stages:
        out[stage.stage_index] = {n: None if p.grad is None else
                                  (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                                  for n, p in stage.named_parameters()}
    return out


def worker() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tokens = torch.randint(0, 256, (MICRO * 2 * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    reference = _reference(tokens)
    for schedule in PLACEMENT:
        for reshard in (True, False):
            grads = _run(schedule, reshard, mesh, tokens)
            lines = []
            for index, named in sorted(grads.items()):
                if any(g is None for g in named.values()):
                    lines.append(f"stage {index}: {sum(g is None for g in named.values())} of {len(named)} "
                                 "parameters without a gradient")
                    continue
                errors = {case: max((g - ref[n]).abs().max().item() for n, g in named.items())
                          for case, ref in reference.items()}
                best = min(errors, key=errors.get)
                lines.append(f"stage {index}: {best} (within {errors[best]:.1e}; the whole batch's: "
                             f"{errors['all micro-batches']:.1e})")
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, lines)
            if dist.get_rank() == 0:
                print(f"{schedule}, reshard_after_forward={str(reshard).lower()}:")
                for line in sorted(gathered[0] + gathered[2]):
                    print(f"  {line}")
    dist.destroy_process_group()


def split_backward_bytes() -> dict[str, int]:
    """One layer, one micro-batch: the backward's peak above the forward's end, full and split, and what the split
    holds from its input-gradient pass to its weight pass."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    from autoplan.models.llama import rope_tables
    from autoplan.models.zoo import build_model, get_config
    from autoplan.run.memtrack import LiveTensorTracker

    torch.manual_seed(SEED)
    config = get_config("llama-tiny", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=352)
    model = build_model(config, device="cpu").to(torch.bfloat16)
    layer, found = model.layers[1], {}
    for split in (False, True):
        for param in layer.parameters():
            param.grad = torch.zeros_like(param)
        x = torch.randn(4, 128, 128, dtype=torch.bfloat16, requires_grad=True)
        with LiveTensorTracker() as tracker:
            tracker.track(x, *layer.parameters(), *(param.grad for param in layer.parameters()))
            y = layer(x, *rope_tables(model.get_buffer("inv_freq"), 128, torch.bfloat16))
            base = tracker.live_bytes
            tracker.reset_peak()
            if split:
                _, groups = stage_backward_input([y], [torch.randn_like(y)], [x], layer.parameters())
                found["held from I to W"] = tracker.live_bytes - base
                stage_backward_weight(layer.parameters(), groups)
            else:
                stage_backward([y], [torch.randn_like(y)], [x])
            found["split peak" if split else "full peak"] = tracker.peak_bytes - base
    return found


def split_gradients() -> list[str]:
    """One layer under FSDP2 (bf16 parameters, fp32 reduction, as PipelineStage runs a micro-batch's backward) on a gloo
    world of one, two micro-batches through the split backward: after each pass, how many parameters hold a
    compute-dtype gradient (written by the weight pass) and an accumulated one (FSDP2's post-backward, at the end of
    an input-gradient pass)."""
    import tempfile

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from autoplan.models.llama import rope_tables
    from autoplan.models.zoo import build_model, get_config

    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        torch.manual_seed(SEED)
        model = build_model(get_config("llama-tiny", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2,
                                       ffn_hidden=352), device="cpu")
        layer, rope = model.layers[1], rope_tables(model.get_buffer("inv_freq"), 128, torch.bfloat16)
        fully_shard(layer, reshard_after_forward=False,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        layer.set_requires_gradient_sync(False)  # as PipelineStage runs every micro-batch's backward
        layer.set_reshard_after_backward(False)
        layer.set_is_last_backward(False)
        params = layer._get_fsdp_state()._fsdp_param_group.fsdp_params
        runs = [(x, layer(x, *rope)) for x in (torch.randn(4, 128, 128, dtype=torch.bfloat16, requires_grad=True)
                                               for _ in range(2))]
        lines = []
        for m, (x, y) in enumerate(runs):
            _, groups = stage_backward_input([y], [torch.randn_like(y)], [x], layer.parameters())
            for name in (f"I{m}", f"W{m}"):
                if name.startswith("W"):
                    stage_backward_weight(layer.parameters(), groups)
                held = sum(p._unsharded_param.grad is not None for p in params)
                accumulated = sum(p.unsharded_accumulated_grad is not None for p in params)
                lines.append(f"after {name}: {held} of {len(params)} bf16 gradients, {accumulated} accumulated")
        dist.destroy_process_group()
    return lines


def peak_chunks(torch_class: str, pp: int, m: int, v_shape: bool) -> list[int]:
    """Per pipeline rank, the most stage-chunks in flight in the schedule's order (2 stages per rank)."""
    import re

    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    peaks = []
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        mine = [rank, 2 * pp - 1 - rank] if v_shape else [rank, rank + pp]
        stages = [PipelineStage(nn.Identity(), i, 2 * pp, torch.device("cpu")) for i in mine]
        order = getattr(torch_schedules, torch_class)(stages, m, loss_fn=lambda out, target: out.sum()).pipeline_order
        dist.destroy_process_group()
        live = peak = 0
        for action in filter(None, order[rank]):
            kind = re.fullmatch(r"\d+([A-Z]+)\d+", str(action)).group(1)
            live += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def main() -> None:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "ZB_GRADS_WORKER": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           "--max-restarts=0", __file__], env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout, end="")
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 4 * pp):
            counts = {name: peak_chunks(cls, pp, m, name == "zbv") for name, cls in (
                ("zero_bubble", "ScheduleInterleavedZeroBubble"), ("zbv", "ScheduleZBVZeroBubble"),
                ("interleaved_1f1b", "ScheduleInterleaved1F1B"))}
            print(f"pp {pp}, {m} micro-batches, stage-chunks in flight at each rank's peak: "
                  + "; ".join(f"{name} {counts[name]}" for name in counts))
    print("one layer under FSDP2, the split backward's gradients: " + "; ".join(split_gradients()))
    found = split_backward_bytes()
    print("one layer, one micro-batch of 4 x 128 (bf16), the backward's live bytes above the forward's end: "
          + ", ".join(f"{name} {value / 1e6:.3f} MB" for name, value in found.items()))


if __name__ == "__main__":
    worker() if os.environ.get("ZB_GRADS_WORKER") else main()
