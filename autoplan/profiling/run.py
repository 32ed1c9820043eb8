"""`autoplan profile` end to end: measure ops, collectives, overlap, the optimizer step and the host link
on this device (from the cache where already measured), fit, and assemble a DeviceProfile. The ops' own
timing steps live in op_timings.py, the calibration steps in calibration.py, the host link in host_link.py.

One process (`nproc` 1, a machine with one GPU) measures no collectives: its links, collective fits and
overlap are then another profile's (`links_from`, by default the shipped datasheet profile of the same
device), and its provenance's sources say so."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from autoplan.errors import UsageError
from autoplan.machine import machine_identity
from autoplan.profiling import device as device_bench
from autoplan.profiling.cache import MeasurementCache, default_cache_dir
from autoplan.profiling.calibration import (
    CALIBRATION_ROUNDS,
    CALIBRATION_SEQ_LEN,
    TIMED_STEPS,
    WARMUP_STEPS,
    calibration_workloads,
)
from autoplan.profiling.calibration_fit import fit_calibration
from autoplan.profiling.comm import default_backend
from autoplan.profiling.defaults import DEFAULT_COMM_SIZES_BYTES, DEFAULT_DTYPES, DEFAULT_MODELS, DEFAULT_SWEEP
from autoplan.profiling.fit import FitReport, fit_affine, fit_op_families, heldout_errors
from autoplan.profiling.fsdp import FSDP_CALLS
from autoplan.profiling.host_link import HOST_COPY_BYTES, host_threads_per_rank, measure_host_link
from autoplan.profiling.op_timings import measure_ops, points_and_timings, remeasure_outliers
from autoplan.profiling.ops import (
    OpCase,
    backward_floor_s,
    collect_cases,
    sweep_workload,
    unique_cases,
    zoo_workload,
)
from autoplan.profiling.overlap import OVERLAP_PHASE_S, OVERLAP_TRIALS
from autoplan.profiling.provenance import measurement_sources, profile_provenance
from autoplan.profiling.ranks import measure_on_ranks
from autoplan.profiling.timing import Repeats
from autoplan.profiling.tp_costs import measure_tp_costs
from autoplan.run.host_memory import FIRST_TOUCH_KEPT, keep_freed_memory
from cost_models.comm import ring_factor
from cost_models.profile import CollectiveFit, DeviceProfile, FsdpOverhead, HostLink, Link, Overlap, Provenance

__all__ = ["DEFAULT_MODELS", "DEFAULT_DTYPES", "ProfileSettings", "CollectiveReport", "ProfileResult", "measure_profile",
           "default_profile_name"]

@dataclass
class ProfileSettings:
    device: str = "cpu"
    nproc: int = 2
    models: dict[str, tuple[int, ...]] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    seq_len: int | None = None  # None: each model's context length, as the search plans with
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    sweep: tuple[tuple[int, int], ...] | None = None  # None: DEFAULT_SWEEP for the device
    comm_sizes_bytes: tuple[int, ...] | None = None  # None: DEFAULT_COMM_SIZES_BYTES for the device
    threads: int | None = None  # CPU intra-op threads per rank; None: cores / nproc (what each rank gets)
    backend: str | None = None  # None: nccl on cuda, gloo on cpu
    repeats: Repeats = field(default_factory=Repeats)
    overlap_phase_s: float = OVERLAP_PHASE_S  # seconds per loop and trial of the overlap measurement
    overlap_trials: int = OVERLAP_TRIALS
    comm_rounds: int = 3  # each collective size measured once per round, median over rounds
    calibration_rounds: int = CALIBRATION_ROUNDS  # each calibration step timed once per round, fastest kept
    calibration_steps: tuple[int, int] = (WARMUP_STEPS, TIMED_STEPS)  # (warm-up, timed) training steps per round
    fsdp_calls: int = FSDP_CALLS  # timed calls per phase of FSDP2's overhead stacks (fsdp.py)
    quick: bool = False  # a rough run (`--quick`): named "...-quick" and marked so in its provenance
    cache_dir: Path | None = field(default_factory=default_cache_dir)  # None: no cache
    name: str | None = None  # None: default_profile_name(): "<device>-<backend>-<nproc>", "-quick" if quick
    progress: bool = True
    # nproc 1: the profile whose links, collective fits and overlap to take (None: the shipped datasheet
    # profile of this device); unused with several processes, which measure their own
    links_from: str | None = None
    host_copy_bytes: int = HOST_COPY_BYTES  # the host link's copy size


@dataclass(frozen=True)
class CollectiveReport:
    fit: CollectiveFit
    points: int
    heldout_median_rel_err: float | None
    heldout_max_rel_err: float | None


@dataclass
class ProfileResult:
    profile: DeviceProfile
    op_fits: list[FitReport]
    collective_fits: list[CollectiveReport]
    ops_measured: int  # measured in this run
    ops_cached: int  # taken from the cache
    ops_remeasured: int  # measured a second time for being far off their kind's fit
    wall_s: float
    rank_items: int = 0  # measurements on the ranks: collective rounds, overlap, FSDP2, calibration step rounds
    rank_items_measured: int = 0  # of them measured in this run (the rest from the cache)


def _resolve(settings: ProfileSettings) -> tuple[torch.device, str, int | None]:
    if settings.device not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {settings.device!r}; use cpu or cuda")
    if settings.nproc < 1:
        raise UsageError(f"`nproc` {settings.nproc}: a profile needs at least 1 process")
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("`device` cuda, but torch sees no CUDA device here (use `device` cpu)")
        if settings.nproc > torch.cuda.device_count():
            raise UsageError(f"`nproc` {settings.nproc} needs {settings.nproc} GPUs; "
                             f"this host has {torch.cuda.device_count()}")
    backend = settings.backend or default_backend(settings.device)
    threads = settings.threads
    if settings.device == "cpu" and threads is None:
        threads = max(1, (os.cpu_count() or 1) // settings.nproc)
    return torch.device(settings.device), backend, threads


def measure_profile(settings: ProfileSettings) -> ProfileResult:
    """Measure (or read from the cache) everything a profile holds, fit, and return the profile with the
    fits' held-out quality. Raises UsageError for settings this host cannot run. On the CPU this process's
    malloc keeps what it frees from then on, as apply's ranks do (autoplan.run.host_memory)."""
    started = time.perf_counter()
    device, backend, threads = _resolve(settings)
    device_name = device_bench.device_name(device)
    reference = _links_reference(settings, device_name)
    # a CPU measures with freed memory kept mapped, as apply's ranks run (autoplan.run.host_memory)
    kept = device.type == "cpu" and keep_freed_memory()
    cache = _measurement_cache(settings, device_name, threads, kept)
    measured = _measure(settings, device, backend, threads, cache)
    collective_fits = _collective_fits(measured.comm["collectives"])
    provenance = profile_provenance(settings, device.type, backend, threads, device_name)
    provenance.sources.update({**measurement_sources(measured.host, reference), **measured.tp_costs[2]})
    if device.type == "cuda":  # what each backward op time had taken off
        provenance.sources["op_times.bwd_s"] = (f"the kernels': the backward call's floor, "
                                                f"{backward_floor_s(device, settings.repeats) * 1e6:.1f} us measured "
                                                "here, taken off each (profiling/ops.backward_floor_s)")
    if kept:  # a rank's step reuses the heap's pages after its first steps: no large buffer is mapped fresh
        provenance.sources["first_touch_s_per_byte"] = FIRST_TOUCH_KEPT
    profile = _profile(settings, device, measured, _links(reference, collective_fits, measured.comm), provenance,
                       kept)
    calibration = fit_calibration(profile, measured.comm["calibration"], settings.nproc)
    fitted = {name: calibration[name] for name in FsdpOverhead.model_fields if name != "calibration"}
    profile = profile.model_copy(update={"fsdp": FsdpOverhead(**fitted, calibration=calibration)})
    return ProfileResult(profile, measured.op_fits, collective_fits, len(measured.fresh),
                         len(measured.cases) - len(measured.fresh), measured.remeasured,
                         time.perf_counter() - started, measured.comm["items"], measured.comm["measured"])


