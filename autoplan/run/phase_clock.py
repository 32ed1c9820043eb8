"""The seconds a training step spends in each phase: forward (the loss included), backward and the optimizer step.

Why: a step's time alone says that a prediction missed, not where. On a GPU the phases are timed by CUDA events
recorded on the current stream as each phase's work is issued, read once the step has synchronised, so timing
adds no synchronisation to the step it times; on the CPU the work is done when the call returns, and the wall
clock is read. A phase that repeats (the forward and backward of each accumulated micro-batch) adds up.
"""

from __future__ import annotations

import time

import torch

__all__ = ["PhaseClock"]


class PhaseClock:
    """Marks a step's start and the end of each phase (`done`, as the step's `phase_done` callback); `seconds()`
    after the step's last synchronisation gives each phase's seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def done(self, phase: str) -> None:
        self.marks.append((phase, self._now()))

    def seconds(self) -> dict[str, float]:
        """Seconds per phase since `start` (each phase from the mark before its end); the step must have
        synchronised on a GPU (its events have completed)."""
        out: dict[str, float] = {}
        for (_, before), (phase, after) in zip(self.marks, self.marks[1:]):
            spent = before.elapsed_time(after) / 1e3 if self.cuda else after - before
            out[phase] = out.get(phase, 0.0) + spent
        return out
