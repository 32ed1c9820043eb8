"""What a tensor-parallel plan costs beyond its ops and collectives, measured for `autoplan profile`.

Two figures, each measured by its own module on torch's fake process group (loss_parallel.py: the
vocabulary-parallel cross-entropy beyond the fused one; tp_dispatch.py: DTensor's dispatch per
parallelized module). A process joins one process group in its life, so each runs in a child process
(`python -m autoplan.profiling.<module> THREADS`, which prints JSON) and the profile reads its result;
both are cached like the profile's other measurements. CPU only: both measure the CPU's own time, which
is the step's on a CPU (on a GPU the dispatch overlaps the kernels, and loss_parallel's extra passes are
not measured there yet: a GPU profile leaves both out, and TP plans cost without them).
"""

from __future__ import annotations

import json
import subprocess
import sys

from autoplan.errors import AutoplanError
from cost_models.profile import LossParallel, TpDispatch

__all__ = ["TP_COST_MODULES", "measure_tp_costs"]

# profile field -> the module that measures it
TP_COST_MODULES = {"loss_parallel": "autoplan.profiling.loss_parallel", "tp_dispatch": "autoplan.profiling.tp_dispatch"}
_SOURCES = {
    "loss_parallel": "measured by `autoplan profile` ({threads} thread(s), autoplan/profiling/loss_parallel.py): "
                     "torch's loss_parallel on vocabulary-sharded logits against the fused cross-entropy on the same "
                     "local logits, on a fake process group of 2, the extra seconds fitted linear in the local logits",
    "tp_dispatch": "measured by `autoplan profile` ({threads} thread(s), autoplan/profiling/tp_dispatch.py): whole "
                   "FSDP2 training steps of a small Llama laid out tensor-parallel, and tensor- and sequence-parallel, "
                   "on a fake 2 x 2 mesh, against the same steps without TP, per parallelized module",
}


def _run(module: str, threads: int, quick: bool, timeout_s: float) -> dict:
    command = [sys.executable, "-m", module, str(threads)] + (["quick"] if quick else [])
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AutoplanError(f"{' '.join(command)} took over {timeout_s:.0f} s; run it alone to see why") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise AutoplanError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout)


def measure_tp_costs(threads: int, cached, quick: bool = False,
                     timeout_s: float = 600.0) -> tuple[LossParallel, TpDispatch, dict[str, str]]:
    """(loss_parallel, tp_dispatch, their provenance sources) measured with `threads` intra-op threads
    (`quick`: fewer sizes and rounds). `cached(key, measure)` returns the cache's value for `key`, measuring and
    storing it when missing."""
    values = {field: cached(f"tp:{field}:{threads}threads" + (":quick" if quick else ""),
                            lambda module=module: _run(module, threads, quick, timeout_s)[field])
              for field, module in TP_COST_MODULES.items()}
    sources = {field: text.format(threads=threads) for field, text in _SOURCES.items()}
    return LossParallel(**values["loss_parallel"]), TpDispatch(**values["tp_dispatch"]), sources
