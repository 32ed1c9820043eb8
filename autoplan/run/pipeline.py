"""Run a pipelined plan: torch.distributed.pipelining's PipelineStage and schedules, FSDP2 inside each stage.

As torchtitan composes them: the world is a pp x dp x tp DeviceMesh (`Mesh.split_pipeline`); pipeline rank p
builds the stages the plan puts on it (`StageSpec.rank`: one, or several for a looped or V-shaped schedule)
as `StageModule`s holding the model's own submodules; tensor parallelism (on the whole model, before it is
cut) and each unit's decisions (checkpointing, `fully_shard` over the stage's data-parallel ranks) are
applied by `autoplan.run.apply` exactly as without a pipeline; each stage's root is `fully_shard`ed too, so
that torch's stage defers FSDP's gradient reduction to the last micro-batch. The schedule is the class the
registry row names (cost_models.schedules), over the pipeline mesh's process group, with the loss on the
last stage and the plan's micro-batches per step; gradients are scaled by 1 / micro-batches (torch's
`scale_grads`), so a step's gradient is the mean over the step's rows, as without a pipeline.

`check_pipeline` refuses, before any rank trains, a pipeline that does not match the plan's world, a stage
naming a module the model lacks (or cutting it otherwise than a stage can run: stage_module.stage_parts), and
a schedule torch cannot run at the plan's micro-batch count (torch's own schedule class is built, on a fake
process group when none is initialised, and what it raises is reported).

The zero-bubble schedules (the registry's `splits_backward` rows) split each backward into an input-gradient
pass (I) and a later weight-gradient pass (W): torch's I collects the stage's parameters as it starts, and W
writes the gradients of those. Under FSDP2 the forward runs on the unsharded parameters; a unit resharded
after its forward (reshard_after_forward true) hands an I that follows a forward of its stage the sharded
ones, which are not in the graph, so that micro-batch's weight gradients are lost (measured on 2 x 2 gloo
ranks, 2 micro-batches: the last stage, whose I always follows its own forward, got no gradient, the stages
between only their last micro-batch's; RESULTS.md section 20). So under those schedules every unit is kept
gathered for the step whatever its kind says: what searched pipelined plans record and are priced for
(autoplan.plan.pipeline_plan), and how torchtitan runs FSDP under a pipeline.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from autoplan.errors import PlanFileError, UsageError
from autoplan.plan.pipeline_spec import PipelineSpec
from autoplan.plan.schema import Plan
from autoplan.run.named_inputs import next_token_loss
from autoplan.run.stage_module import StageModule, stage_parts
from cost_models.options import PRECISIONS, Dtype
from cost_models.schedules import SCHEDULES, StagesPerRank

__all__ = ["PipelinedModel", "check_pipeline", "pipelined_model", "rank_stages",
           "train_pipeline_step"]


# --------------------------------------------------------------------------- #
# Checks: before any rank trains
# --------------------------------------------------------------------------- #


def check_pipeline(model: nn.Module, plan: Plan) -> None:
    """Everything a pipelined plan is checked for against `model` (no-op without a pipeline): see the module
    docstring. PlanFileError naming what is wrong."""
    pipeline, cluster = plan.pipeline, plan.cluster
    if pipeline is None:
        if cluster.pp_degree > 1:
            raise PlanFileError(f"the plan's cluster has pipeline degree {cluster.pp_degree} but the plan records no "
                                "pipeline (stages, schedule); make the plan again")
        return
    if pipeline.degree != cluster.pp_degree:
        raise PlanFileError(f"the plan's pipeline has {pipeline.degree} pipeline ranks, its cluster's pipeline degree "
                            f"is {cluster.pp_degree}; the stages must run on the mesh's pipeline dimension")
    if cluster.world_size % pipeline.degree:
        raise PlanFileError(f"a pipeline of {pipeline.degree} ranks does not divide the plan's {cluster.world_size} "
                            "ranks")
    if plan.training.grad_accum_steps != pipeline.microbatches:
        raise PlanFileError(f"the pipeline runs {pipeline.microbatches} micro-batches per step, the plan's training "
                            f"{plan.training.grad_accum_steps} accumulation steps; a step's micro-batches are both")
    _check_placement(pipeline)
    stage_parts(model, pipeline)
    if not (dist.is_available() and dist.is_initialized()):  # apply, on the ranks, builds the real one
        _check_schedule(pipeline)


def _expected_rank(pipeline: PipelineSpec, index: int) -> int:
    """The pipeline rank the schedule's layout puts stage `index` on."""
    layout, degree = SCHEDULES[pipeline.schedule].stages_per_rank, pipeline.degree
    if layout is StagesPerRank.V_SHAPE and index >= degree:
        return 2 * degree - 1 - index
    return index % degree


