"""What DTensor's dispatch costs a tensor-parallel rank per parallelized module, for a profile's `tp_dispatch`.

Why measured: under tensor parallelism every projection, the vocabulary-parallel embedding and head and,
with sequence parallelism, every norm and region input run through DTensor: the input is wrapped
(from_local), the op's sharding is propagated and its output redistributed and unwrapped in Python, forward
and backward. On a CPU that is a fixed time per module, not per byte: in a 4-block Llama at d 256 (TP 2,
cpu-gloo-2) about 10 ms of the forward and 11 ms of the backward of a 309 ms step, which the model left out
(benchmarks/RESULTS.md section 10).

How: one process joins torch's fake process group as rank 0 of 4 (collectives return at once; the TP
collectives are priced on the collective fits) and builds, on a (2 data-parallel x 2 tensor-parallel) mesh,
a small zoo Llama three times: plain, tensor-parallel, and tensor- and sequence-parallel, each laid out by the
functions `autoplan apply` runs (autoplan.models.tp_layout.recognise, autoplan.run.tp.parallelize_tp) and
wrapped per block and at the root by FSDP2 on the data-parallel sub-mesh with bf16 mixed precision. Their
training steps (forward, then backward from the local logits' mean: the loss is loss_parallel's, priced apart)
are timed in interleaved rounds; each phase's median excess over the plain model's, divided by the modules
the layout parallelizes (cost_models.tensor_parallel.parallelized_modules), is the per-module figure. At
this width the ops are microseconds, so what the parallel model adds is its dispatch.

    python -m autoplan.profiling.tp_dispatch      # prints the fitted figures as JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoplan.run.host_memory import keep_freed_memory
from cost_models.profile import TpDispatch
from cost_models.tensor_parallel import parallelized_modules

__all__ = ["DISPATCH_MODEL", "DispatchRow", "measure_tp_dispatch"]

# the zoo model timed: vocabulary-parallel (512 divides by 2), 2 key/value heads (divide by 2)
DISPATCH_MODEL = dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, vocab_size=512)
_TOKENS = (1, 16)  # micro-batch, sequence
_TP = 2
_DP = 2


@dataclass(frozen=True)
class DispatchRow:
    """One variant's median forward and backward seconds per step, and the modules it parallelizes."""

    variant: str  # "plain", "tp", "tp+sp"
    modules: int
    fwd_s: float
    bwd_s: float


def _build(variant: str, mesh):
    from torch.distributed.fsdp import fully_shard

    from autoplan.models.config import get_config
    from autoplan.models.tp_layout import recognise
    from autoplan.models.zoo import build_model
    from autoplan.run.apply import mixed_precision_policy
    from autoplan.run.tp import parallelize_tp

    torch.manual_seed(0)
    model = build_model(get_config("llama-tiny", **DISPATCH_MODEL), device="cpu")
    modules = 0
    if variant != "plain":
        layout = recognise(model, _TP, variant == "tp+sp")
        parallelize_tp(model, layout, mesh["tp"])
        modules = len(parallelized_modules(layout))
    policy = mixed_precision_policy("bf16-mixed")
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model, modules


def _step(model, ids) -> tuple[float, float]:
    start = time.perf_counter()
    logits = model(ids)
    local = logits.to_local() if hasattr(logits, "to_local") else logits
    loss = local.float().mean()
    forward = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return forward - start, end - forward


def measure_tp_dispatch(rounds: int = 5, steps: int = 8, warmup: int = 3,
                        threads: int = 1) -> tuple[TpDispatch, list[DispatchRow]]:
    """The fitted TpDispatch and each variant's row (medians over `rounds` interleaved rounds of `steps` steps
    after `warmup`). Runs in a process with no process group of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("measure_tp_dispatch joins a fake process group of its own: run it in a process "
                           "without one (python -m autoplan.profiling.tp_dispatch)")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=_DP * _TP)
    try:
        mesh = init_device_mesh("cpu", (_DP, _TP), mesh_dim_names=("dp", "tp"))
        variants = ("plain", "tp", "tp+sp")
        built = {variant: _build(variant, mesh) for variant in variants}
        ids = torch.randint(0, DISPATCH_MODEL["vocab_size"], _TOKENS, generator=torch.Generator().manual_seed(0))
        times: dict[str, list[tuple[float, float]]] = {variant: [] for variant in variants}
        for variant in variants:
            for _ in range(warmup):
                _step(built[variant][0], ids)
        for _ in range(rounds):
            for variant in variants:
                times[variant] += [_step(built[variant][0], ids) for _ in range(steps)]
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(previous)
    rows = [DispatchRow(variant, built[variant][1], statistics.median(f for f, _ in times[variant]),
                        statistics.median(b for _, b in times[variant])) for variant in variants]
    plain, tp, sp = rows

    def per_module(row: DispatchRow) -> tuple[float, float]:
        return max(0.0, row.fwd_s - plain.fwd_s) / row.modules, max(0.0, row.bwd_s - plain.bwd_s) / row.modules

    (fwd, bwd), (sp_fwd, sp_bwd) = per_module(tp), per_module(sp)
    return TpDispatch(fwd_s_per_module=fwd, bwd_s_per_module=bwd, sp_fwd_s_per_module=sp_fwd,
                      sp_bwd_s_per_module=sp_bwd), rows


def main(argv: list[str] | None = None) -> None:
    """`python -m autoplan.profiling.tp_dispatch [THREADS [quick]]`: the measurement in this process, as a CPU
    rank of `autoplan apply` runs (its freed memory kept mapped: autoplan.run.host_memory), printed as JSON;
    "quick": one round of two steps (`autoplan profile --quick`)."""
    argv = sys.argv[1:] if argv is None else argv
    keep_freed_memory()
    rounds = dict(rounds=1, steps=2, warmup=1) if argv[1:] == ["quick"] else {}
    fitted, rows = measure_tp_dispatch(threads=int(argv[0]) if argv else 1, **rounds)
    print(json.dumps({"tp_dispatch": fitted.model_dump(), "model": DISPATCH_MODEL,
                      "rows": [row.__dict__ for row in rows]}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
