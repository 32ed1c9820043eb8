"""The one registry of pipeline schedules: what each is, as torch.distributed.pipelining runs it.

A pipeline splits the model's units into contiguous stages, one (or, for a looped schedule, several
"virtual" stages) per pipeline rank, and runs a step's micro-batches through them. Schedules differ in
the order of the micro-batches' forwards and backwards, which sets two costs the search prices: the
bubble (time a rank idles while the pipeline fills and drains) and the activations a stage holds at its
peak (the micro-batches whose forward ran and whose backward has not). A row says what a schedule is in
declarative terms; the pricing (cost_models) and the run (autoplan.run) read the row, never the name.

Sources: GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2021), interleaved 1F1B
(Megatron-LM, Narayanan et al. 2021), zero bubble (Qi et al. 2024), and torch's schedule classes.

This module imports nothing from autoplan and nothing from torch: it is data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULES", "InFlight", "ScheduleRow", "StagesPerRank"]


class StagesPerRank(str, Enum):
    """How many stages one pipeline rank runs."""

    ONE = "one"  # stage i on pipeline rank i
    LOOPED = "looped"  # v >= 2 stages per rank, stage i on rank i % pp (Megatron's interleaving)
    V_SHAPE = "v_shape"  # exactly 2 per rank, stage i on rank i and stage 2pp-1-i on rank i (ZB-V)

    def __str__(self) -> str:
        return self.value


class InFlight(str, Enum):
    """Which micro-batches' activations a stage holds at its peak."""

    ALL = "all"  # every micro-batch's forward runs before any backward (GPipe)
    WARMUP = "warmup"  # at most the pipeline depth ahead of the stage: pp - rank for 1F1B and its variants

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ScheduleRow:
    name: str
    """the name plans, settings and the CLI use"""

    torch_class: str
    """the class in torch.distributed.pipelining that runs it"""

    stages_per_rank: StagesPerRank
    """one stage per rank, several looped, or two in a V"""

    in_flight: InFlight
    """which micro-batches' activations a stage holds at its peak"""

    splits_backward: bool
    """the backward runs as input gradients first and weight gradients later, filling the bubble"""

    description: str
    """one line for reports and --help"""


SCHEDULES: dict[str, ScheduleRow] = {row.name: row for row in (
    ScheduleRow("gpipe", "ScheduleGPipe", StagesPerRank.ONE, InFlight.ALL, False,
                "all forwards, then all backwards: the simplest, holds every micro-batch's activations"),
    ScheduleRow("1f1b", "Schedule1F1B", StagesPerRank.ONE, InFlight.WARMUP, False,
                "one forward, one backward: GPipe's bubble, at most pp micro-batches in flight"),
    ScheduleRow("interleaved_1f1b", "ScheduleInterleaved1F1B", StagesPerRank.LOOPED, InFlight.WARMUP, False,
                "1F1B over v looped stages per rank: the bubble divided by v, v times the sends"),
    ScheduleRow("zero_bubble", "ScheduleInterleavedZeroBubble", StagesPerRank.LOOPED, InFlight.WARMUP, True,
                "interleaved 1F1B with the weight gradients deferred into the bubble"),
    ScheduleRow("zbv", "ScheduleZBVZeroBubble", StagesPerRank.V_SHAPE, InFlight.WARMUP, True,
                "zero bubble on two stages per rank laid in a V: the first and last stages on rank 0"),
)}

DEFAULT_SCHEDULE = "1f1b"
