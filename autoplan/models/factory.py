"""User model factories: `package.module:factory` named on the command line (or in the API).

This is the one place autoplan imports code by name, and only names the user gave it directly:
a plan file's model name is never passed here.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from autoplan.models.config import FACTORY_FORM

__all__ = ["load_factory"]


def load_factory(spec: str, device: str | torch.device | None = None) -> nn.Module:
    """Import ``package.module:factory`` and return ``factory()``.

    ``factory`` may be a dotted attribute path (``module:Class.build``). With
    ``device`` given, the factory runs under ``torch.device(device)`` (e.g.
    ``"meta"`` to build without allocating memory).
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"model factory {spec!r} is not of the form '{FACTORY_FORM}'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only translate "this module does not exist"; a missing import inside
        # an existing module is the user's bug and keeps its own traceback.
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise
        raise ValueError(f"model factory {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    factory: Any = module
    for part in attr_path.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as exc:
            raise ValueError(f"model factory {spec!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: {attr_path!r} is not callable")
    if device is None:
        model = factory()
    else:
        with torch.device(device):
            model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model

