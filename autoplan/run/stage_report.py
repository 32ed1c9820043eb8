"""A pipelined run's memory per stage: each pipeline rank's measured peak beside its stages' predicted one.

A pipeline's ranks do not hold alike: the first stages keep more micro-batches' activations in flight
(1F1B), the embedding and the head sit on the first and last. So a pipelined `autoplan apply` reports,
for each pipeline rank (the ranks r with `Mesh.pipeline_rank(r)` equal: the stage's data- and
tensor-parallel ranks), the largest peak its ranks measured beside the plan's `StageSpec.peak_mem_bytes`
(a looped schedule's rank runs several stages: the largest of theirs, each being the busiest point of
that rank). Each rank reports its own peak and its pipeline rank (worker.RankResult).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from autoplan.plan.schema import Plan, Prediction
from autoplan.sizes import format_bytes

__all__ = ["StagePeak", "format_stage_peaks", "stage_peaks", "stage_prediction"]


class StagePeak(BaseModel):
    """One pipeline rank's stages: predicted and measured peak memory per rank."""

    model_config = ConfigDict(extra="forbid")

    pipeline_rank: int
    stages: list[int]  # the stages it runs (indices into the plan's pipeline)
    predicted_peak_bytes: int  # the largest StageSpec.peak_mem_bytes of them (0: the plan predicts none)
    measured_peak_bytes: int | None  # the largest over its ranks; None where none of them reported
    ranks: list[int]  # its ranks that reported


def stage_peaks(plan: Plan, results: list) -> list[StagePeak] | None:
    """Per pipeline rank, predicted beside measured (`results`: the ranks' RankResults); None without a pipeline."""
    if plan.pipeline is None:
        return None
    peaks = []
    for rank in range(plan.pipeline.degree):
        indices = [i for i, stage in enumerate(plan.pipeline.stages) if stage.rank == rank]
        mine = [r for r in results if r.pipeline_rank == rank]
        peaks.append(StagePeak(
            pipeline_rank=rank, stages=indices,
            predicted_peak_bytes=max(plan.pipeline.stages[i].peak_mem_bytes for i in indices),
            measured_peak_bytes=max((r.peak_mem_bytes for r in mine), default=None),
            ranks=sorted(r.rank for r in mine)))
    return peaks


def format_stage_peaks(peaks: list[StagePeak] | None) -> list[str]:
    """Lines of the report's table: one per pipeline rank."""
    lines = []
    for peak in peaks or []:
        pred, meas = peak.predicted_peak_bytes, peak.measured_peak_bytes
        label = f"  stage{'s' if len(peak.stages) > 1 else ''} {', '.join(map(str, peak.stages))}"
        ratio = f"{meas / pred:.2f}" if meas is not None and pred else "-"
        lines.append(f"{label:24}{format_bytes(pred) if pred else '-':>14}"
                     f"{format_bytes(meas) if meas is not None else '-':>14}{ratio:>21}")
    return lines


def stage_prediction(plan: Plan, rank: int) -> Prediction:
    """The plan's prediction with the peak of the stage(s) global rank `rank` runs (the largest
    StageSpec.peak_mem_bytes of its pipeline rank's stages): what one rank of a pipelined plan is compared with."""
    pipeline_rank = plan.cluster.mesh.pipeline_rank(rank)
    on_rank = [(i, stage) for i, stage in enumerate(plan.pipeline.stages) if stage.rank == pipeline_rank]
    return plan.predicted.model_copy(update={
        "peak_mem_bytes": max(stage.peak_mem_bytes for _, stage in on_rank),
        "peak_point": f"stage {', '.join(str(i) for i, _ in on_rank)}'s busiest point (StageSpec.peak_mem_bytes)"})
