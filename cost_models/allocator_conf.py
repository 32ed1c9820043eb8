"""PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) as autoplan's allocator model reads it.

Why: what a CUDA step needs beyond its live bytes depends on the caching allocator's configuration. The model
(cost_models.allocator, .expandable_segments; the bounds of cost_models.allocator_margin) reads two of its options:
`expandable_segments`, and natively `max_split_size_mb`. Others change what a step needs without the model
following them (UNMODELLED): a plan made under one says so rather than claim a figure it has not checked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from cost_models.allocator import LARGE_BUFFER

__all__ = ["ALLOC_CONF_ENV", "ALLOC_CONF_ENVS", "DEFAULT_ALLOC_CONF", "UNMODELLED", "environment_conf", "is_expandable",
           "max_split_size_of", "modelled_options", "unmodelled_options"]

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"  # the one `autoplan apply` sets for a plan's ranks
ALLOC_CONF_ENVS = (ALLOC_CONF_ENV, "PYTORCH_ALLOC_CONF")  # both name torch's configuration (the second newer)
DEFAULT_ALLOC_CONF = "expandable_segments:True"
_OPTION_COMMA = re.compile(r",(?![^\[]*\])")  # a comma outside brackets (roundup_power2_divisions:[64:8,>:1])


def environment_conf(environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """The allocator configuration an environment gives torch: the variable of ALLOC_CONF_ENVS that sets one and
    its value, PYTORCH_CUDA_ALLOC_CONF's where both are (None: neither is). Torch releases have differed in which
    of the two they read first, so where both are set and differ in what the model reads, ValueError."""
    given = [(name, environ[name]) for name in ALLOC_CONF_ENVS if environ.get(name)]
    if len(given) == 2 and given[0][1] != given[1][1]:
        try:
            alike = modelled_options(given[0][1]) == modelled_options(given[1][1])
        except ValueError:
            alike = False
        if not alike:
            raise ValueError(f"{given[0][0]}={given[0][1]!r} and {given[1][0]}={given[1][1]!r} are both set and "
                             "differ, and torch releases differ in which one they apply: unset one")
    return given[0] if given else None


def _options(conf: str) -> dict[str, str]:
    """A PYTORCH_CUDA_ALLOC_CONF value's KEY:VALUE options (comma-separated, a bracketed value's commas its own).
    ValueError for one with no value."""
    options = {}
    for option in filter(None, (part.strip() for part in _OPTION_COMMA.split(conf))):
        key, _, value = option.partition(":")
        if not value:
            raise ValueError(f"{ALLOC_CONF_ENV} option {option!r} has no value (KEY:VALUE, comma-separated)")
        options[key.strip()] = value.strip()
    return options


def is_expandable(conf: str) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value turns expandable segments on (torch's default: off). ValueError
    for a value of it torch would refuse (`modelled_options` checks every option the model reads)."""
    value = _options(conf).get("expandable_segments", "False")
    if value not in ("True", "False"):
        raise ValueError(f"expandable_segments takes True or False, got {value!r}")
    return value == "True"


def max_split_size_of(conf: str) -> int | None:
    """PYTORCH_CUDA_ALLOC_CONF's `max_split_size_mb`, in bytes (None where unset): natively, cached blocks at least
    that large are not split for smaller requests (cost_models.allocator models it; on an H200 a replay under
    256 MiB was within 1% of the GPU's need: benchmarks/RESULTS.md section 9, fourth run). ValueError for a value
    torch refuses: not a whole number of MiB, or not above its 20 MiB large-block size (newer releases take 20)."""
    value = _options(conf).get("max_split_size_mb")
    if value is None:
        return None
    if not value.isdigit() or int(value) <= LARGE_BUFFER >> 20:
        raise ValueError(f"max_split_size_mb takes a whole number of MiB above {LARGE_BUFFER >> 20}, got {value!r}")
    return int(value) << 20


# PYTORCH_CUDA_ALLOC_CONF options that change what a step needs, which neither the bound nor the replay models
UNMODELLED = {
    "backend": "a backend other than torch's caching allocator (native) is not what the bound and the replay model",
    "roundup_power2_divisions": "rounds requests up further than the 512 B the model rounds them to",
    "garbage_collection_threshold": "frees cached blocks early, which the replay does not",
    "max_non_split_rounding_mb": "lets larger cached blocks serve smaller requests whole, which the replay does not",
}


def unmodelled_options(conf: str) -> list[str]:
    """The options of a PYTORCH_CUDA_ALLOC_CONF value that change what a step needs and that the allocator model
    does not read, each as `KEY:VALUE (why)` (`backend:native`, the default, is not one)."""
    options = _options(conf)
    return [f"{key}:{value} ({why})" for key, why in UNMODELLED.items()
            if (value := options.get(key)) is not None and not (key == "backend" and value == "native")]


def modelled_options(conf: str) -> tuple[bool, int | None]:
    """What of a PYTORCH_CUDA_ALLOC_CONF value the allocator model reads: whether segments are expandable, and
    natively `max_split_size_mb` in bytes (torch ignores it with expandable segments). Two values alike in these are
    one configuration to a plan. ValueError for a value of either torch would refuse: the check of a configuration."""
    expandable, max_split_size = is_expandable(conf), max_split_size_of(conf)
    return expandable, None if expandable else max_split_size