def _measurement_cache(settings: ProfileSettings, device_name: str, threads: int | None,
                       kept: bool) -> MeasurementCache:
    """The cache of measurements made on this device with these settings (a different setting: other entries)."""
    return MeasurementCache(settings.cache_dir, {
        "device": device_name, "torch": torch.__version__, "threads": threads,
        # a rougher run (--quick) keeps its own entries rather than passing them off to a full one
        "repeats": [settings.repeats.warmup, settings.repeats.min_repeats, settings.repeats.max_repeats,
                    settings.repeats.min_time_s],
        "overlap": [settings.overlap_phase_s, settings.overlap_trials],
        "comm_rounds": settings.comm_rounds,
        "host_memory": "kept" if kept else "default",
        # a GPU's backward op times have the backward call's floor taken off (ops.backward_floor_s)
        **({"backward": "kernels"} if settings.device == "cuda" else {}),
    })


@dataclass
class _Measured:
    """Everything measured for a profile, before it is fitted into one."""

    cases: list[OpCase]
    fresh: list  # the ops measured in this run (the rest from the cache)
    remeasured: int
    points: list  # per-op (work, seconds) points for the fits
    op_times: dict
    op_fits: list[FitReport]
    device_numbers: dict  # copy bandwidth, dispatch overhead, AdamW throughput, first touch
    host: dict  # the host link
    comm: dict  # on the ranks: collectives, overlap, FSDP2 overheads, calibration steps
    tp_costs: tuple  # (loss_parallel, tp_dispatch, their sources) on the CPU


