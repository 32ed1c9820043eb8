"""Parity checks for pipelined plans, run by test_pp_parity.py under torchrun with 4 gloo ranks.

Each case builds a tiny zoo model on the CPU with the same seed on every rank, applies a hand-made
pipelined plan through `autoplan.apply` (2 pipeline ranks x 2 data-parallel ranks: rank r on pipeline rank
r // 2, torch.distributed.pipelining's schedule over the pipeline group, FSDP2 inside each stage), trains a
few steps on the synthetic global batch with `model.step`, and compares the losses and final parameters
with a single process trained on the same global batch. It also records which stages and parameters each
rank holds. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from apply_parity_worker import finish, run_cases
from planmaker import make_plan, pipelined
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from tp_parity_worker import tp_plan

from autoplan.models.config import ModelConfig
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import apply
from autoplan.run.data import BatchShape, SyntheticTokens, rank_micro_batches
from autoplan.run.tp import training_context

STEPS = 3
SEED = 1234
LLAMA4 = get_config("llama-tiny", n_layers=4)
GPT2 = get_config("gpt2-tiny", tie_embeddings=False)
LLAMA_UNITS = {"tok_embeddings": "shard", "layers.0": "shard", "layers.1": "shard", "lm_head": "shard"}

# name -> (make_plan arguments, stages' modules, pipelined arguments); MESHES: what apply is given as `mesh`
# (by default nothing: the world), TENSOR: the cases whose plan is tensor-parallel too (2 x 2 x 1)
CASES = {
    "llama_1f1b": (dict(model="llama-tiny", decisions=LLAMA_UNITS, grad_accum_steps=2),
                   [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]], dict(schedule="1f1b")),
    # every micro-batch's forward first; kept-gathered and checkpointed units inside the stages
    "llama_gpipe_ckpt_keep": (dict(model="llama-tiny", grad_accum_steps=4,
                                   decisions={**LLAMA_UNITS, "layers.0": "shard+ckpt", "layers.1": "shard_keep"}),
                              [["tok_embeddings", "layers.0"], ["layers.1", "lm_head"]], dict(schedule="gpipe")),
    # two stages per pipeline rank, looped: stages 0 and 2 on rank 0, 1 and 3 on rank 1
    "llama_interleaved": (dict(model=LLAMA4, grad_accum_steps=2,
                               decisions={f"layers.{i}": "shard" for i in range(4)}),
                          [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "lm_head"]],
                          dict(schedule="interleaved_1f1b")),
    "gpt2_1f1b": (dict(model=GPT2, grad_accum_steps=2,
                       decisions={"transformer.h.0": "shard", "transformer.h.1": "shard"}),
                  [["transformer.wte", "transformer.wpe", "transformer.h.0"], ["transformer.h.1"]], dict()),
    # pipeline x tensor parallelism: 2 stages of 2 tensor-parallel ranks, the head's logits vocabulary-parallel
    "llama_1f1b_tp2": (dict(decisions=LLAMA_UNITS, grad_accum_steps=2),
                       [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]], dict()),
    # the zero-bubble schedules (weight gradients split from input gradients) on hand-made plans whose units say
    # reshard_after_forward=true (apply keeps them gathered for the step): looped, a checkpointed block among them
    "llama_zero_bubble_ckpt": (dict(model=LLAMA4, grad_accum_steps=4,
                                    decisions={**{f"layers.{i}": "shard" for i in range(4)}, "layers.1": "shard+ckpt"}),
                               [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "lm_head"]],
                               dict(schedule="zero_bubble")),
    # V-shaped: stages 0 and 3 on rank 0, 1 and 2 on rank 1; every unit replicate
    "llama_zbv_replicate": (dict(model=LLAMA4, grad_accum_steps=2,
                                 decisions={f"layers.{i}": "replicate" for i in range(4)}),
                            [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "lm_head"]],
                            dict(schedule="zbv", ranks=[0, 1, 1, 0])),
    # V-shaped x tensor degree 2: the first and last stages on rank 0
    "llama_zbv_tp2": (dict(decisions=LLAMA_UNITS, grad_accum_steps=2),
                      [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "lm_head"]],
                      dict(schedule="zbv", ranks=[0, 1, 1, 0])),
}
MESHES = {"llama_gpipe_ckpt_keep": "record", "gpt2_1f1b": "named"}
TENSOR = {"llama_1f1b_tp2", "llama_zbv_tp2"}


def cpu_model(plan) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model(ModelConfig.from_dict(plan.model.config), device="cpu")


def reference_run(plan, shape: BatchShape):
    """One process, the whole global batch at once, the full model: the losses and the trained parameters."""
    model = cpu_model(plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        tokens = data.global_batch(step, shape)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def pipeline_plan(name: str):
    plan_args, stages, pipe_args = CASES[name]
    plan = tp_plan(4, False, **plan_args) if name in TENSOR else make_plan(world_size=4, **plan_args)
    return pipelined(plan, stages, **pipe_args)


def mesh_of(name: str, plan):
    """What apply is given: the plan's mesh record, a named ("pp", "dp") DeviceMesh, or nothing."""
    if MESHES.get(name) == "record":
        return plan.cluster.mesh
    if MESHES.get(name) == "named":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return None


def applied_run(plan, shape: BatchShape, mesh=None):
    rank = plan.cluster.mesh.data_rank(dist.get_rank())
    model, optimizer = apply(cpu_model(plan), plan, mesh)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        batches = rank_micro_batches(data.global_batch(step, shape), rank, shape)
        with training_context(plan):  # loss parallel where the head is vocabulary-parallel
            loss = model.step(torch.cat([ids for ids, _ in batches]), torch.cat([labels for _, labels in batches]))
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the mean over the data-parallel groups' rows
        losses.append(loss.item())
    params = {name.split(".", 2)[2]: p.full_tensor() if isinstance(p, DTensor) else p.detach()
              for name, p in model.named_parameters()}  # "stages.<i>." off: the model's own paths
    return losses, params, [stage.stage_index for stage in model.stages]


def run_case(name: str) -> dict:
    plan = pipeline_plan(name)
    t = plan.training
    shape = BatchShape(t.micro_batch_size, t.grad_accum_steps, plan.cluster.mesh.dp, t.seq_len)
    losses, params, stages = applied_run(plan, shape, mesh_of(name, plan))
    ref_losses, ref_params = reference_run(plan, shape)
    diff = max((params[n].float() - ref_params[n]).abs().max().item() for n in params)
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(params))
    return {"losses": losses, "reference_losses": ref_losses, "max_param_diff": diff, "stages": stages,
            "params_held": held, "all_params": sorted(ref_params)}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results = run_cases({name: name for name in CASES}, run_case)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: r.get("stages") for name, r in results.items()})
    for name in results:
        results[name]["stages_by_rank"] = [g[name] for g in gathered]
    finish(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