def _check_placement(pipeline: PipelineSpec) -> None:
    row = SCHEDULES[pipeline.schedule]
    per_rank = pipeline.stages_per_rank
    if (row.stages_per_rank is StagesPerRank.ONE and per_rank != 1) or (
            row.stages_per_rank is StagesPerRank.V_SHAPE and per_rank != 2) or (
            row.stages_per_rank is StagesPerRank.LOOPED and per_rank < 2):
        raise PlanFileError(f"schedule {row.name} runs {row.stages_per_rank} stage(s) per rank; the plan has "
                            f"{len(pipeline.stages)} stages on {pipeline.degree} ranks ({per_rank} per rank)")
    for index, stage in enumerate(pipeline.stages):
        if stage.rank != _expected_rank(pipeline, index):
            raise PlanFileError(f"pipeline stage {index} is on rank {stage.rank}; schedule {row.name} "
                                f"({row.stages_per_rank}) runs it on rank {_expected_rank(pipeline, index)}")


def _schedule(pipeline: PipelineSpec, stages: list, loss_fn):
    """The registry row's torch schedule over `stages` (this rank's PipelineStages); PlanFileError with what
    torch says where it cannot run them at the plan's micro-batch count."""
    row = SCHEDULES[pipeline.schedule]
    cls = getattr(torch_schedules, row.torch_class, None)
    if cls is None:
        raise PlanFileError(f"schedule {row.name}: torch {torch.__version__} has no {row.torch_class}")
    try:
        if row.stages_per_rank is StagesPerRank.ONE:
            return cls(stages[0], pipeline.microbatches, loss_fn=loss_fn)
        return cls(stages, pipeline.microbatches, loss_fn=loss_fn)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise PlanFileError(f"torch's {row.torch_class} cannot run {pipeline.microbatches} micro-batch(es) on "
                            f"{pipeline.degree} pipeline ranks x {pipeline.stages_per_rank} stage(s): {exc}; "
                            "choose another micro-batch count or schedule") from None


def _check_schedule(pipeline: PipelineSpec) -> None:
    """Build the schedule for pipeline rank 0 on a fake process group of the pipeline's ranks: torch checks the
    micro-batch count for every rank's order as it builds it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pipeline.degree)
    try:
        count = len(pipeline.stages)
        stages = [PipelineStage(nn.Identity(), i, count, torch.device("cpu"))
                  for i, stage in enumerate(pipeline.stages) if stage.rank == 0]
        _schedule(pipeline, stages, next_token_loss)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


def rank_stages(model: nn.Module, plan: Plan, pipeline_rank: int) -> list[StageModule]:
    """The stages pipeline rank `pipeline_rank` runs, built from `model`'s own submodules, in stage order."""
    pipeline = plan.pipeline
    parts = stage_parts(model, pipeline)
    last = len(pipeline.stages) - 1
    return [StageModule(model, parts[i], i, last) for i, stage in enumerate(pipeline.stages)
            if stage.rank == pipeline_rank]


def pipelined_model(model: nn.Module, plan: Plan, pp_mesh, units: list, shard, loss_fn) -> PipelinedModel:
    """This rank's stages of `model` and their schedule: each unit (`units`: apply's (decision, kind, module),
    leaves first) `shard`ed (apply's checkpointing and fully_shard) inside the stage holding it, each stage's
    root as the plan's root unit says."""
    stages = rank_stages(model, plan, pp_mesh.get_local_rank())
    if SCHEDULES[plan.pipeline.schedule].splits_backward:  # gathered for the step: the module docstring says why
        units = [(decision, dataclasses.replace(kind, reshard_after_forward=False), module)
                 for decision, kind, module in units]
    roots = [(decision, kind) for decision, kind, _ in units if decision.module == ""]
    for stage in stages:
        shard([(decision, kind, stage.get_submodule(decision.module)) for decision, kind, _ in units
               if decision.module and _holds(stage, decision.module)] + [(*root, stage) for root in roots])
    return PipelinedModel(stages, plan, pp_mesh, loss_fn)


def _holds(stage: nn.Module, path: str) -> bool:
    try:
        stage.get_submodule(path)
    except AttributeError:
        return False
    return True


