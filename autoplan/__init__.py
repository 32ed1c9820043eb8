"""autoplan: find the fastest FSDP2 sharding plan that fits a per-device memory budget."""

__version__ = "0.1.0"

from .errors import AutoplanError, InfeasibleError, PlanFileError, UsageError  # noqa: E402
from .plan import Plan, load_plan  # noqa: E402
from .profiles import DeviceProfile, available_profiles, load_profile  # noqa: E402
from .search import search  # noqa: E402
from .sizes import parse_mem_bytes  # noqa: E402

__all__ = [
    "AutoplanError", "DeviceProfile", "InfeasibleError", "Plan", "PlanFileError", "UsageError",
    "available_profiles", "load_plan", "load_profile", "parse_mem_bytes", "search",
]
