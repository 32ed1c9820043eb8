"""What `autoplan profile` measures unless told otherwise, and how `--quick` cuts it down: plain data,
importable without torch, so that `autoplan profile --help` and `autoplan profiles` start fast."""

from __future__ import annotations

__all__ = ["DEFAULT_COMM_SIZES_BYTES", "DEFAULT_DTYPES", "DEFAULT_MODELS", "DEFAULT_SWEEP", "QUICK"]

# zoo model -> micro-batch sizes. The search traces at micro-batch 1 and 2 (and extrapolates to
# others), so these keys match a search over these models directly; other shapes go through the fits.
DEFAULT_MODELS: dict[str, tuple[int, ...]] = {
    "gpt2-tiny": (1, 2), "llama-tiny": (1, 2), "bert-tiny": (1, 2), "gpt2": (1,),
}
DEFAULT_DTYPES = ("fp32", "bf16")

# (width, tokens) of the sweep MLP blocks: problem sizes between the tiny models and real ones
DEFAULT_SWEEP = {
    "cpu": tuple((w, t) for w in (256, 512, 1024) for t in (512, 2048)),
    "cuda": tuple((w, t) for w in (1024, 4096, 8192) for t in (2048, 8192)),
}
DEFAULT_COMM_SIZES_BYTES = {
    "cpu": tuple(4 ** k for k in range(6, 14)),  # 4 KiB .. 64 MiB
    "cuda": tuple(4 ** k for k in range(6, 16)),  # 4 KiB .. 1 GiB
}

# `--quick`: a rough profile for trying the machinery. Each setting overrides ProfileSettings' default;
# the models and dtypes only where the command line names none. Most of a quick run is the ranks'
# part: starting them, FSDP2's overhead stacks and the 20 calibration steps (each built, warmed up once
# and timed three times).
QUICK = {
    "models": {"gpt2-tiny": (1,)},
    "dtypes": ("fp32",),
    "sweep": ((128, 256),),
    "comm_sizes_bytes": (4 << 10, 256 << 10, 4 << 20),
    "repeats": {"warmup": 1, "min_repeats": 3, "max_repeats": 5, "min_time_s": 0.0},
    "overlap_phase_s": 0.1,
    "overlap_trials": 1,
    "comm_rounds": 1,
    "calibration_rounds": 1,
    "calibration_steps": (1, 3),
    "fsdp_calls": 3,
}
