"""autoplan: find the fastest FSDP2 sharding plan that fits a per-device memory budget.

The Python API, as a notebook uses it (each step is also a CLI command: `autoplan search`,
`autoplan estimate`, `autoplan apply`):

>>> import autoplan
>>> traced = autoplan.trace("gpt2-tiny", seq_len=64)   # a zoo name, "hf:dir/config.json", "pkg.mod:factory", a module
>>> traced.tracer                                       # torch.fx here; "dispatch" where fx cannot trace the model
'fx'
>>> plan = autoplan.search(traced, "400MB", gpus=2)     # the fastest plan under 400 MB per GPU (InfeasibleError if none)
>>> plan.predicted.needed_bytes <= 400_000_000          # what CUDA's caching allocator needs, not only live bytes
True
>>> [row["module"] for row in plan.unit_table()]        # plain data: one dict per FSDP unit, "" is the root
['', 'transformer.h.0', 'transformer.h.1']
>>> [baseline.name for baseline in plan.baselines]      # uniform strategies under the same limit
['all-shard', 'all-shard+sel', 'all-shard+ckpt', 'all-replicate']
>>> est = autoplan.estimate(traced, "shard", checkpoint=True, gpus=2, batch_size=8)  # a fixed strategy
>>> est.fits and est.predicted.peak_mem_bytes > est.model_state_bytes
True
>>> points = autoplan.frontier(traced, ["250MB", "400MB", "800MB"], gpus=2)  # one search per limit, one trace
>>> figure = autoplan.plots.plot_frontier(points)       # matplotlib Figures (pip install 'autoplan[plot]')
>>> figure = autoplan.plots.plot_memory_timeline(plan)
>>> plan.save("plan.json")
>>> autoplan.load_plan("plan.json") == plan
True

In a training script under torchrun, `model, optimizer = autoplan.apply(model, plan)` wraps a
meta-device model with one FSDP2 `fully_shard` per unit (`mesh=`, `optimizer=` and `scheduler=` fit it
into a team's own loop: examples/train.py); `autoplan.materialise` allocates and initialises it, and
`autoplan.save_checkpoint` / `autoplan.load_checkpoint` save and resume it sharded, under any plan of the
same model (see `autoplan apply --help` for a measured run). `print(plan)` shows the decision table; `plan.to_dict()`, `plan.unit_table()` and
`plan.timeline_table()` give plain data.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from autoplan.errors import AutoplanError, CheckpointError, InfeasibleError, PlanFileError, TraceError, UsageError
from autoplan.version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for readers and type checkers
    from autoplan import plots
    from autoplan.api.estimate import estimate
    from autoplan.api.frontier import FrontierPoint, frontier
    from autoplan.api.search import search
    from autoplan.api.traced import TracedModel, trace
    from autoplan.plan.estimate import Estimate
    from autoplan.plan.schema import Plan, load_plan
    from autoplan.profile_store import available_profiles, load_profile
    from autoplan.run.apply import apply
    from autoplan.run.checkpoint import load_checkpoint, save_checkpoint
    from autoplan.run.fsdp import materialise
    from autoplan.settings import EstimateSettings, SearchSettings
    from autoplan.sizes import parse_mem_bytes
    from autoplan.tracing.tracer import TRACERS, ExampleInputs
    from cost_models.profile import DeviceProfile

# Public name -> the module that defines it. Importing `autoplan` costs only errors and version: torch
# (~2 s), ortools and pydantic are imported when a name that needs them is first used, so that
# `autoplan --help` and `autoplan models` do not pay for what a search needs.
_LAZY = {
    "plots": "autoplan.plots",  # matplotlib itself is imported only when a figure is drawn
    "estimate": "autoplan.api.estimate",
    "FrontierPoint": "autoplan.api.frontier", "frontier": "autoplan.api.frontier",
    "search": "autoplan.api.search",
    "TracedModel": "autoplan.api.traced", "trace": "autoplan.api.traced",
    "Estimate": "autoplan.plan.estimate",
    "Plan": "autoplan.plan.schema", "load_plan": "autoplan.plan.schema",
    "available_profiles": "autoplan.profile_store", "load_profile": "autoplan.profile_store",
    "apply": "autoplan.run.apply",  # torch.distributed.fsdp: only in training scripts
    "load_checkpoint": "autoplan.run.checkpoint", "save_checkpoint": "autoplan.run.checkpoint",
    "materialise": "autoplan.run.fsdp",
    "EstimateSettings": "autoplan.settings", "SearchSettings": "autoplan.settings",
    "parse_mem_bytes": "autoplan.sizes",
    "TRACERS": "autoplan.tracing.tracer", "ExampleInputs": "autoplan.tracing.tracer",
    "DeviceProfile": "cost_models.profile",
}

__all__ = [
    "AutoplanError", "CheckpointError", "DeviceProfile", "apply", "Estimate", "EstimateSettings", "ExampleInputs", "FrontierPoint",
    "InfeasibleError", "Plan", "PlanFileError", "SearchSettings", "TRACERS", "TraceError", "TracedModel", "UsageError",
    "__version__", "available_profiles", "estimate", "frontier", "load_checkpoint", "load_plan", "load_profile",
    "materialise", "parse_mem_bytes", "plots", "save_checkpoint", "search", "trace",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"{__name__}.{name}" else getattr(imported, name)
    globals()[name] = value  # the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
