"""One unit's choices: the combinations of the registry's rows (cost_models.options) open to it.

A choice is a sharding kind x a checkpoint mode x offload or not. Which combinations are meaningful
depends on the unit (checkpointing needs a leaf that is not the whole model; offload needs parameters)
and on the cluster (multi-node kinds need two nodes); this module is the one place that says so, and
names no option: it reads the rows' properties.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.options import (
    CHECKPOINT_MODES,
    DEFAULT_CHECKPOINT,
    SHARDING_KINDS,
    CheckpointMode,
    Recompute,
    ShardingKind,
)

__all__ = ["Option", "options_for", "searched_options"]


@dataclass(frozen=True)
class Option:
    """One choice for one unit: a sharding kind, a checkpoint mode, and whether its parameters, gradients
    and optimizer states live on the host (FSDP2's CPUOffloadPolicy)."""

    sharding: str
    checkpoint: str = DEFAULT_CHECKPOINT
    offload: bool = False

    @property
    def kind(self) -> ShardingKind:
        return SHARDING_KINDS[self.sharding]

    @property
    def mode(self) -> CheckpointMode:
        return CHECKPOINT_MODES[self.checkpoint]

    @property
    def recompute(self) -> Recompute:
        return self.mode.recompute

    @property
    def label(self) -> str:
        """"shard", "shard+ckpt", "replicate+sel+offload": what reports and pins write."""
        return self.sharding + self.mode.label + ("+offload" if self.offload else "")


def options_for(is_leaf: bool, is_root: bool, nodes: int, offload: bool = False,
                has_params: bool = True) -> list[Option]:
    """Options open to a unit. Checkpointing applies to leaf units that are not the whole model;
    offload (where `offload`: the profile prices the host link) to units that own parameters."""
    options = []
    for kind in SHARDING_KINDS.values():
        if kind.multi_node_only and nodes < 2:
            continue
        if is_root and not kind.reshard_after_forward:
            continue  # not offered for the root yet (apply reshards it after forward like any unit)
        for mode in CHECKPOINT_MODES.values():
            if mode.checkpoints and not (is_leaf and not is_root):
                continue
            options.append(Option(kind.name, mode.name, False))
            if offload and has_params:
                options.append(Option(kind.name, mode.name, True))
    return options


def searched_options(options: list[Option]) -> list[int]:
    """The indices of `options` the solver's search considers: those whose checkpoint mode is searched, or all
    of them where none is (a unit pinned to an unsearched mode keeps it)."""
    searched = [i for i, option in enumerate(options) if option.mode.searched]
    return searched or list(range(len(options)))
