"""Parity checks for tensor-parallel plans, run by test_tp_parity.py under torchrun with 2 or 4 gloo ranks.

Each case builds llama-tiny (4 heads, 2 key/value heads: grouped-query attention) on the CPU with the
same seed on every rank, applies a hand-made plan of tensor-parallel degree 2 (1 x 2 on 2 ranks, 2 x 2
on 4), trains a few steps on the synthetic global batch in the worker's own training context (loss
parallel where the head is vocabulary-parallel), and compares losses and final parameters with a single
process trained on the same global batch. It also records what the layout did to the modules: the
fraction of a projection's weight each rank holds and the heads its attention computes. Rank 0 writes
the results as JSON.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from apply_parity_worker import finish, parity_record, refusal, run_cases
from planmaker import make_plan
from torch.distributed.tensor import DTensor

from autoplan.models.tp_layout import recognise
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import apply
from autoplan.run.data import BatchShape, SyntheticTokens, rank_micro_batches
from autoplan.run.tp import training_context
from autoplan.run.worker import next_token_loss
from cost_models.records import ParamInfo, Unit
from cost_models.tensor_parallel import unit_layouts

STEPS = 3
SEED = 1234
BLOCKS = ("layers.0", "layers.1")
UNITS = {"tok_embeddings": "shard", **{b: "shard" for b in BLOCKS}, "lm_head": "shard"}

# name -> (world size the case runs on, make_plan arguments, sequence parallel)
CASES = {
    2: {
        "tp2": (dict(decisions=UNITS), False),
        "tp2_sp": (dict(decisions=UNITS), True),
        "tp2_sp_ckpt_keep": (dict(decisions={**UNITS, "layers.0": "shard+ckpt", "layers.1": "shard_keep"}), True),
        "tp2_sp_bf16": (dict(decisions=UNITS, dtype="bf16-mixed"), True),
    },
    4: {
        "dp2_tp2_sp": (dict(decisions=UNITS, grad_accum_steps=2), True),
        "dp2_tp2": (dict(decisions={**UNITS, "layers.1": "shard_keep+ckpt"}), False),
    },
}


def tp_plan(world_size: int, sp: bool, decisions: dict, **kwargs):
    """A hand-made plan of degree 2 with the layouts the model's units take."""
    plan = make_plan("llama-tiny", decisions, world_size=world_size, **kwargs)
    layout = recognise(cpu_model(), 2, sp)
    units = [Unit(u.module, [ParamInfo(n, tuple(s)) for n, s in u.param_shapes.items()]) for u in plan.units]
    tags = unit_layouts(units, layout)
    return plan.model_copy(update={
        "cluster": plan.cluster.model_copy(update={"tp_degree": 2, "sequence_parallel": sp}),
        "units": [u.model_copy(update={"tp": t.value if t else None}) for u, t in zip(plan.units, tags)],
    })


def cpu_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model(get_config("llama-tiny"), device="cpu")


def reference_run(plan, shape: BatchShape):
    """One process, the whole global batch at once, full fp32 model."""
    model = cpu_model()
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
    model, optimizer = apply(cpu_model(), plan)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    with training_context(plan):
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
    wq = model.get_submodule("layers.0.attn.wq").weight
    params = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in model.named_parameters()}
    return losses, params, {
        "wq_local_fraction": wq.to_local().numel() / wq.numel(),
        "wq_mesh": list(wq.device_mesh.mesh_dim_names or ()),
        "heads": [model.get_submodule("layers.0.attn").n_heads, model.get_submodule("layers.0.attn").n_kv_heads],
    }


def run_case(world_size: int, case: tuple) -> dict:
    kwargs, sp = case
    plan = tp_plan(world_size, sp, **kwargs)
    mesh = plan.cluster.mesh
    rank, dp = mesh.data_rank(dist.get_rank()), world_size // mesh.tp
    t = plan.training
    shape = BatchShape(t.micro_batch_size, t.grad_accum_steps, dp, t.seq_len)
    losses, params, probe = applied_run(plan, shape, rank)
    ref_losses, ref_params = reference_run(plan, shape)
    return parity_record(losses, params, ref_losses, ref_params, **probe)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    results = run_cases(CASES[world_size], functools.partial(run_case, world_size))
    if world_size == 2:
        wrong = tp_plan(2, True, decisions=UNITS)
        wrong = wrong.model_copy(update={"units": [u.model_copy(update={"tp": None}) for u in wrong.units]})
        results["refused_layout"] = refusal(wrong, cpu_model())
        hybrid = tp_plan(2, False, decisions={**UNITS, "layers.0": "replicate"})
        results["refused_kind"] = refusal(hybrid, cpu_model())
    finish(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
