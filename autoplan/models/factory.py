"""User model factories: `package.module:factory` named on the command line (or in the API).

This is the one place autoplan imports code by name, and only names the user gave it directly:
a plan file's model name is never passed here.

The module is looked up as `python -m` would: the current directory comes first on `sys.path`, so the
`autoplan` console script finds a `mymodels.py` beside the user as `python -m autoplan` does. Whatever
goes wrong in the user's code (an import that fails, a factory that raises or returns something other
than a module) comes back as a ValueError that names the factory, the error and where it was raised,
which the callers turn into a usage error: no traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import torch
from torch import nn

from autoplan.models.config import FACTORY_FORM

__all__ = ["load_factory"]


def _current_directory_on_path() -> None:
    """The current directory first on sys.path, where `python -m` puts it (a console script has its bin folder)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def _describe(exc: BaseException) -> str:
    """'TypeError: message (at file.py:12)', the place being the innermost frame outside this module."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _import(spec: str, module_name: str):
    _current_directory_on_path()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"model factory {spec!r}: cannot import module {module_name!r} ({exc}); it is looked "
                             f"up on the Python path and in the current directory {os.getcwd()}") from exc
        # a missing import inside the user's module: still a ModuleNotFoundError (callers tell it apart), said better
        raise ModuleNotFoundError(f"model factory {spec!r}: importing {module_name!r} failed: {_describe(exc)}",
                                  name=exc.name) from exc
    except Exception as exc:  # the user's module raised while it was imported
        raise ValueError(f"model factory {spec!r}: importing {module_name!r} failed: {_describe(exc)}") from exc


def load_factory(spec: str, device: str | torch.device | None = None) -> nn.Module:
    """Import ``package.module:factory`` and return ``factory()``.

    ``factory`` may be a dotted attribute path (``module:Class.build``). With
    ``device`` given, the factory runs under ``torch.device(device)`` (e.g.
    ``"meta"`` to build without allocating memory).
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"model factory {spec!r} is not of the form '{FACTORY_FORM}'")
    factory: Any = _import(spec, module_name)
    for part in attr_path.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as exc:
            raise ValueError(f"model factory {spec!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: {attr_path!r} is not callable")
    try:
        if device is None:
            model = factory()
        else:
            with torch.device(device):
                model = factory()
    except Exception as exc:
        raise ValueError(f"model factory {spec!r} raised {_describe(exc)}; a factory is called with no arguments "
                         "and returns the model (an nn.Module)") from exc
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module; a factory "
                         "is called with no arguments and returns the model")
    return model
