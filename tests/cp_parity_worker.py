"""Parity checks for context-parallel plans, run by test_cp_parity.py under torchrun with 2 or 4 gloo ranks.

Each case builds llama-tiny on the CPU with the same seed on every rank, applies a hand-made plan of
context-parallel degree 2 (1 x 2 on 2 ranks; 2 x 2, and 1 x 2 x tensor-parallel 2, on 4) through
`autoplan.apply`, trains a few steps on the synthetic global batch with each micro-batch's forward and
backward inside `applied.context.shard` (ring attention on the CPU SDPA kernel, load-balanced chunks),
and compares the losses and final parameters with a single process trained on the same global batch
(tp_parity_worker.reference_run). It also records what ran: the FSDP mesh of a weight, the share of it a
rank holds and the length of the sequence a rank's attention saw. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from apply_parity_worker import finish, parity_record, refusal, run_cases
from planmaker import make_plan
from torch.distributed.tensor import DTensor
from tp_parity_worker import SEED, STEPS, UNITS, cpu_model, reference_run, tp_plan

from autoplan.run.apply import apply
from autoplan.run.data import BatchShape, SyntheticTokens, rank_micro_batches
from autoplan.run.tp import training_context
from autoplan.run.worker import next_token_loss

# name -> (world size the case runs on, make_plan arguments, tensor-parallel degree)
CASES = {
    2: {
        "cp2": (dict(decisions=UNITS), 1),
        "cp2_ckpt_keep": (dict(decisions={**UNITS, "layers.0": "shard+ckpt", "layers.1": "shard_keep+sel"}), 1),
        "cp2_bf16": (dict(decisions=UNITS, dtype="bf16-mixed"), 1),
    },
    4: {
        "dp2_cp2": (dict(decisions=UNITS, grad_accum_steps=2), 1),
        "cp2_tp2": (dict(decisions={**UNITS, "layers.1": "shard_keep+ckpt"}), 2),
    },
}


def cp_plan(world_size: int, tp: int, decisions: dict, **kwargs):
    """A hand-made plan of context-parallel degree 2 (and tensor-parallel degree `tp`)."""
    plan = tp_plan(world_size, False, decisions, **kwargs) if tp > 1 else make_plan(
        "llama-tiny", decisions, world_size=world_size, **kwargs)
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"cp_degree": 2})})


def applied_run(plan, shape: BatchShape, rank: int):
    model, optimizer = applied = apply(cpu_model(), plan)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    seen: list[int] = []
    attn = model.get_submodule("layers.0.attn")
    attn.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    losses = []
    with training_context(plan):
        for step in range(STEPS):
            loss_sum = torch.zeros(())
            for input_ids, labels in rank_micro_batches(data.global_batch(step, shape), rank, shape):
                with applied.context.shard(input_ids, labels) as (ids, targets):
                    loss = next_token_loss(model(ids), targets) / shape.grad_accum_steps
                    loss.backward()
                loss_sum += loss.detach()
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            losses.append(loss_sum.item())
    wq = model.get_submodule("layers.0.attn.wq").weight
    params = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in model.named_parameters()}
    return losses, params, {"wq_mesh": list(wq.device_mesh.mesh_dim_names or ()),
                            "wq_local_fraction": wq.to_local().numel() / wq.numel(), "attention_seq": seen[0]}


def run_case(world_size: int, case: tuple) -> dict:
    kwargs, tp = case
    plan = cp_plan(world_size, tp, **kwargs)
    mesh = plan.cluster.mesh
    t = plan.training
    shape = BatchShape(t.micro_batch_size, t.grad_accum_steps, mesh.dp, t.seq_len)
    losses, params, probe = applied_run(plan, shape, mesh.data_rank(dist.get_rank()))
    ref_losses, ref_params = reference_run(plan, shape)
    return parity_record(losses, params, ref_losses, ref_params, **probe)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    results = run_cases(CASES[world_size], functools.partial(run_case, world_size))
    if world_size == 2:
        results["refused_kind"] = refusal(cp_plan(2, 1, decisions={**UNITS, "layers.0": "replicate"}), cpu_model())
    finish(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
