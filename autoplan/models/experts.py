"""What expert parallelism needs to know of a mixture-of-experts model: where its expert stacks are, how many
experts each holds, how many a token is routed to and the width a routed token has.

The search asks it (which expert-parallel degrees a model takes, what its all-to-alls move), so does `apply`
(which modules get their experts split). `apply` splits the zoo's experts only, so a search tries expert
parallelism by default only for them; other stacks (transformers' MoE layers) are priced under `--ep N`. A model without stacked experts has none; expert parallelism is
then refused with the reason. The stacks are found as the units are (autoplan.models.structure.expert_stacks
in each block); the routing's top-k and the hidden width come from the model's config (the zoo's `top_k` and
`d_model`, or transformers' `num_experts_per_tok` and `hidden_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from autoplan.errors import UsageError
from autoplan.models.moe import Experts
from autoplan.models.structure import expert_stacks, largest_module_list

__all__ = ["ExpertInfo", "check_expert_degree", "experts_of"]


@dataclass(frozen=True)
class ExpertInfo:
    """A model's routed experts: the stacks' module paths, the experts per stack, top-k and the token width."""

    stacks: tuple[str, ...] = ()
    n_experts: int = 0
    top_k: int = 0
    hidden: int = 0
    runs_split: bool = False  # every stack is the zoo's Experts, which `apply` can split (autoplan.run.experts)

    def __bool__(self) -> bool:
        return bool(self.stacks)


def experts_of(model: nn.Module) -> ExpertInfo:
    """The model's expert stacks (ExpertInfo() for a model without them)."""
    blocks_path = largest_module_list(model)
    if blocks_path is None:
        return ExpertInfo()
    stacks: list[str] = []
    counts: set[int] = set()
    zoo = True
    for index, block in enumerate(model.get_submodule(blocks_path)):
        for name in expert_stacks(block):
            stacks.append(f"{blocks_path}.{index}.{name}")
            zoo = zoo and type(block.get_submodule(name)) is Experts
            counts.add(next(p for p in block.get_submodule(name).parameters(recurse=False) if p.dim() >= 3).shape[0])
    if not stacks:
        return ExpertInfo()
    config = getattr(model, "config", None)
    top_k = getattr(config, "top_k", None) or getattr(config, "num_experts_per_tok", None) or 1
    hidden = getattr(config, "d_model", None) or getattr(config, "hidden_size", None) or 0
    return ExpertInfo(tuple(stacks), min(counts), int(top_k), int(hidden), zoo)


def check_expert_degree(info: ExpertInfo, ep: int, model_name: str) -> None:
    """UsageError where `ep` above 1 cannot split the model's experts."""
    if ep == 1:
        return
    if not info:
        raise UsageError(f"`ep` {ep}: {model_name} has no mixture-of-experts layers (no stacked expert weights) "
                         "to split; leave `ep` out, or give 1")
    if info.n_experts % ep:
        raise UsageError(f"`ep` {ep} does not divide {model_name}'s {info.n_experts} experts; choose one of "
                         + ", ".join(str(e) for e in range(1, info.n_experts + 1) if info.n_experts % e == 0))
