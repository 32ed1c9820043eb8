"""What a pipelined mesh's search finds (autoplan.solve.pipeline): each rank's plan and the pipeline's step, the
records the plan's assembly (autoplan.plan.pipeline_plan) and its inspection read."""

from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.solve.solver import SolveStatus
from autoplan.solve.stages import StageTables
from autoplan.solve.sweep import SweepStep
from cost_models.evaluate import Evaluation
from cost_models.pipeline import HeldAllStep
from cost_models.table import CostTable

__all__ = ["PipelineOutcome", "RankOutcome"]


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
