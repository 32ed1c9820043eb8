"""`autoplan.search`: the fastest plan whose predicted per-rank peak fits a memory limit.

The stages in order: prepare the request (autoplan.api.prepare: resolve and trace the model, or reuse a
TracedModel; the cluster and its meshes; the limits), search every mesh with one micro-batch sweep each
(autoplan.solve.mesh_search), assemble the plan (autoplan.plan.assemble).
"""

from __future__ import annotations

from typing import Any

from autoplan.api.heap import young_collections_only
from autoplan.api.prepare import prepare
from autoplan.plan.assemble import assemble_plan
from autoplan.plan.schema import PinRecord, Plan
from autoplan.settings import SearchSettings
from autoplan.solve.mesh_search import search_meshes
from autoplan.solve.request import PlanRequest
from cost_models.search_memo import search_scope

__all__ = ["plan_of", "search"]


def search(model: Any = None, mem: str | int | None = None, *, settings: SearchSettings | None = None,
           **fields: Any) -> Plan:
    """The fastest plan whose predicted per-rank peak memory is at most `mem` less a `headroom` fraction.
    Raises InfeasibleError (with the smallest limit that would fit) when none does, UsageError for bad input.

    `model`: a zoo name, "hf:path/to/config.json", "package.module:factory", an nn.Module, or a
    TracedModel (from `autoplan.trace`) to reuse its traces. `mem`: bytes or a size such as "8GB"
    (default: the profile's device memory). `fields` are `autoplan.settings.SearchSettings`'s (the
    same as `autoplan search`'s flags): the cluster is `gpus` in `nodes` x `gpus_per_node` with a
    device `profile`; without `batch_size` the micro-batch is swept; `global_batch` fixes the samples
    per step (gradient accumulation fills it). `tp` fixes the tensor-parallel degree (default: searched with
    the rest). `strategy` (a sharding kind), with `checkpoint` and `offload`, skips the solver: every unit
    takes that option, and only the micro-batch is searched. `pins` (a pins file or a
    mapping) and `pin` (["PATTERN=DECISION", ...]) fix the units they name; the solver completes the rest. A `settings`
    record gives all of them at once; `model`, `mem` and `fields` override it. A `mem` above the device's
    memory (without `allow_over_device_mem`) and a `seq_len` longer than the model's positions are refused.

    >>> import autoplan
    >>> plan = autoplan.search("gpt2-tiny", "300MB", gpus=2, seq_len=64)
    >>> plan.predicted.peak_mem_bytes < plan.predicted.needed_bytes <= 300e6  # live bytes, and the allocator's need
    True
    """
    with young_collections_only():  # millions of objects that live until the plan is made (autoplan.api.heap)
        return plan_of(prepare(SearchSettings.create(settings, model=model, mem=mem, **fields)))


def plan_of(request: PlanRequest) -> Plan:
    """The plan a prepared search request makes (with the pins it was searched with)."""
    with search_scope():  # what the search's tables read alike, computed once (cost_models.search_memo)
        plan = assemble_plan(search_meshes(request), request)
    if request.pins is None:
        return plan
    return plan.model_copy(update={"pins": [PinRecord(pattern=p, decision=d) for p, d in request.pins.records()]})
