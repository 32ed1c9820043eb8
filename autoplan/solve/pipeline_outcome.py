"""What a pipelined mesh's search finds (autoplan.solve.pipeline): each rank's plan and the pipeline's step, the
records the plan's assembly (autoplan.plan.pipeline_plan) and its inspection read, and the pipeline's figures made
from its ranks' (`priced_pipeline`, `as_sweep`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoplan.solve.solver import SolveResult, SolveStatus
from autoplan.solve.stages import StageTables
from autoplan.solve.sweep import SweepOutcome, SweepStep
from cost_models.evaluate import Evaluation
from cost_models.pipeline import HeldAllStep, bubble_slots, makespan_s
from cost_models.table import CostTable

__all__ = ["PipelineOutcome", "RankOutcome", "as_sweep", "priced_pipeline"]


@dataclass
class RankOutcome:
    """One pipeline rank's units solved: its stages, tables, choices and figures (its in-flight bytes in)."""

    rank: int
    stages: list[int]  # the stage indices it runs, in forward order
    chunks: tuple[tuple[int, int], ...]  # their op ranges [first, last] in the model's trace
    source: object  # its TableSource (StageTables, or their tensor-parallel view); None out of a worker
    table: CostTable  # as the pipeline runs it (cost_models.pipeline.pipelined)
    choices: list[int]
    evaluation: Evaluation  # with what it holds all step added (micro-batches in flight, unsharded parameters)
    flight: float
    status: SolveStatus
    send_s: float  # its sends per micro-batch
    held: HeldAllStep | None = None  # what it holds all step beyond one micro-batch's timeline

    @property
    def slot_s(self) -> float:
        return self.evaluation.micro_batch_s + self.send_s

    @property
    def positions(self) -> list[int]:
        """Its ops' positions in the model's trace, in its tables' order."""
        return [p for first, last in self.chunks for p in range(first, last + 1)]

    @property
    def trace_ops(self) -> list:
        """Its ops as traced (their module paths)."""
        stage = self.source if isinstance(self.source, StageTables) else self.source.base
        return stage.trace_1.ops


@dataclass
class PipelineOutcome:
    """A pipelined mesh's best plan: the schedule, the cut, every rank's plan and the step's figures."""

    schedule: str
    degree: int
    microbatches: int
    micro_batch_size: int
    cuts: list[int]  # per stage, its first unit (an index into stages.forward_units)
    ranks: list[RankOutcome]
    step_time_s: float
    bubble_s: float
    p2p_s: float
    steps: list[SweepStep] = field(default_factory=list)

    @property
    def busiest(self) -> RankOutcome:
        """The rank with the highest peak (the plan's predicted peak)."""
        return max(self.ranks, key=lambda r: (r.evaluation.peak_mem_bytes, -r.rank))

    @property
    def samples_per_step(self) -> int:
        return self.ranks[0].table.samples_per_step


def priced_pipeline(row, pp: int, m: int, micro_batch_size: int, cuts: list[int],
                    ranks: list[RankOutcome]) -> PipelineOutcome:
    """The pipeline of these ranks under `row` (a schedule of cost_models.schedules): its makespan, bubble, sends."""
    slot = max(r.slot_s for r in ranks)
    optimizer = max(r.evaluation.optimizer_s for r in ranks)
    step = makespan_s(slot, optimizer, row, pp, m)
    bubble = bubble_slots(row, pp) * slot
    p2p = (m + bubble_slots(row, pp)) * max(r.send_s for r in ranks)
    return PipelineOutcome(row.name, pp, m, micro_batch_size, cuts, ranks, step, bubble, p2p)


def as_sweep(outcome: PipelineOutcome, wall_s: float) -> SweepOutcome:
    """The pipeline in the sweep's terms: the busiest rank's table and evaluation, its step the makespan."""
    busiest = outcome.busiest
    evaluation = replace(busiest.evaluation, step_time_s=outcome.step_time_s,
                         optimizer_s=max(r.evaluation.optimizer_s for r in outcome.ranks))
    status = SolveStatus.FIXED if all(r.status == SolveStatus.FIXED for r in outcome.ranks) else busiest.status
    result = SolveResult(status, busiest.choices, outcome.step_time_s, None, wall_s, 0, 0, 0)
    return SweepOutcome(table=busiest.table, choices=busiest.choices, evaluation=evaluation, result=result,
                        steps=outcome.steps, tables=[], wall_time_s=wall_s)
