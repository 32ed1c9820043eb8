"""Parity of plans of Hugging Face models, run under torchrun with 2 gloo ranks by test_hf_tp_parity.py
(tensor-parallel plans) and test_apply_named_inputs.py (models that take named inputs): each plan is applied to
the model built on the CPU with the same seed on every rank, trained a few steps with the plan's attention
kernels, and compared with one process training the same model on the same global batch. Rank 0 writes the
results as JSON."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from apply_parity_worker import finish
from torch.distributed.tensor import DTensor

from autoplan.models.hf import build_hf_model
from autoplan.models.inputs import ModelInputs
from autoplan.models.zoo import build_model, get_config
from autoplan.models.tp_layout import recognise
from autoplan.plan.schema import load_plan
from autoplan.run.apply import apply
from autoplan.run.attention import planned_attention
from autoplan.run.data import BatchShape, SyntheticTokens, rank_micro_batches
from autoplan.run.named_inputs import NamedInputs, micro_batch_loss
from autoplan.run.tp import training_context
from autoplan.run.tp_styles import restore_sections

STEPS, SEED = 3, 1234


def cpu_model(folder: Path) -> torch.nn.Module:
    """The folder's Hugging Face config, or the zoo preset its `zoo` file names."""
    if (folder / "zoo").exists():
        torch.manual_seed(SEED)
        return build_model(get_config((folder / "zoo").read_text().strip()), device="cpu").train()
    meta = build_hf_model(folder).module
    torch.manual_seed(SEED)
    return type(meta)(meta.config).train()


def micro_batches(plan, model, step: int, shape: BatchShape, rank: int | None) -> list:
    """This rank's micro-batches, or (rank None) the whole global batch: token ids, or the plan's named inputs
    (autoplan apply's, made for each data-parallel rank: one process takes every rank's)."""
    if plan.model.inputs:
        source = NamedInputs(ModelInputs.parse(plan.model.inputs), model, seed=SEED)
        return [batch for r in ([rank] if rank is not None else range(shape.world_size))
                for batch in source.rank_micro_batches(step, r, shape)]
    tokens = SyntheticTokens(model.config.vocab_size, seed=SEED).global_batch(step, shape)
    return rank_micro_batches(tokens, rank, shape) if rank is not None else [(tokens[:, :-1], tokens[:, 1:])]


def train(model, optimizer, plan, shape: BatchShape, rank: int | None) -> list[float]:
    losses = []
    with training_context(plan) if rank is not None else torch.enable_grad(), planned_attention(plan, model, "cpu"):
        for step in range(STEPS):
            batches = micro_batches(plan, model, step, shape, rank)
            loss_sum = torch.zeros(())
            for inputs, labels in batches:
                loss = micro_batch_loss(model, inputs, labels, torch.device("cpu")) / len(batches)
                loss.backward()
                loss_sum += loss.detach()
            optimizer.step()
            optimizer.zero_grad()
            if rank is not None:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            losses.append(loss_sum.item())
    return losses


def run_case(folder: Path) -> dict:
    plan = load_plan(folder / "plan.json")
    mesh, t = plan.cluster.mesh, plan.training
    rank = mesh.data_rank(dist.get_rank())
    shape = BatchShape(t.micro_batch_size, t.grad_accum_steps, dist.get_world_size() // mesh.tp, t.seq_len)
    model, optimizer = apply(cpu_model(folder), plan)
    losses = train(model, optimizer, plan, shape, rank)
    reference = cpu_model(folder)
    layout = recognise(reference, mesh.tp, mesh.sequence_parallel) if mesh.tp > 1 else None
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3), plan, shape, None)
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    for name, sections in (layout.fused if layout else {}).items():  # rows reordered at apply: the model's order
        params[name] = restore_sections(params[name], sections, layout.split_params[name], mesh.tp)
    diffs = {n: (params[n].float() - p.detach()).abs().max().item() for n, p in reference.named_parameters()}
    diff = max(diffs.values())
    tp = [(n, p) for n, p in model.named_parameters()
          if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())]
    split = [n for n, p in tp if any(not pl.is_replicate() for pl in p.placements[-1:])]
    local = {n: list((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in model.named_parameters()}
    whole = {n: list(p.shape) for n, p in reference.named_parameters()}
    return {"losses": losses, "reference_losses": ref_losses, "max_param_diff": diff,
            "worst_param": max(diffs, key=diffs.get), "tp_split": len(split),
            "layout_split": len(layout.split_params) if layout else 0, "units": {u.module: u.tp for u in plan.units},
            "local_shapes": {n: local[n] if n in {m for m, _ in tp} else whole[n] for n in whole}}


def main(root: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    results: dict = {}
    for folder in sorted(Path(root).iterdir()):
        try:
            results[folder.name] = run_case(folder)
        except Exception:  # noqa: BLE001 - recorded and asserted on by the test
            results[folder.name] = {"error": traceback.format_exc()}
    finish(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
