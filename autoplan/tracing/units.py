"""Candidate FSDP units: the module subtrees that each get one `fully_shard` call.

Granularities:
- "block" (default): each block of the largest repeated ModuleList, plus large siblings along the
  path to it (embeddings, head); what remains belongs to the root unit "". A block's mixture-of-experts
  weights (its experts' stacked matrices, most of a MoE block) are a unit of their own inside it, so that
  they are gathered, offloaded and checkpointed apart from its attention.
- "fine": as "block", but inside each block every child that owns parameters (attention, MLP)
  is a unit of its own; the block keeps what is left (its norms).
- "leaf": every module that directly owns parameters is a unit (one per Linear, norm, ...).
- "root": the root alone; the modules that pins or an FSDP auto-wrap policy name are the other units
  (`wrap_paths`: the modules a team's size- or class-based policy wraps, found as FSDP1 finds them).

A module whose parameter is shared with a module outside its subtree (tied embeddings) cannot be
a unit of its own: FSDP would reshard the parameter while the other user still needs it. Its
parameters go to the nearest enclosing unit.
"""

from __future__ import annotations

import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.models.structure import expert_stacks, largest_module_list, params_of
from autoplan.pins.wrap import WrapPolicy
from autoplan.settings import GRANULARITIES
from cost_models.records import ModelTrace, ParamInfo, Unit

__all__ = [
    "MIN_CHILD_FRACTION", "MIN_SIBLING_FRACTION", "build_units", "candidate_paths", "unit_refusal", "wrap_paths",
]

# A sibling module along the path to the blocks becomes a unit only if it is at least this
# fraction of one block's parameters: tiny units cost a collective's latency for nothing.
MIN_SIBLING_FRACTION = 0.25
# Inside a block ("fine"), a child is a unit if it holds this fraction of the block (attention, MLP;
# not the norms).
MIN_CHILD_FRACTION = 0.1


def _owns(unit_path: str, module_path: str) -> bool:
    return unit_path == "" or module_path == unit_path or module_path.startswith(unit_path + ".")


