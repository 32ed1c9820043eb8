"""The plan file's record of a pipeline: its stages, their schedule and the step's micro-batches.

A plan without one (`Plan.pipeline` None, every older plan) runs as one stage. With one, the mesh has a
pipeline dimension of `degree` ranks (the outermost: `ClusterSpec.pp_degree`); the plan's units are cut
into contiguous stages, stage i run by pipeline rank `StageSpec.rank`, and every unit keeps its own
decisions (sharding over its stage's data-parallel ranks, checkpointing, offload, tensor parallelism).
`apply` builds each stage from `modules`; reports and `diff` read the boundaries and the predicted
figures. Under a pipeline the units' parameters stay gathered from the first forward of a step to its last
backward, whatever their sharding kinds' reshard_after_forward (torchtitan; torch's PipelineStage keeps
them unsharded between micro-batches): the kinds choose the shard group, the figures price that.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator
from pydantic.functional_validators import AfterValidator

from autoplan.plan.figures import Count, Seconds, StrictRecord
from cost_models.schedules import SCHEDULES

__all__ = ["PipelineSpec", "StageSpec"]


def _schedule(name: str) -> str:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; the schedules are {', '.join(SCHEDULES)}")
    return name


ScheduleName = Annotated[str, AfterValidator(_schedule)]


class StageSpec(StrictRecord):
    """One pipeline stage: what it holds and runs, and its predicted figures."""

    rank: Count  # the pipeline rank that runs it (0 .. degree - 1)
    modules: list[str] = Field(min_length=1)  # module paths it holds, in forward order ("model.embed", "model.layers.0")
    units: list[str]  # the plan's units (UnitDecision.module) it runs; "" is the root's own parameters
    peak_mem_bytes: Count  # the busiest point of one of its ranks, its in-flight micro-batches included
    fwd_s: Seconds  # one micro-batch's forward through the stage
    bwd_s: Seconds  # one micro-batch's backward (with recomputation)
    # micro-batches' worth of its rank's activations held at its peak (the schedule's in-flight count); 0: not said
    in_flight: Seconds = Field(default=0.0, exclude_if=lambda value: value == 0.0)


class PipelineSpec(StrictRecord):
    """The pipeline a plan runs: `degree` ranks, `len(stages)` stages in order, `microbatches` per step."""

    degree: int = Field(ge=2)  # pipeline ranks: the mesh's outermost dimension
    schedule: ScheduleName  # a row of cost_models.schedules.SCHEDULES
    microbatches: int = Field(ge=1)  # per step, through every stage (each of the plan's micro-batch size)
    stages: list[StageSpec] = Field(min_length=2)  # in forward order; degree x stages per rank of them
    bubble_s: Seconds = 0.0  # per step, the time a rank idles while the pipeline fills and drains
    p2p_s: Seconds = 0.0  # per step, the exposed point-to-point sends between stages
    # per step, the slowest rank's optimizer step after the pipeline drains (0: not said)
    optimizer_s: Seconds = Field(default=0.0, exclude_if=lambda value: value == 0.0)

    @model_validator(mode="after")
    def _stages_on_ranks(self) -> PipelineSpec:
        if len(self.stages) % self.degree:
            raise ValueError(f"{len(self.stages)} stages do not divide over {self.degree} pipeline ranks")
        ranks = sorted({stage.rank for stage in self.stages})
        if ranks != list(range(self.degree)):
            raise ValueError(f"the stages' ranks {ranks} are not every pipeline rank 0..{self.degree - 1}")
        return self

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // self.degree
