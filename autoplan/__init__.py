"""autoplan: find the fastest FSDP2 sharding plan that fits a per-device memory budget.

The Python API, as a notebook uses it (each step is also a CLI command: `autoplan search`,
`autoplan estimate`, `autoplan apply`):

>>> import autoplan
>>> traced = autoplan.trace("gpt2-tiny", seq_len=64)   # a zoo name, "hf:dir/config.json", "pkg.mod:factory", a module
>>> traced.tracer                                       # torch.fx here; "dispatch" where fx cannot trace the model
'fx'
>>> plan = autoplan.search(traced, "40MB", gpus=2)                # the fastest plan under 40 MB per GPU (InfeasibleError if none)
>>> plan.predicted.peak_mem_bytes <= 40_000_000
True
>>> [row["module"] for row in plan.unit_table()]        # plain data: one dict per FSDP unit, "" is the root
['', 'transformer.h.0', 'transformer.h.1']
>>> [baseline.name for baseline in plan.baselines]      # uniform strategies under the same limit
['all-shard', 'all-shard+ckpt', 'all-replicate']
>>> est = autoplan.estimate(traced, "shard", checkpoint=True, gpus=2, batch_size=8)  # a fixed strategy
>>> est.fits and est.predicted.peak_mem_bytes > est.model_state_bytes
True
>>> points = autoplan.frontier(traced, ["20MB", "40MB", "80MB"], gpus=2)  # one search per limit, one trace
>>> figure = autoplan.plots.plot_frontier(points)       # matplotlib Figures (pip install 'autoplan[plot]')
>>> figure = autoplan.plots.plot_memory_timeline(plan)
>>> plan.save("plan.json")
>>> autoplan.load_plan("plan.json") == plan
True

In a training script under torchrun, `model, optimizer = autoplan.apply(model, plan)` wraps a
meta-device model with one FSDP2 `fully_shard` per unit (see `autoplan apply --help` for a measured
run). `print(plan)` shows the decision table; `plan.to_dict()`, `plan.unit_table()` and
`plan.timeline_table()` give plain data.
"""

from autoplan import plots  # matplotlib itself is imported only when a figure is drawn
from autoplan.api.estimate import estimate
from autoplan.api.frontier import FrontierPoint, frontier
from autoplan.api.search import search
from autoplan.api.traced import TracedModel, trace
from autoplan.errors import AutoplanError, InfeasibleError, PlanFileError, TraceError, UsageError
from autoplan.plan.estimate import Estimate
from autoplan.plan.schema import Plan, load_plan
from autoplan.profile_store import available_profiles, load_profile
from autoplan.settings import EstimateSettings, SearchSettings
from autoplan.sizes import parse_mem_bytes
from autoplan.tracing.tracer import TRACERS, ExampleInputs
from autoplan.version import __version__
from cost_models.profile import DeviceProfile

__all__ = [
    "AutoplanError", "DeviceProfile", "apply", "Estimate", "EstimateSettings", "ExampleInputs", "FrontierPoint",
    "InfeasibleError", "Plan", "PlanFileError", "SearchSettings", "TRACERS", "TraceError", "TracedModel", "UsageError",
    "__version__", "available_profiles", "estimate", "frontier", "load_plan", "load_profile", "parse_mem_bytes",
    "plots", "search", "trace",
]


def __getattr__(name: str):
    # `apply` pulls in torch.distributed.fsdp (~0.4 s): import it only when used, not for `search`
    if name == "apply":
        from autoplan.run.apply import apply

        return apply
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