def _measure(settings: ProfileSettings, device: torch.device, backend: str, threads: int | None,
             cache: MeasurementCache) -> _Measured:
    """The ops, the device's own numbers, the host link, the ranks' measurements and (on the CPU) tensor
    parallelism's costs, with `threads` intra-op threads (the number torch had is restored after)."""
    kind = device.type
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cases = op_cases(settings, kind)
        op_seconds, fresh = measure_ops(cases, device, settings.repeats, cache, settings.progress)
        remeasured = remeasure_outliers(cases, op_seconds, fresh, device, settings.repeats, cache, settings.progress)
        points, op_times = points_and_timings(cases, op_seconds)
        op_fits = fit_op_families(points, device_bench.FRESH_MAP_BYTES if kind == "cpu" else None)
        device_numbers = device_bench.device_numbers(device, settings.repeats, partial(_cached, cache),
                                                    settings.nproc if kind == "cpu" else 1)
        # the host threads a rank's offloaded optimizer step gets: every GPU of this node runs a rank
        host_threads = threads or host_threads_per_rank(max(settings.nproc, torch.cuda.device_count()))
        host = _cached(cache, f"host_link:{host_threads}threads:{settings.host_copy_bytes}B",
                       lambda: measure_host_link(device, settings.repeats, host_threads, settings.host_copy_bytes,
                                                 device_numbers["adamw_bytes_s"] if kind == "cpu" else None))
        sizes = DEFAULT_COMM_SIZES_BYTES[kind] if settings.comm_sizes_bytes is None else settings.comm_sizes_bytes
        comm = measure_on_ranks(settings, kind, backend, threads, sizes, cache)
        tp_costs = (measure_tp_costs(threads or 1, partial(_cached, cache), settings.quick) if kind == "cpu"
                    else (None, None, {}))
    finally:
        torch.set_num_threads(previous_threads)
    return _Measured(cases, fresh, remeasured, points, op_times, op_fits, device_numbers, host, comm, tp_costs)


def _links(reference: DeviceProfile | None, collective_fits: list[CollectiveReport],
           comm: dict) -> tuple[dict[str, Link], list[CollectiveFit], Overlap]:
    """The profile's links, collective fits and overlap: measured, or with one process the reference's."""
    if reference is not None:  # one process: nothing of the links was measured
        return reference.links, reference.collectives, reference.overlap
    largest_all_reduce = max((r.fit for r in collective_fits if r.fit.collective == "all_reduce"),
                             key=lambda f: f.group_size)
    # the link as the cost model's fallback sees it: bus bandwidth and latency of the all-reduce
    # fit at the largest group measured (its beta holds the ring factor: bus = factor / beta)
    links = {"intra_node": Link(
        bus_bandwidth_bytes_s=ring_factor("all_reduce", largest_all_reduce.group_size)
        / max(largest_all_reduce.beta_s_per_byte, 1e-30),
        latency_s=largest_all_reduce.alpha_s,
    )}
    return links, [r.fit for r in collective_fits], Overlap(enabled=comm["fsdp"]["overlap_enabled"], **comm["overlap"])


