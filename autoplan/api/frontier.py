"""The throughput-memory frontier: the best plan's throughput under each of a sweep of memory limits,
beside the uniform baselines' (all-shard, all-shard+ckpt, all-replicate) under the same limits.

The request is prepared once for the whole sweep (the model traced once); each limit is one search of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

from autoplan.api.heap import young_collections_only
from autoplan.api.prepare import prepare
from autoplan.api.search import plan_of
from autoplan.errors import InfeasibleError
from autoplan.plan.assemble import BASELINES
from autoplan.plan.schema import Plan
from autoplan.settings import SearchSettings, check_mem_limit
from autoplan.sizes import parse_mem_bytes


@dataclass(frozen=True)
class FrontierPoint:
    mem_limit_bytes: int
    plan: Plan | None  # autoplan's plan under this limit; None when nothing fits
    baselines: dict[str, float | None]  # baseline name -> samples/s of its best fitting micro-batch, None: no fit

    @property
    def throughput_samples_s(self) -> float | None:
        return self.plan.predicted.throughput_samples_s if self.plan else None

    def to_dict(self) -> dict[str, Any]:
        return {"mem_limit_bytes": self.mem_limit_bytes, "autoplan": self.throughput_samples_s, **self.baselines}


def frontier(model: Any, limits: Iterable[str | int], *, settings: SearchSettings | None = None,
             **fields: Any) -> list[FrontierPoint]:
    """One FrontierPoint per memory limit, smallest limit first. `fields` (or `settings`) are `search`'s
    (gpus, profile, batch_size, dtype, ...), the same for every limit; the model is traced once.

    >>> import autoplan
    >>> points = autoplan.frontier("gpt2-tiny", ["300MB", "80GB"], gpus=2, seq_len=64)
    >>> [p.throughput_samples_s is not None for p in points]
    [True, True]
    """
    base = SearchSettings.create(settings, model=model, **fields)
    with young_collections_only():  # the traces and tables live on through every limit (autoplan.api.heap)
        return _frontier(base, prepare(base), limits)


def _frontier(base: SearchSettings, request, limits: Iterable[str | int]) -> list[FrontierPoint]:
    cluster = request.cluster
    points = []
    for limit_bytes in sorted(parse_mem_bytes(limit) for limit in limits):
        check_mem_limit(limit_bytes, cluster.profile.mem_bytes, cluster.profile_name, base.allow_over_device_mem)
        try:
            plan = plan_of(replace(request, limits=replace(request.limits, mem_limit_bytes=limit_bytes)))
        except InfeasibleError:
            # no plan fits, so no uniform baseline does either (each is one of the plans searched)
            points.append(FrontierPoint(limit_bytes, None, {name: None for name, _, _ in BASELINES}))
            continue
        baselines = {b.name: (b.throughput_samples_s if b.fits else None) for b in plan.baselines}
        points.append(FrontierPoint(limit_bytes, plan, baselines))
    return points


__all__ = ["FrontierPoint", "frontier"]
