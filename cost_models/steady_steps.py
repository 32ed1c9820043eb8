"""A recorded training run carried on to more steps without recording them: the last recorded step's allocations and
frees repeated, so that a replay measures what the caching allocator needs once its cache has settled.

Why: natively the segments one step leaves cached decide where the next step's blocks land, so what a step strands
can grow from step to step until the cache's layout repeats. A replay records three steps (the warm-up that makes
the optimizer's states and two more; autoplan.run.allocator_fit.record_step), and there gpt2-1.5b's default plan at
12GB needs 10.55 GiB, where from its seventh step on it needs 10.88 (benchmarks/allocator_steps.py). Recording more
steps on fake tensors costs 2-5 CPU-s a step for a 7B model; repeating one costs nothing, and is exact where the
steps are alike: from the second step on, a step's events are the same requests in the same order, each freeing
what it made or what the step before made in the same place (checked: the last two recorded steps must be alike so,
or nothing is repeated).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEADY_STEPS", "Steps", "repeat_steps"]

# The most steps a replay's events are carried to. A replay stops early where the allocator's state at the start of
# a repeated step is the one at the start of the step before (then every later step goes as that one did:
# cost_models.allocator_replay); the slowest of the default plans of benchmarks/allocator.py to get there, gpt2-1.5b
# at 8GB with expandable segments, does so by its 30th (benchmarks/allocator_steps.py).
STEADY_STEPS = 20


@dataclass(frozen=True)
class Steps:
    """A recorded run's events carried on to more steps (record_step's events and starts, as `repeat_steps` makes
    them), and where a replay may check whether its allocator has settled."""

    events: list[tuple]
    starts: list[int]
    recorded: int | None  # the steps recorded, those after them repeated; None where none is

    def checks(self) -> dict[int, int]:
        """Event index -> step, for each step whose step before was a repeated one: there the blocks alive are
        those made before the repetition began and those the step before made (`role`), so the allocator's state
        can be compared with the one at the start of the step before."""
        if self.recorded is None:
            return {}
        firsts = self._firsts()
        return {firsts[step]: step for step in range(self.recorded + 1, len(firsts))}

    def recorded_end(self) -> int:
        """The index of the first repeated event: the recorded steps are the events before it."""
        if self.recorded is None:
            return len(self.events)
        return self._firsts()[self.recorded]

    def _firsts(self) -> list[int]:
        """Each step's first event index (`starts` without the backward and optimizer marks)."""
        return [start for start in self.starts if start >= 0]

    @staticmethod
    def role(key, step: int):
        """What an allocation's key is at the start of `step`, alike in every repeated step: a repeated step's
        allocation by how many steps before it was made and its place in that step, any other by itself."""
        if isinstance(key, tuple) and key and key[0] == "repeated":
            return ("made", step - key[1], key[2])
        return key


def repeat_steps(events: list[tuple], starts: list[int], steps: int = STEADY_STEPS) -> Steps:
    """`events` (cost_models.allocator_replay's: ("alloc", key, bytes, stream), ("free", key)) carried on to `steps`
    steps by repeating the last recorded one, and its `starts` (record_step's: each step's first event index, and
    negative, the start of each backward and optimizer step within it) with them. The recording as it is
    (`recorded` None) where it holds `steps` or more, fewer than three, or where its last two steps differ (then
    repeating one would not be the run)."""
    ends = [start for start in starts if start >= 0] + [len(events)]
    recorded = len(ends) - 1
    as_recorded = Steps(events, starts, None)
    if recorded >= steps or recorded < 3:
        return as_recorded
    before, last = (events[ends[i]:ends[i + 1]] for i in (recorded - 2, recorded - 1))
    shape = _shape(last, events[ends[recorded - 2]:ends[recorded - 1]])
    if shape is None or shape != _shape(before, events[ends[recorded - 3]:ends[recorded - 2]]):
        return as_recorded
    events, starts = list(events), list(starts)
    marks = [start - ends[-2] if start >= 0 else start + ends[-2] for start in starts if abs(start) >= ends[-2]]
    previous = [event[1] for event in last if event[0] == "alloc"]  # the keys the last step made, in order
    for step in range(recorded, steps):
        offset = len(events)
        starts += [mark + offset if mark >= 0 else mark - offset for mark in marks]
        made: list = []
        for event in shape:
            if event[0] == "alloc":
                made.append(("repeated", step, len(made)))
                events.append(("alloc", made[-1], event[2], event[3]))
            else:
                kind, index = event[1]
                events.append(("free", made[index] if kind == "made" else previous[index]))
        previous = made
    return Steps(events, starts, recorded)


def _shape(step: list[tuple], before: list[tuple]) -> list[tuple] | None:
    """A step's events with each key named by where it was made: ("made", i) for the step's i-th allocation,
    ("before", i) for the step before's; None where the step frees anything made earlier (not a step that repeats)."""
    made: dict = {}
    made_before = {event[1]: index for index, event in enumerate(e for e in before if e[0] == "alloc")}
    shape = []
    for event in step:
        if event[0] == "alloc":
            made[event[1]] = len(made)
            shape.append(("alloc", None, event[2], event[3]))
        elif event[1] in made:
            shape.append(("free", ("made", made[event[1]])))
        elif event[1] in made_before:
            shape.append(("free", ("before", made_before[event[1]])))
        else:
            return None
    return shape