def _profile(settings: ProfileSettings, device: torch.device, measured: _Measured,
             links: tuple[dict[str, Link], list[CollectiveFit], Overlap], provenance: Provenance,
             kept: bool) -> DeviceProfile:
    """The profile of the measurements, before its FSDP2 overheads are calibrated."""
    numbers, op_fits = measured.device_numbers, measured.op_fits
    peak_flops = {}
    for point in measured.points:
        if point.family == "matmul" and point.direction == "fwd":
            peak_flops[point.dtype] = max(peak_flops.get(point.dtype, 0.0), point.flops / point.seconds)
    memory_fwd = next((r.fit for r in op_fits if r.fit.family == "memory" and r.fit.direction == "fwd"
                       and r.fit.dtype == settings.dtypes[0] and not r.fit.min_alloc_bytes), None)
    return DeviceProfile(
        name=settings.name or default_profile_name(settings), source="measured", provenance=provenance,
        device_type=device.type,
        identity=machine_identity(device.type),  # what `search` and `apply` compare the machine they run on with
        mem_bytes=device_bench.device_mem_bytes(device), peak_flops=peak_flops,
        matmul_efficiency=1.0,  # peak_flops is the best achieved, not a datasheet number
        mem_bandwidth_bytes_s=numbers["copy_bandwidth_bytes_s"], mem_bandwidth_efficiency=1.0,
        # zero-work time of ops as models run them (call, dispatch, launch); the bare benchmark without a fit
        op_overhead_s=memory_fwd.intercept_s if memory_fwd else numbers["dispatch_overhead_s"],
        links=links[0], collectives=links[1], overlap=links[2], optimizer_bytes_s=numbers["adamw_bytes_s"],
        first_touch_s_per_byte=0.0 if kept else numbers["first_touch_s_per_byte"],
        first_touch_min_bytes=device_bench.FRESH_MAP_BYTES,
        optimizer_tensor_s=measured.comm["fsdp"]["optimizer_tensor_s"],
        fsdp=FsdpOverhead(),  # calibrated after, against this profile's own prediction of the steps' parts
        loss_parallel=measured.tp_costs[0], tp_dispatch=measured.tp_costs[1],
        host_link=HostLink(**{field: measured.host[field] for field in HostLink.model_fields}),
        op_times=measured.op_times, op_fits=[r.fit for r in op_fits],
    )


def default_profile_name(settings: ProfileSettings) -> str:
    """"<device>-<backend>-<nproc>", e.g. cpu-gloo-2; a quick profile's ends in "-quick"."""
    backend = settings.backend or default_backend(settings.device)
    return f"{settings.device}-{backend}-{settings.nproc}" + ("-quick" if settings.quick else "")


def op_cases(settings: ProfileSettings, kind: str) -> list[OpCase]:
    """The distinct ops a profile of `settings` times on a device of `kind`: the zoo models' and the sweep's,
    in each dtype, and the calibration steps' (what benchmarks/refit_profile.py refits from a measured profile)."""
    workloads = [zoo_workload(model, batches, settings.seq_len) for model, batches in settings.models.items()]
    sweep = DEFAULT_SWEEP[kind] if settings.sweep is None else settings.sweep
    workloads += [sweep_workload(width, tokens) for width, tokens in sweep]
    cases: list[OpCase] = []
    for dtype in settings.dtypes:
        for workload in workloads:
            cases += collect_cases(workload, dtype)
    # the calibration steps (calibration.py) run bf16-mixed: their ops are predicted from these timings
    for model, batches in calibration_workloads(kind).items():
        cases += collect_cases(zoo_workload(model, batches, CALIBRATION_SEQ_LEN[kind]), "bf16")
    return unique_cases(cases)


def _cached(cache: MeasurementCache, key: str, measure):
    if key not in cache:
        cache.put(key, measure())
    return cache.get(key)


def _links_reference(settings: ProfileSettings, device_name: str) -> DeviceProfile | None:
    """With one process: the profile whose links, collective fits and overlap the measured one takes
    (`links_from`, else the shipped datasheet profile of this device); None with several processes."""
    from autoplan.profile_store import load_profile, profile_entries

    if settings.nproc > 1:
        return None
    if settings.links_from:
        return load_profile(settings.links_from)
    for entry in profile_entries():
        if entry.location == "shipped":
            candidate = load_profile(str(entry.path))
            if candidate.source == "datasheet" and candidate.provenance.device_name == device_name:
                return candidate
    raise UsageError(f"`nproc` 1 measures no collectives, and no shipped datasheet profile is of this device "
                     f"({device_name}): give `links_from` (the profile whose links, collective fits and overlap "
                     "to use; `autoplan profiles` lists them) or `nproc` 2 or more")


def _collective_fits(seconds: dict[tuple[str, int, int], float]) -> list[CollectiveReport]:
    """alpha + beta * bytes per (collective, group size), measured inside one node."""
    by_series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for (collective, group_size, nbytes), value in seconds.items():
        by_series.setdefault((collective, group_size), []).append((nbytes, value))
    reports = []
    for (collective, group_size), series in sorted(by_series.items()):
        work = [float(b) for b, _ in series]
        times = [t for _, t in series]
        fit = fit_affine(work, times)
        errors = heldout_errors(work, times) if len(series) >= 3 else []
        reports.append(CollectiveReport(
            CollectiveFit(collective=collective, group_size=group_size, scope="intra_node",
                          alpha_s=fit.intercept, beta_s_per_byte=fit.slope),
            points=len(series),
            heldout_median_rel_err=statistics.median(errors) if errors else None,
            heldout_max_rel_err=max(errors) if errors else None,
        ))
    return reports
