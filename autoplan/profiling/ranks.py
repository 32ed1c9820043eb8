"""Everything a profile measures on several ranks at once, from the measurement cache where it is there:
collectives, overlap, FSDP2's overheads and the calibration training steps (comm.py runs them).

Each item is cached on its own as the ranks finish it, under a key holding every setting it depends
on (besides the cache's scope: device, torch version, threads, repeat settings), so an interrupted
profile resumes after the last finished collective round or calibration step, and a changed setting
re-measures what it changes and nothing else. Rounds are cached one by one: a collective's time is
the median over its rounds, a calibration step's the fastest round.
"""

from __future__ import annotations

import statistics

from autoplan.profiling.cache import MeasurementCache
from autoplan.profiling.calibration import calibration_cases, case_key, fastest_rounds, step_key
from autoplan.profiling.comm import (
    COLLECTIVES,
    CommRequest,
    group_sizes,
    measurement_key,
    message_bytes,
    run_comm_benchmark,
)
from autoplan.profiling.fsdp import DEPTHS, TINY_TOKENS, TINY_WIDTH, WIDE

__all__ = ["OVERLAP_GATHER_BYTES", "measure_on_ranks"]

OVERLAP_GATHER_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}


def measure_on_ranks(settings, kind: str, backend: str, threads: int | None, sizes: tuple[int, ...],
                     cache: MeasurementCache) -> dict:
    """{"collectives": {(collective, group, bytes): seconds}, "overlap", "fsdp", "calibration": {case_key:
    phase times}, "measured": items measured now, "items": items in all}; spawns the ranks only for what
    the cache lacks. `settings`: a ProfileSettings."""
    ranks = f"{backend}:n{settings.nproc}"
    wanted = sorted({(c, g, message_bytes(s, g)) for g in group_sizes(settings.nproc) for c in COLLECTIVES
                     for s in sizes}, key=lambda m: (COLLECTIVES.index(m[0]), m[1], m[2]))
    collective_keys = {m: [f"comm:{backend}:{measurement_key(*m)}:round{r}"
                           for r in range(settings.comm_rounds)] for m in wanted}
    overlap_key = (f"overlap:{ranks}:{OVERLAP_GATHER_BYTES[kind]}:"
                   f"{settings.overlap_phase_s}s:x{settings.overlap_trials}")
    fsdp_key = (f"fsdp:{ranks}:depths{','.join(map(str, DEPTHS))}:tiny{TINY_WIDTH}x{TINY_TOKENS}:"
                f"wide{'x'.join(map(str, WIDE[kind]))}:calls{settings.fsdp_calls}")
    cases = calibration_cases(kind)
    step_keys = {case: [f"calibration:{ranks}:" + step_key(kind, *case, settings.calibration_steps, r)
                        for r in range(settings.calibration_rounds)] for case in cases}

    # round after round, so that a burst of load spoils one round of a size or a case, not all of its rounds
    request = CommRequest(
        backend=backend, device_type=kind, world_size=settings.nproc, threads=threads,
        collectives=tuple((keys[r], *m) for r in range(settings.comm_rounds) for m, keys in collective_keys.items()
                          if keys[r] not in cache),
        # one rank's all-gather moves nothing to overlap with: a one-process profile takes another's overlap
        overlap=(overlap_key, OVERLAP_GATHER_BYTES[kind]) if overlap_key not in cache and settings.nproc > 1 else None,
        overlap_phase_s=settings.overlap_phase_s, overlap_trials=settings.overlap_trials, repeats=settings.repeats,
        fsdp=fsdp_key if fsdp_key not in cache else None, fsdp_calls=settings.fsdp_calls,
        calibration=tuple((keys[r], *case) for r in range(settings.calibration_rounds)
                          for case, keys in step_keys.items() if keys[r] not in cache),
        calibration_steps=settings.calibration_steps, show_progress=settings.progress,
    )
    if not request.empty:
        run_comm_benchmark(request, cache.put)
    return {
        "measured": (len(request.collectives) + (request.overlap is not None) + (request.fsdp is not None)
                     + len(request.calibration)),
        "items": sum(map(len, collective_keys.values())) + 1 + (settings.nproc > 1) + sum(map(len, step_keys.values())),
        "collectives": {m: statistics.median(cache.get(k) for k in keys) for m, keys in collective_keys.items()},
        "overlap": cache.get(overlap_key),
        "fsdp": cache.get(fsdp_key),
        "calibration": {case_key(*case): fastest_rounds([cache.get(k) for k in keys])
                        for case, keys in step_keys.items()},
    }
