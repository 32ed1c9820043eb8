"""What a measured profile says of its making (`provenance`): the settings it was measured with, the host and
device, and where each figure not measured the usual way came from."""

from __future__ import annotations

import datetime
import platform

import torch

from autoplan.profiling.defaults import DEFAULT_COMM_SIZES_BYTES, DEFAULT_SWEEP
from cost_models.profile import DeviceProfile, Provenance

__all__ = ["measurement_sources", "profile_provenance"]


def measurement_sources(host: dict, reference: DeviceProfile | None) -> dict[str, str]:
    """provenance.sources of what was not measured the usual way: the host link's figures, and with one
    process the links taken from another profile."""
    copy = f"measured here: one {host['copy_bytes'] >> 20} MiB copy (pinned host memory on CUDA, a memcpy on the CPU)"
    sources = {f"host_link.{field}": text for field, text in (
        ("h2d_bytes_s", copy), ("d2h_bytes_s", copy),
        ("overlaps_compute", f"measured here: a side-stream copy hid {host['overlap']['hidden_fraction']:.0%} of "
         "itself or of a matmul loop" if "overlap" in host else "the CPU runs no copy beside its compute"),
        ("cpu_optimizer_bytes_s", f"measured here: AdamW on host fp32 tensors with {host['cpu_threads']} threads"),
        ("cpu_threads", "the host threads a rank's offloaded optimizer step gets here"),
        ("host_mem_bytes", "left to the search: it takes this machine's memory" if host["host_mem_bytes"] is None
         else "this machine's memory"))}
    if reference is not None:
        for field in ("links", "collectives", "overlap"):
            sources[field] = (f"not measured (one process, no collectives): taken from profile {reference.name!r}"
                              + (f", whose source is: {reference.provenance.sources[field]}"
                                 if field in reference.provenance.sources else ""))
    return sources


def profile_provenance(settings, kind: str, backend: str, threads: int | None, device_name: str) -> Provenance:
    """What a measured profile says of how it was made: the settings (a run.ProfileSettings) and this host."""
    sweep = DEFAULT_SWEEP[kind] if settings.sweep is None else settings.sweep
    sizes = DEFAULT_COMM_SIZES_BYTES[kind] if settings.comm_sizes_bytes is None else settings.comm_sizes_bytes
    host = platform.node()
    rough = ("a quick, rough profile (`autoplan profile --quick`: one tiny model, few repeats and sizes), "
             "for trying the machinery, not for planning; ") if settings.quick else ""
    return Provenance(
        description=(
            f"{rough}measured by `autoplan profile` on {host} ({device_name}): per-op forward/backward times of the "
            f"models' traced ops and of sweep MLP blocks, per-family fits, {backend} collectives over "
            f"{settings.nproc} processes, compute/communication overlap, per-tensor optimizer overhead (profiling/fsdp.py), whole FSDP2 training steps of a calibration model fitted for the in-step compute scale, per-unit cost and selective checkpoint's per-op cost (profiling/calibration.py, calibration_fit.py), AdamW step throughput, the host link (profiling/host_link.py)"
            + (", and on the CPU loss_parallel's and DTensor's costs under tensor parallelism (profiling/tp_costs.py), "
               "everything with freed memory kept mapped as apply's ranks run (run/host_memory.py). " if kind == "cpu"
               else ". ")
            + "peak_flops is the best achieved matmul FLOP/s and mem_bandwidth a large copy, so both "
            "efficiencies are 1.0."
        ),
        host=host,
        device_name=device_name,
        torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        settings={
            "device": kind,
            "nproc": settings.nproc,
            "backend": backend,
            "threads_per_rank": threads,
            "dtypes": ",".join(settings.dtypes),
            "models": ";".join(f"{m}@mb{','.join(map(str, b))}" for m, b in settings.models.items()),
            "seq_len": settings.seq_len,
            "sweep_mlp_width_x_tokens": ";".join(f"{w}x{t}" for w, t in sweep),
            "comm_sizes_bytes": ",".join(map(str, sizes)),
            "warmup": settings.repeats.warmup,
            "min_repeats": settings.repeats.min_repeats,
            "max_repeats": settings.repeats.max_repeats,
            "min_time_s": settings.repeats.min_time_s,
            "statistic": "median of repeats; ops far off their kind's fit timed twice, lower median kept",
            "comm_rounds": settings.comm_rounds,
            "calibration_rounds": settings.calibration_rounds,
            "calibration_steps": f"{settings.calibration_steps[0]}+{settings.calibration_steps[1]}",
            "fsdp_calls": settings.fsdp_calls,
            "quick": settings.quick,
        },
    )
