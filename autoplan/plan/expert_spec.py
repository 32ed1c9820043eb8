"""The plan file's record of expert parallelism: what splitting the experts costs and saves.

A plan without one (`Plan.experts` None, every older plan and every plan of `ep` 1) runs its experts as
any unit. With one, the cluster's `ep_degree` groups of neighbouring data-parallel ranks split each expert
stack by expert (cost_models.expert_parallel): the record says how many experts a rank holds, over how many
ranks FSDP shards them, where the all-to-alls run and what they move and take per step, and what a gathered
stack weighs with and without the split. The FSDP-only alternative's figures are the plan's "fsdp only"
baseline.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from autoplan.plan.figures import Count, Seconds, StrictRecord

__all__ = ["ExpertParallelSpec"]


class ExpertParallelSpec(StrictRecord):
    """Expert parallelism in a plan (see the module docstring)."""

    degree: int = Field(ge=2)  # ranks one group splits the experts over (ClusterSpec.ep_degree)
    stacks: Count  # the model's expert stacks (one per mixture-of-experts layer)
    experts_per_rank: int = Field(ge=1)  # of each stack's experts, those one rank holds
    expert_shard: int = Field(ge=1)  # ranks the experts' FSDP shards a rank's experts over (dp / degree)
    scope: Literal["intra_node", "inter_node"]  # where a group's all-to-alls run
    all_to_all_bytes: Count  # one dispatch's (or combine's) buffer on one rank, per stack and micro-batch
    all_to_all_s: Seconds  # every stack's all-to-alls in one step, forward and backward (a recomputation's too)
    gathered_stack_bytes: Count  # one stack's weights as FSDP gathers them on a rank, in the compute dtype
    gathered_stack_bytes_fsdp_only: Count  # the same without expert parallelism (all the stack's experts)
