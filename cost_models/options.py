"""The search space: what can be decided per unit. Adding an option is adding a row here.

`shard_group` is how many ranks one parameter is split over ("world", "node" or 1); a replicate
group all-reduces what the shard group cannot hold. `reshard_after_forward` is FSDP2's flag:
False keeps the gathered parameters from the forward until the backward (ZeRO-2-like).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ShardingKind:
    name: str
    shard_group: Literal["world", "node", "one"]
    reshard_after_forward: bool
    multi_node_only: bool = False
    description: str = ""


SHARDING_KINDS = {
    kind.name: kind
    for kind in (
        ShardingKind("shard", "world", True, description="ZeRO-3: params, grads, optimizer sharded over all ranks"),
        ShardingKind("shard_keep", "world", False, description="sharded, params kept gathered from forward to backward"),
        ShardingKind("replicate", "one", True, description="DDP-like: full copy on every rank, gradients all-reduced"),
        ShardingKind(
            "hybrid", "node", True, multi_node_only=True,
            description="sharded within a node, replicated across nodes (HSDP)",
        ),
    )
}


@dataclass(frozen=True)
class Option:
    sharding: str
    checkpoint: bool

    @property
    def kind(self) -> ShardingKind:
        return SHARDING_KINDS[self.sharding]

    @property
    def label(self) -> str:
        return self.sharding + ("+ckpt" if self.checkpoint else "")


def options_for(is_leaf: bool, is_root: bool, nodes: int) -> list[Option]:
    """Options open to a unit. Checkpointing applies to leaf units that are not the whole model."""
    options = []
    for kind in SHARDING_KINDS.values():
        if kind.multi_node_only and nodes < 2:
            continue
        if is_root and not kind.reshard_after_forward:
            continue  # not offered for the root yet (apply reshards it after forward like any unit)
        options.append(Option(kind.name, False))
        if is_leaf and not is_root:
            options.append(Option(kind.name, True))
    return options
