"""Parity checks for `autoplan.apply`, run by test_apply_parity.py under torchrun with 2 gloo ranks.

One launch runs every case: each builds a tiny model on the CPU with the same seed on every rank,
applies a hand-made plan, trains a few steps on the synthetic global batch, and compares losses and
final parameters with a single-process reference trained on the same global batch. It also records
what each decision did to the modules (local shard sizes, parameters kept gathered after forward,
forward recomputation under checkpointing) and the refusals. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from planmaker import make_plan
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanFileError
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import apply
from autoplan.run.data import BatchShape, SyntheticTokens, rank_micro_batches
from autoplan.run.fsdp import offloaded_params

STEPS = 3
SEED = 1234
GPT2_BLOCKS = ("transformer.h.0", "transformer.h.1")

# name -> make_plan arguments; "probe" names a unit whose decision the case inspects.
CASES = {
    "shard": dict(model="gpt2-tiny", decisions={b: "shard" for b in GPT2_BLOCKS}, probe="transformer.h.0"),
    "shard_keep": dict(model="gpt2-tiny", decisions={b: "shard_keep" for b in GPT2_BLOCKS}, probe="transformer.h.0"),
    "replicate": dict(model="gpt2-tiny", decisions={"": "replicate", **{b: "replicate" for b in GPT2_BLOCKS}},
                      probe="transformer.h.0"),
    "checkpoint": dict(model="gpt2-tiny", decisions={b: "shard+ckpt" for b in GPT2_BLOCKS}, probe="transformer.h.0"),
    "hybrid_2x1": dict(model="gpt2-tiny", decisions={b: "hybrid" for b in GPT2_BLOCKS}, nodes=2, gpus_per_node=1,
                       probe="transformer.h.0"),
    "hybrid_1x2": dict(model="gpt2-tiny", decisions={b: "hybrid" for b in GPT2_BLOCKS}, nodes=1, gpus_per_node=2,
                       probe="transformer.h.0"),
    # Nested units (attention / MLP inside blocks), every kind at once, grad accumulation, llama.
    "mixed": dict(
        model="llama-tiny", grad_accum_steps=2, nodes=2, gpus_per_node=1, probe="layers.0.attn",
        decisions={
            "tok_embeddings": "shard_keep", "layers.0": "shard", "layers.0.attn": "replicate+ckpt",
            "layers.0.mlp": "shard_keep", "layers.1": "hybrid", "layers.1.mlp": "shard+ckpt", "lm_head": "replicate",
        },
    ),
    "sgd": dict(model="llama-tiny", optimizer="sgd", decisions={"layers.0": "shard", "layers.1": "replicate+ckpt"},
                probe="layers.1"),
    # A plan for 4 ranks (2 nodes of 2) applied as a dry run on the 2 ranks there are.
    "dry_run_from_4": dict(model="gpt2-tiny", world_size=4, nodes=2, gpus_per_node=2, dry_run=True,
                           decisions={"transformer.h.0": "hybrid", "transformer.h.1": "shard_keep+ckpt"},
                           probe="transformer.h.0"),
    # Selective checkpointing (an op-level policy: matmul and attention outputs kept, the rest re-run).
    "selective": dict(model="gpt2-tiny", grad_accum_steps=2, decisions={b: "shard+sel" for b in GPT2_BLOCKS},
                      probe="transformer.h.0"),
    # Offload (FSDP2 CPUOffloadPolicy; on the CPU the host is the device): every kind of unit offloaded or not,
    # with and without checkpointing, the optimizer split into a device group and a host group.
    "offload": dict(model="llama-tiny", probe="layers.1",
                    decisions={"tok_embeddings": "shard_keep+offload", "layers.0": "shard+offload",
                               "layers.1": "replicate+sel+offload", "lm_head": "shard+ckpt"}),
    # Precision: compared with the fp32 reference within bf16 rounding.
    "bf16_mixed": dict(model="gpt2-tiny", dtype="bf16-mixed", decisions={b: "shard" for b in GPT2_BLOCKS},
                       probe="transformer.h.0"),
    "bf16": dict(model="gpt2-tiny", dtype="bf16", decisions={b: "shard" for b in GPT2_BLOCKS},
                 probe="transformer.h.0"),
}


def cpu_model(name: str) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model(get_config(name), device="cpu")


def batch_shape(plan, world_size: int) -> BatchShape:
    t = plan.training
    return BatchShape(t.micro_batch_size, t.grad_accum_steps, world_size, t.seq_len)


def loss_of(model, input_ids, labels):
    logits = model(input_ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def reference_run(plan, shape: BatchShape, make_optimizer=None, scheduler=None):
    """One process, the whole global batch at once, full fp32 model: the losses and the trained parameters.
    `make_optimizer` (default: the plan's optimizer at lr 1e-3) and `scheduler` are factories as apply takes."""
    model = cpu_model(plan.model.name)
    if make_optimizer is None:
        make_optimizer = functools.partial(
            {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[plan.training.optimizer],
            lr=1e-3)
    optimizer = make_optimizer(model.parameters())
    schedule = scheduler and scheduler(optimizer)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        tokens = data.global_batch(step, shape)
        loss = loss_of(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def applied_run(plan, shape: BatchShape, probe: str, dry_run: bool):
    rank = dist.get_rank()
    model, optimizer = apply(cpu_model(plan.model.name), plan, dry_run=dry_run)
    probe_module = model.get_submodule(probe)  # module paths still resolve after apply
    # Count forward calls of a module inside the probed unit: twice per micro-batch under checkpointing.
    inner = next(m for name, m in probe_module.named_modules() if name and not list(m.children()))
    calls = [0]
    inner.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    gathered_after_forward = None

    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for micro, (input_ids, labels) in enumerate(rank_micro_batches(data.global_batch(step, shape), rank, shape)):
            loss = loss_of(model, input_ids, labels) / shape.grad_accum_steps
            if gathered_after_forward is None:
                # shard_keep leaves the unit's parameters unsharded (plain tensors) from forward to backward.
                gathered_after_forward = not any(isinstance(p, DTensor) for p in probe_module.parameters())
            loss.backward()
            loss_sum += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        losses.append(loss_sum.item())

    local_fraction = {
        name: p.to_local().numel() / p.numel() for name, p in probe_module.named_parameters() if p.dim() == 2
    }
    params = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in model.named_parameters()}
    on_host = {id(p) for p in offloaded_params(model)}
    return {
        "offloaded_params": sorted(name for name, p in model.named_parameters() if id(p) in on_host),
        "optimizer_groups": [len(group["params"]) for group in optimizer.param_groups],
        "losses": losses,
        "params": params,
        "param_dtype": str(next(model.parameters()).dtype),
        "probe_local_fraction": min(local_fraction.values()),
        "probe_gathered_after_forward": gathered_after_forward,
        "probe_inner_forward_calls_per_micro_batch": calls[0] / (STEPS * shape.grad_accum_steps),
    }


def run_case(case: dict) -> dict:
    case = dict(case)
    probe, dry_run = case.pop("probe"), case.pop("dry_run", False)
    plan = make_plan(**case)
    shape = batch_shape(plan, dist.get_world_size())
    applied = applied_run(plan, shape, probe, dry_run)
    ref_losses, ref_params = reference_run(plan, shape)
    param_diff = max((applied["params"][n].float() - ref_params[n]).abs().max().item() for n in ref_params)
    return {
        "losses": applied["losses"],
        "reference_losses": ref_losses,
        "max_param_diff": param_diff,
        "param_dtype": applied["param_dtype"],
        "probe_local_fraction": applied["probe_local_fraction"],
        "probe_gathered_after_forward": applied["probe_gathered_after_forward"],
        "probe_inner_forward_calls_per_micro_batch": applied["probe_inner_forward_calls_per_micro_batch"],
        "offloaded_params": applied["offloaded_params"],
        "optimizer_groups": applied["optimizer_groups"],
    }


def refusal(plan, model: torch.nn.Module | None = None, **kwargs) -> str | None:
    """What apply says refusing `plan` on `model` (default: the plan's zoo model), None where it applies."""
    try:
        apply(model if model is not None else build_model(plan.model.name), plan, **kwargs)
    except PlanFileError as exc:
        return str(exc)
    return None


def run_cases(cases: dict, run) -> dict:
    """`run(case)` of each named case, or the traceback of its failure (recorded and asserted on by the test)."""
    results: dict = {}
    for name, case in cases.items():
        try:
            results[name] = run(case)
        except Exception:  # noqa: BLE001 - recorded and asserted on by the test
            results[name] = {"error": traceback.format_exc()}
    return results


def parity_record(losses, params, reference_losses, reference_params, **probe) -> dict:
    """A case's result: its losses beside the reference's, the largest parameter difference, what it probed."""
    diff = max((params[n].float() - reference_params[n]).abs().max().item() for n in reference_params)
    return {"losses": losses, "reference_losses": reference_losses, "max_param_diff": diff, **probe}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results = run_cases(CASES, run_case)
    results["refused_world_size"] = refusal(make_plan("gpt2-tiny", world_size=4))
    finish(results, out_path)


def finish(results: dict, out_path: str) -> None:
    """Rank 0 writes the results (atomically); then the same teardown as autoplan's own worker: everyone
    done, then leave without destroying gloo."""
    if dist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as handle:
            json.dump(results, handle)
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
