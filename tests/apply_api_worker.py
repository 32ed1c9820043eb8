"""`autoplan.apply` as a training script calls it, run by test_apply_api.py under torchrun with 2 gloo ranks:
the meshes it takes (the plan's Mesh record, named DeviceMeshes, a mesh with a dimension of the script's own),
an optimizer factory and an LR scheduler factory. Each case trains and compares with a single-process
reference on the same batches; rank 0 writes the results as JSON."""

from __future__ import annotations

import functools
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from apply_parity_worker import SEED, STEPS, batch_shape, cpu_model, finish, loss_of, reference_run
from planmaker import make_plan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoplan.errors import AutoplanError
from autoplan.run.apply import apply
from autoplan.run.data import SyntheticTokens, rank_micro_batches
from cost_models.mesh import Mesh

BLOCKS = {"layers.0": "hybrid", "layers.1": "replicate+ckpt"}


def train(model, optimizer, plan, data_rank: int, data_world: int, scheduler=None) -> list[float]:
    """STEPS steps on the synthetic global batch; the losses on this rank's rows."""
    shape = batch_shape(plan, data_world)
    data = SyntheticTokens(plan.model.config["vocab_size"], seed=SEED)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for input_ids, labels in rank_micro_batches(data.global_batch(step, shape), data_rank, shape):
            loss = loss_of(model, input_ids, labels) / shape.grad_accum_steps
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total.item())
    return losses


def reference(plan, make_optimizer, data_world: int, scheduler=None) -> list[float]:
    """One process, the whole global batch of `data_world` ranks at once."""
    return reference_run(plan, batch_shape(plan, data_world), make_optimizer, scheduler)[0]


def mesh_record() -> dict:
    """The plan's Mesh record: a hybrid unit over its 2 nodes of 1 GPU (replicated across them)."""
    plan = make_plan("llama-tiny", BLOCKS, nodes=2, gpus_per_node=1)
    model, optimizer = apply(cpu_model("llama-tiny"), plan, mesh=Mesh(nodes=2, gpus_per_node=1))
    losses = train(model, optimizer, plan, dist.get_rank(), 2)
    fraction = model.get_submodule("layers.0.attn.wq").weight.to_local().numel() / (64 * 64)
    return {"losses": _mean(losses), "reference": reference(plan, lambda p: torch.optim.AdamW(p, lr=1e-3), 2),
            "hybrid_local_fraction": fraction}


def outer_dimension() -> dict:
    """A mesh ("pp", "dp") of 2 x 1: the plan (for 1 rank) runs on each "dp" slice; replicate and hybrid units
    need 2-D meshes of a slice, made for every slice together."""
    plan = make_plan("llama-tiny", BLOCKS, world_size=1, nodes=1, gpus_per_node=1)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    model, optimizer = apply(cpu_model("llama-tiny"), plan, mesh=mesh)
    losses = train(model, optimizer, plan, 0, 1)
    return {"losses": _mean(losses), "reference": reference(plan, lambda p: torch.optim.AdamW(p, lr=1e-3), 1),
            "mesh_dims": list(model.get_submodule("layers.1.attn.wq").weight.device_mesh.mesh_dim_names)}


def named_dp_with_factories() -> dict:
    """A named ("dp",) mesh, SGD with momentum from a factory, a step LR schedule."""
    plan = make_plan("llama-tiny", {"layers.0": "shard", "layers.1": "shard_keep+sel"})
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    factory = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    schedule = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = apply(cpu_model("llama-tiny"), plan, mesh=mesh, optimizer=factory, scheduler=schedule)
    model, optimizer = applied
    losses = train(model, optimizer, plan, dist.get_rank(), 2, applied.scheduler)
    return {"losses": _mean(losses), "reference": reference(plan, factory, 2, schedule),
            "optimizer": type(optimizer).__name__, "lr_after": optimizer.param_groups[0]["lr"],
            "warnings": [str(w.message) for w in caught], "sharded": isinstance(model.norm.weight, DTensor)}


def refusals() -> dict:
    plan = make_plan("llama-tiny", {"layers.0": "shard"})
    found = {}
    cases = {
        "lr_and_factory": dict(mesh=None, lr=0.1, optimizer=torch.optim.SGD),
        "factory_not_an_optimizer": dict(mesh=None, optimizer=lambda params: "adam"),
        "unnamed_2d": dict(mesh=init_device_mesh("cpu", (2, 1))),
        "tp_dimension_without_tp_plan": dict(mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))),
        "record_of_other_degrees": dict(mesh=Mesh(nodes=1, gpus_per_node=2, tp=2)),
    }
    for name, kwargs in cases.items():
        try:
            apply(cpu_model("llama-tiny"), plan, **kwargs)
            found[name] = None
        except AutoplanError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def _mean(losses: list[float]) -> list[float]:
    tensor = torch.tensor(losses)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results: dict = {}
    for case in (mesh_record, outer_dimension, named_dp_with_factories, refusals):
        try:
            results[case.__name__] = case()
        except Exception:  # noqa: BLE001 - recorded and asserted on by the test
            results[case.__name__] = {"error": traceback.format_exc()}
    finish(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