class _FakeGroupStage(PipelineStage):
    """A stage on torch's fake process group (one rank of a big world: autoplan.run.fake_world), where no peer
    answers: told its inputs' and outputs' shapes, it takes its own vote for static metadata in torch's warm-up
    (the real ranks' vote is the same: every stage is told them) and receives nothing else but buffers."""

    def _warmup_forward_vote(self, has_backward, received_acc=None):
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result=None):
        return torch.ones(1, dtype=torch.int32, device=self.device)


def _pipeline_stage(stage: StageModule, plan: Plan, device: torch.device, group) -> PipelineStage:
    count = len(plan.pipeline.stages)
    if dist.get_backend(group) != "fake":  # torch infers the shapes sent between stages at the first step
        return PipelineStage(stage, stage.stage_index, count, device, group=group)
    if plan.cluster.tp_degree > 1:
        raise UsageError("a pipelined plan with tensor parallelism does not run on a fake process group (its "
                         "stages' DTensor shapes are not told to torch here); run it for real")
    dtype = getattr(torch, Dtype(PRECISIONS[plan.training.dtype].compute_dtype).torch_name)
    inputs, outputs = stage.example_args(plan.training.micro_batch_size, plan.training.seq_len, dtype)
    return _FakeGroupStage(stage, stage.stage_index, count, device, input_args=inputs, output_args=outputs,
                           group=group)


class _OwnedLoss:
    """The loss function, its result never a view: the zero-bubble schedules' input-gradient pass detaches the
    loss in place (torch's stage_backward_input), which a view refuses, and a vocabulary-parallel loss is one (a
    replicated DTensor's local value)."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def __call__(self, output, target):
        loss = self.loss_fn(output, target)
        return loss.clone() if isinstance(loss, torch.Tensor) and loss._is_view() else loss


class PipelinedModel(nn.Module):
    """What `apply` returns for a pipelined plan: this rank's stages (`stages`, each `fully_shard`ed) and the
    schedule that runs them. Train with `step(input_ids, labels)` (one optimizer step's batch of this rank's
    data-parallel group; the schedule cuts it into the plan's micro-batches), not by calling the module."""

    def __init__(self, stages: list[StageModule], plan: Plan, pp_mesh, loss_fn=next_token_loss):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.pipeline_rank = pp_mesh.get_local_rank()
        self._group = pp_mesh.get_group()
        device = torch.device("cuda", torch.cuda.current_device()) if pp_mesh.device_type == "cuda" else torch.device(
            "cpu")
        self.pipeline_stages = [_pipeline_stage(stage, plan, device, self._group) for stage in stages]
        self.schedule = _schedule(plan.pipeline, self.pipeline_stages, _OwnedLoss(loss_fn))
        self.has_first = any(stage.stage_index == 0 for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined model trains by `step(input_ids, labels)`, which runs the schedule")

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step's batch through the pipeline; the mean loss of its micro-batches, on
        every pipeline rank (the last stage computes it and sends it to the others)."""
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        # return_outputs off: the last stage would keep every micro-batch's logits to the end of the step to hand
        # them back merged, which no training step needs
        self.schedule.step(*args, target=labels if self.has_last else None, losses=losses if self.has_last else None,
                           return_outputs=False)
        loss = (torch.stack([value.detach().float() for value in losses]).mean() if losses
                else torch.zeros((), device=labels.device))
        dist.all_reduce(loss, group=self._group)  # the last stage's loss; the others add zero
        return loss

    def init_weights(self) -> None:
        for stage in self.stages:
            stage.init_weights()


def train_pipeline_step(model: PipelinedModel, optimizer, micro_batches, device: torch.device, phase_done=None,
                        result=None) -> tuple[float, float]:
    """One optimizer step of a pipelined model over this rank's micro-batches (concatenated: the schedule cuts
    them again): (seconds, mean loss). The schedule interleaves forwards and backwards, so the step's peak is
    reported as the backward phase's (`phase_done("backward")`), then the optimizer step's."""
    start_s = time.perf_counter()
    input_ids = torch.cat([ids for ids, _ in micro_batches]).to(device)
    labels = torch.cat([labels for _, labels in micro_batches]).to(device)
    if result is not None:
        result.doing = f"running the pipeline schedule over {len(micro_batches)} micro-batches"
    loss = model.step(input_ids, labels)
    if phase_done:
        phase_done("backward")
    if result is not None:
        result.doing = "running the optimizer step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if phase_done:
        phase_done("optimizer")
    return time.perf_counter() - start_s, loss.item()
