"""What was alive at a CUDA run's peak, and where each block was allocated.

A measured peak above the predicted one says that something is alive that the memory model does not count,
not what. torch's allocator history (`torch.cuda.memory._record_memory_history`) records every allocation and
free with its Python stack; replaying it to the moment the allocated bytes peaked gives the blocks alive then,
grouped by where they were allocated. The GPU kit (benchmarks/gpu_truth.py) records this for the runs whose
peak its prediction misses, so that a GPU lent for minutes explains its misses for the sessions without one.

The replay (`live_at_peak`) is plain data and runs anywhere; `recorded_peak` needs CUDA.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

__all__ = ["PeakGroup", "live_at_peak", "recorded_peak"]

MAX_ENTRIES = 2_000_000  # allocator events kept (a ring buffer: an older event lost is a block not seen)


@dataclass(frozen=True)
class PeakGroup:
    """Blocks alive at the peak that were allocated at the same place, with the same size."""

    bytes: int  # all of them
    blocks: int
    block_bytes: int
    where: str  # the innermost frames outside torch's own modules, then the innermost of torch's


def _where(frames: list[dict], depth: int = 3) -> str:
    """The allocation's place: up to `depth` innermost frames outside torch, the innermost torch frame first."""
    if not frames:
        return "(no stack recorded)"
    ours = [f for f in frames if "/torch/" not in f.get("filename", "")][:depth]
    shown = [frames[0]] + [f for f in ours if f is not frames[0]]
    return " <- ".join(f"{'/'.join(f.get('filename', '?').rsplit('/', 2)[-2:])}:{f.get('line', '?')} "
                       f"{f.get('name', '')}" for f in shown)


def live_at_peak(events: Iterable[dict], top: int = 12) -> dict:
    """Replays one device's allocator events ("alloc" adds a block, "free_completed" takes it back; blocks
    allocated before the recording began are not seen) to the peak of the allocated bytes. Returns the peak
    (relative to what was allocated when the recording began), the event index it was reached at, and the
    `top` groups of blocks alive then, largest first."""
    events = list(events)
    current = peak = 0
    at = -1
    live: dict[int, int] = {}
    for index, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])
        if current > peak:
            peak, at = current, index
    alive: dict[int, dict] = {}
    for event in events[:at + 1]:  # again, to the peak, keeping the events of the blocks alive there
        if event.get("action") == "alloc":
            alive[event["addr"]] = event
        elif event.get("action") == "free_completed":
            alive.pop(event["addr"], None)
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for event in alive.values():
        groups[(_where(event.get("frames") or []), event["size"])].append(event["size"])
    ranked = sorted((PeakGroup(sum(sizes), len(sizes), size, where) for (where, size), sizes in groups.items()),
                    key=lambda group: -group.bytes)
    return {"peak_bytes": peak, "event_index": at, "events": len(events), "blocks": len(alive),
            "groups": [asdict(group) for group in ranked[:top]]}


def recorded_peak(run: Callable[[], object], device_index: int = 0, top: int = 12) -> dict:
    """`run()` with CUDA's allocator history recorded (Python stacks); what was alive at its peak. The
    recording is stopped whatever `run` raises; its exception is raised after."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=MAX_ENTRIES)
    try:
        run()
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces") or []
    return live_at_peak(traces[device_index] if device_index < len(traces) else [], top)
