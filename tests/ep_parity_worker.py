"""Parity checks for expert-parallel plans, run by test_ep_parity.py under torchrun with 2 or 4 gloo ranks.

Each case builds the zoo's moe-tiny (8 experts, top-2) on the CPU with the same seed on every rank, applies a
hand-made plan with an expert-parallel degree (ep 2 over dp 2; ep 2 and ep 4 over dp 4), trains a few steps
on the synthetic global batch and compares losses and final parameters with a single process trained on the
same global batch. It also records what ran: the fraction of an expert stack each rank holds and the mesh
its weights are laid on. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from apply_parity_worker import finish, parity_record, refusal, run_cases
from planmaker import make_plan
from torch.distributed.tensor import DTensor

from autoplan.models.config import ModelConfig
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import apply
from autoplan.run.data import BatchShape, SyntheticTokens, rank_micro_batches
from autoplan.run.worker import next_token_loss

STEPS = 3
SEED = 1234
MODEL = "moe-tiny"
BLOCKS = ("layers.0", "layers.1")
EXPERTS = tuple(f"{b}.mlp.experts" for b in BLOCKS)
UNITS = {**{b: "shard" for b in BLOCKS}, **{e: "shard" for e in EXPERTS}}

TWO_EXPERTS = replace(get_config(MODEL), n_experts=2, top_k=1)  # fewer experts than ranks: FSDP shards dim 1

# world size -> name -> (expert-parallel degree, make_plan arguments)
CASES = {
    2: {
        "ep2": (2, dict(decisions=UNITS)),
        "ep2_keep_ckpt": (2, dict(decisions={**UNITS, EXPERTS[0]: "shard_keep", BLOCKS[1]: "shard+ckpt"},
                                  grad_accum_steps=2)),
        "ep2_bf16": (2, dict(decisions=UNITS, dtype="bf16-mixed")),
    },
    4: {
        "dp4_ep2": (2, dict(decisions=UNITS)),
        "dp4_ep4": (4, dict(decisions={**UNITS, BLOCKS[0]: "shard+sel"})),
        "dp4_ep2_two_experts": (2, dict(decisions=UNITS, model=TWO_EXPERTS)),
        "dp4_fsdp_two_experts": (1, dict(decisions=UNITS, model=TWO_EXPERTS)),
    },
}


def ep_plan(world_size: int, ep: int, decisions: dict, model: str | ModelConfig = MODEL, **kwargs):
    plan = make_plan(model, decisions, world_size=world_size, name=MODEL, **kwargs)
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"ep_degree": ep})})


def cpu_model(plan=None) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = ModelConfig.from_dict(plan.model.config) if plan is not None else get_config(MODEL)
    model = build_model(config, device="cpu")
    model.init_weights()
    return model


def reference_run(plan, shape: BatchShape):
    """One process, the whole global batch at once."""
    model = cpu_model(plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        tokens = data.global_batch(step, shape)
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def applied_run(plan, shape: BatchShape, rank: int):
    model, optimizer = apply(cpu_model(plan), plan, lr=1e-3)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for input_ids, labels in rank_micro_batches(data.global_batch(step, shape), rank, shape):
            loss = next_token_loss(model(input_ids), labels) / shape.grad_accum_steps
            loss.backward()
            loss_sum += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        losses.append(loss_sum.item())
    w1 = model.get_submodule(EXPERTS[0]).w1
    params = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in model.named_parameters()}
    return losses, params, {
        "w1_local_fraction": w1.to_local().numel() / w1.numel(),
        "w1_mesh": list(w1.device_mesh.mesh_dim_names or ()),
        "w1_placements": [str(p) for p in w1.placements],
        "wq_mesh": list(model.get_submodule("layers.0.attn.wq").weight.device_mesh.mesh_dim_names or ()),
    }


def run_case(world_size: int, case: tuple) -> dict:
    ep, kwargs = case
    plan = ep_plan(world_size, ep, **kwargs)
    t = plan.training
    shape = BatchShape(t.micro_batch_size, t.grad_accum_steps, world_size, t.seq_len)
    losses, params, probe = applied_run(plan, shape, dist.get_rank())
    ref_losses, ref_params = reference_run(plan, shape)
    return parity_record(losses, params, ref_losses, ref_params, **probe)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    results = run_cases(CASES[world_size], functools.partial(run_case, world_size))
    if world_size == 2:
        results["refused_kind"] = refusal(ep_plan(2, 2, decisions={**UNITS, EXPERTS[1]: "replicate"}), cpu_model())
        dense = make_plan("llama-tiny", {}, world_size=2)
        dense = dense.model_copy(update={"cluster": dense.cluster.model_copy(update={"ep_degree": 2})})
        results["refused_dense"] = refusal(dense, build_model(get_config("llama-tiny"), device="cpu"))
    finish(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
