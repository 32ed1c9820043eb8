"""What torch's loss_parallel costs a rank beyond the fused cross-entropy, for a profile's `loss_parallel`.

Why measured: a tensor-parallel plan's head leaves its logits split by vocabulary, and loss_parallel computes
the cross-entropy on them as separate ops (max, subtract, exp, sum, log, a masked pick of the target),
each dispatched through DTensor and each a pass over the logits, forward and backward. The search prices
the loss as the fused op on 1/t of the logits; on a CPU the decomposed loss took about twice that
(cpu-gloo-2, 3 x 128 tokens x 16,000 local vocabulary: 50 ms against 26 ms forward and backward), the
largest part of a small-model TP step the model left out.

How: one process joins torch's fake process group as rank 0 of 2 (collectives return at once: the loss's
three all-reduces are priced on the collective fits), and times, at a few sizes of local logits, the fused
cross-entropy on a plain tensor and loss_parallel's on a vocabulary-sharded DTensor, forward alone (no
grad) and forward with backward; the extra forward and backward seconds are fitted linear in the local
logits. Sizes stay below glibc's mmap threshold, whose first-touch cost the profile prices apart.

    python -m autoplan.profiling.loss_parallel      # prints the fitted figures as JSON
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.profiling.timing import Repeats, median_time_s
from autoplan.run.host_memory import keep_freed_memory
from cost_models.profile import LossParallel

__all__ = ["LOSS_SIZES", "QUICK_REPEATS", "measure_loss_parallel"]

# (tokens, local vocabulary): local fp32 logits from 0.5 M to 6.1 M elements (24.6 MB, under 32 MiB)
LOSS_SIZES = ((256, 2000), (256, 8000), (384, 8000), (384, 16000))
QUICK_REPEATS = Repeats(warmup=1, min_repeats=2, max_repeats=3, min_time_s=0.0)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, both clamped at 0 (a cost is never negative)."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var and n > 1 else 0.0
    return max(0.0, my - slope * mx), slope


def measure_loss_parallel(repeats: Repeats | None = None, sizes=LOSS_SIZES, threads: int = 1) -> tuple[LossParallel, list]:
    """The fitted LossParallel and the raw rows (tokens, local vocabulary, fused fwd, fused fwd+bwd,
    parallel fwd, parallel fwd+bwd, seconds). Runs in a process with no process group of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("measure_loss_parallel joins a fake process group of its own: run it in a process "
                           "without one (python -m autoplan.profiling.loss_parallel)")
    repeats = repeats or Repeats()
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        rows = []
        for tokens, local in sizes:
            generator = torch.Generator().manual_seed(0)
            logits = torch.randn(tokens, local, dtype=torch.bfloat16, generator=generator)
            plain = logits.clone().requires_grad_()
            labels = torch.randint(0, local, (tokens,), generator=generator)
            sharded = DTensor.from_local(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
            global_labels = torch.randint(0, 2 * local, (tokens,), generator=generator)

            def fused(backward: bool) -> None:
                with torch.set_grad_enabled(backward):
                    loss = F.cross_entropy(plain.float(), labels)
                if backward:
                    loss.backward()
                    plain.grad = None

            def parallel(backward: bool) -> None:
                with torch.set_grad_enabled(backward), loss_parallel():
                    loss = F.cross_entropy(sharded.float(), global_labels)
                    if backward:
                        loss.to_local().backward()
                        sharded.grad = None

            times = [median_time_s(lambda f=f, b=b: f(b), cpu, repeats)
                     for f in (fused, parallel) for b in (False, True)]
            rows.append((tokens, local, *times))
    finally:
        dist.destroy_process_group()
    elements = [float(tokens * local) for tokens, local, *_ in rows]
    fwd = [par_f - fused_f for _, _, fused_f, _, par_f, _ in rows]
    bwd = [(par_t - par_f) - (fused_t - fused_f) for _, _, fused_f, fused_t, par_f, par_t in rows]
    (fwd_s, fwd_per), (bwd_s, bwd_per) = _line(elements, fwd), _line(elements, bwd)
    return LossParallel(fwd_s=fwd_s, fwd_s_per_logit=fwd_per, bwd_s=bwd_s, bwd_s_per_logit=bwd_per), rows


def main(argv: list[str] | None = None) -> None:
    """`python -m autoplan.profiling.loss_parallel [THREADS [quick]]`: the measurement in this process, as a CPU
    rank of `autoplan apply` runs (its freed memory kept mapped: autoplan.run.host_memory), printed as JSON;
    "quick": the two smaller sizes, few repeats (`autoplan profile --quick`)."""
    argv = sys.argv[1:] if argv is None else argv
    keep_freed_memory()
    quick = argv[1:] == ["quick"]
    fitted, rows = measure_loss_parallel(QUICK_REPEATS if quick else None, LOSS_SIZES[:2] if quick else LOSS_SIZES,
                                         threads=int(argv[0]) if argv else 1)
    print(json.dumps({"loss_parallel": fitted.model_dump(),
                      "rows": [dict(zip(("tokens", "local_vocab", "fused_fwd_s", "fused_fwd_bwd_s", "parallel_fwd_s",
                                         "parallel_fwd_bwd_s"), row)) for row in rows]}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