def _registrations(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> the paths of every module it is registered under (a tied weight has several)."""
    found: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), []).append(name.rsplit(".", 1)[0] if "." in name else "")
    return found


def _shared_outside(model: nn.Module, path: str, registrations: dict[int, list[str]]) -> bool:
    """True when a parameter under `path` is also registered under a module outside `path`."""
    return any(not _owns(path, owner) for param in model.get_submodule(path).parameters()
               for owner in registrations[id(param)])


def candidate_paths(model: nn.Module, granularity: str = "block") -> list[str]:
    """Module paths that become units (the root "" always is one), before tie exclusion."""
    if granularity not in GRANULARITIES:
        raise UsageError(f"unknown `granularity` {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
    if granularity == "root":
        return [""]
    if granularity == "leaf":
        return [""] + [
            name for name, module in model.named_modules()
            if name and any(True for _ in module.parameters(recurse=False))
        ]
    paths = [""]
    blocks_path = largest_module_list(model)
    if blocks_path is None:
        # no repeated blocks: every direct child with parameters is a unit
        return paths + [name for name, child in model.named_children() if params_of(child) > 0]
    blocks = model.get_submodule(blocks_path)
    block_params = min(params_of(block) for block in blocks)
    # siblings along the path root -> blocks
    parts = blocks_path.split(".")
    for depth in range(len(parts)):
        ancestor_path = ".".join(parts[:depth])
        ancestor = model.get_submodule(ancestor_path)
        for child_name, child in ancestor.named_children():
            child_path = f"{ancestor_path}.{child_name}" if ancestor_path else child_name
            if child_name == parts[depth]:
                continue
            if params_of(child) >= MIN_SIBLING_FRACTION * block_params:
                paths.append(child_path)
    for index, block in enumerate(blocks):
        block_path = f"{blocks_path}.{index}"
        paths.append(block_path)
        block_size = params_of(block)
        if granularity == "fine":
            for child_name, child in block.named_children():
                if params_of(child) >= MIN_CHILD_FRACTION * block_size:
                    paths.append(f"{block_path}.{child_name}")
        paths += [f"{block_path}.{name}" for name in expert_stacks(block)
                  if params_of(block.get_submodule(name)) >= MIN_CHILD_FRACTION * block_size]
    return paths


def unit_refusal(model: nn.Module, path: str, registrations: dict[int, list[str]] | None = None) -> str | None:
    """Why the module at `path` cannot be a unit of its own (None: it can): what a pin that names a module
    outside the granularity's units is checked against."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return f"{path} is not a module of the model"
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return (f"{path} is a {type(module).__name__}, a container whose forward never runs (FSDP's hooks would "
                f"never fire); name its elements instead ({path}.*)")
    registrations = registrations or _registrations(model)
    for param in module.parameters():
        outside = [owner for owner in registrations[id(param)] if not _owns(path, owner)]
        if outside:
            return (f"{path} shares a parameter with {outside[0] or '<root>'} outside it (tied weights), so it "
                    "cannot be a unit of its own: FSDP would reshard the parameter while the other still needs it")
    return None


def wrap_paths(model: nn.Module, policy: WrapPolicy) -> tuple[list[str], list[str]]:
    """The modules an FSDP1 auto-wrap policy wraps (autoplan.pins.wrap), as units can take them: (paths, why
    each of the others cannot be a unit). UsageError for layer classes the model has no module of."""
    if policy.layer_classes:
        wanted = set(policy.layer_classes)
        found = [name for name, module in model.named_modules()
                 if name and any(cls.__name__ in wanted for cls in type(module).__mro__)]
        if not found:
            classes = sorted({type(module).__name__ for module in model.modules()})
            raise UsageError(f"the wrap policy's layer classes {', '.join(sorted(wanted))} match no module of "
                             f"{type(model).__name__}; its module classes: {', '.join(classes)}")
    else:
        found = []
        _size_wrap(model, "", policy.min_num_params, found, set(), only_children=True)
    registrations = _registrations(model)
    refused = [(path, unit_refusal(model, path, registrations)) for path in found]
    return [p for p, why in refused if why is None], [why for _, why in refused if why is not None]


def _size_wrap(module: nn.Module, path: str, min_params: int, found: list[str], wrapped: set[int],
               only_children: bool = False) -> int:
    """FSDP1's _recursive_wrap under size_based_auto_wrap_policy: the parameters it wraps at or below `module`.
    A module is gone into when its unwrapped parameters reach `min_params` (not an nn.MultiheadAttention), and
    wrapped when those its children left do (not a ModuleList or ModuleDict; the root by FSDP itself)."""
    params = [p for p in module.parameters() if id(p) not in wrapped]
    numel = sum(p.numel() for p in params)
    if numel < min_params or isinstance(module, nn.MultiheadAttention):
        return 0
    below = sum(_size_wrap(child, f"{path}.{name}" if path else name, min_params, found, wrapped)
                for name, child in module.named_children())
    if only_children or numel - below < min_params or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return below
    found.append(path)
    wrapped.update(id(p) for p in params)
    return numel


def build_units(model: nn.Module, trace: ModelTrace, granularity: str = "block",
                extra_paths: tuple[str, ...] = ()) -> list[Unit]:
    """Units in execution order (by first op), each owning its parameters and ops. `extra_paths` are
    modules made units beside the granularity's (pinned ones); one that cannot be is a UsageError."""
    registrations = _registrations(model)
    paths = [p for p in candidate_paths(model, granularity) if p == "" or not _shared_outside(model, p, registrations)]
    for path in extra_paths:
        if path not in paths:
            why = unit_refusal(model, path, registrations)
            if why:
                raise UsageError(why)
            paths.append(path)
    units = {path: Unit(path) for path in paths}
    innermost_of: dict[str, str] = {}

    def innermost(module_path: str) -> str:
        """The deepest unit that owns the module: the first unit path met walking up its path."""
        found = innermost_of.get(module_path)
        if found is None:
            found = module_path
            while found and found not in units:
                found = found.rsplit(".", 1)[0] if "." in found else ""
            innermost_of[module_path] = found
        return found

    for path in paths:
        if path:
            units[path].parent = innermost(path.rsplit(".", 1)[0] if "." in path else "")
            units[units[path].parent].children.append(path)

    for name, param in model.named_parameters():
        module_path = name.rsplit(".", 1)[0] if "." in name else ""
        units[innermost(module_path)].params.append(ParamInfo(name, tuple(param.shape)))

    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, op in enumerate(trace.ops):
        owner = innermost(op.module)
        units[owner].ops.append(op.name)
        path = owner
        while path is not None:  # the op is also inside every enclosing unit
            first.setdefault(path, index)
            last[path] = index
            path = units[path].parent
    for path, unit in units.items():
        unit.first_op = first.get(path, 0)
        unit.last_op = last.get(path, len(trace.ops) - 1)
    units[""].first_op, units[""].last_op = 0, len(trace.ops) - 1
    return sorted(units.values(), key=lambda u: (u.first_op, u.path.count(".") if u.path else -1))
