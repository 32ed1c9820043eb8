"""What a pipeline costs and holds: the formulas the search prices each stage and the whole step with.

A pipeline of degree pp runs a step's m micro-batches through stages of contiguous units, one (or, for a
looped schedule, v) per pipeline rank. Against running every unit on every rank it changes these things,
each priced here from a schedule's row (cost_models.schedules) and a stage's cost table:

- **Activations in flight.** A rank holds the saved activations of every micro-batch whose forward it ran
  and whose backward it has not: GPipe all m; 1F1B pp - r on pipeline rank r; interleaved 1F1B
  Megatron's count, (pp - r - 1) x 2 + (v - 1) x pp + 1 chunks of 1/v of the rank's units (rank 0:
  pp (1 + (pp - 1) / (pp v)) micro-batches' worth, Narayanan et al. 2021); ZB-V as 1F1B's rank 0 on every
  rank (its V balances them: Qi et al. 2024). `in_flight`. Until the rank's first backward is done no
  gradient is accumulated yet; after it, GPipe (and 1F1B with no more micro-batches than its depth) holds
  one micro-batch fewer (`later_flight`): the two are priced apart (autoplan.solve.stage_solve).
- **The bubble**, in slots of the slowest rank's time per micro-batch: pp - 1 for GPipe and 1F1B, divided
  by v when looped, and a third of that left when the weight gradients are deferred into it (ZB-H1's
  (pp - 1)(F + B - W) against 1F1B's (pp - 1)(F + B + W) with F = B = W). `bubble_slots`.
- **Point-to-point sends**: a stage's output forward and its input's gradient backward, each of the
  stage's last op's output bytes, over the node's GPU links when the stages are parts of one node, else
  over the node's NICs, shared by the stage's ranks of that node that send at once. `send_s`.
- **FSDP under pipelining** (torchtitan; torch's PipelineStage): reshard_after_forward is off (the plan
  records it so: autoplan.plan.pipeline_plan) and no micro-batch's backward reshards or reduces, so a
  stage's parameters are all-gathered once per step and its gradients reduce-scattered once at the end,
  while the unsharded parameters and the unsharded gradients, accumulated in the reduce dtype, stay on the
  device all step in place of the sharded gradients (not at the optimizer step: the reductions reshard).
  `pipelined`: the collectives per micro-batch divided by m; the gathered bytes moved from the running
  units into what every point holds. A unit's reduction (FSDP2's foreach_reduce) then starts from its
  accumulated gradient, already among what every point holds: the copy into the reduction input frees it,
  and the reduction's output becomes the sharded gradient, so the reduction holds its input and, beside
  the accumulated gradient it replaces, only what the output (and gloo's copy) is larger by.
- **The reductions run after the backwards**: torch's PipelineStage turns FSDP's gradient sync off for every
  micro-batch's backward and runs each FSDP group's post-backward once the stage's last backward is done
  (`perform_reduce_grad`), so no backward holds a reduction input, and, on a rank of one stage, the
  reductions run with no micro-batch in flight (`HeldAllStep.drained`; autoplan.solve.stage_solve prices
  both). With stages looped on a rank, another stage's micro-batches can be in flight during a stage's
  reductions: those points keep every micro-batch in flight (a bound).
- **Receive buffers**: torch's PipelineStage allocates, for each micro-batch of the step, a buffer for a
  stage's input (but the first stage's) and one for its output's gradient (but the last's), held for the
  step (`HeldAllStep.buffers`, at every point). It also keeps each micro-batch's stage output (the last
  stage's: the logits) from its forward to its backward (`HeldAllStep.outputs`, per micro-batch in flight).

This module imports nothing from autoplan and nothing from torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.mesh import Mesh
from cost_models.profile import DeviceProfile
from cost_models.schedules import InFlight, ScheduleRow, StagesPerRank
from cost_models.table import CostTable

__all__ = ["LOOPED_STAGES", "ZERO_BUBBLE_LEFT", "HeldAllStep", "bubble_slots", "held_all_step", "in_flight",
           "later_flight", "makespan_s", "pipelined", "pipelined_table", "refusal", "send_s", "stages_per_rank"]

LOOPED_STAGES = 2  # stages per rank of a looped schedule: the most the bubble gains for the fewest extra sends
ZERO_BUBBLE_LEFT = 1 / 3  # of the looped bubble, what a schedule deferring the weight gradients leaves


def stages_per_rank(row: ScheduleRow) -> int:
    return 1 if row.stages_per_rank is StagesPerRank.ONE else LOOPED_STAGES


def refusal(row: ScheduleRow, pp: int, microbatches: int, units: int) -> str | None:
    """Why torch.distributed.pipelining cannot run `row` on `pp` ranks with `microbatches` per step and
    `units` to cut into stages (None: it can)."""
    stages = pp * stages_per_rank(row)
    if units < stages:
        return f"{row.name} needs {stages} stages of at least one unit; the model has {units}"
    if row.in_flight is not InFlight.ALL and microbatches < pp:
        # torch's 1F1B refuses fewer; the others' bubble (and so their pricing) assumes a full steady state
        return f"{row.name} needs at least {pp} micro-batches per step, got {microbatches}"
    if row.stages_per_rank is StagesPerRank.LOOPED and microbatches % max(1, microbatches // pp):
        return (f"{row.name} needs the micro-batches ({microbatches}) to be a multiple of its rounds "
                f"({microbatches // pp})")
    return None


def in_flight(row: ScheduleRow, pp: int, rank: int, microbatches: int) -> float:
    """Micro-batches' worth of pipeline rank `rank`'s saved activations (all its stages) held at its peak."""
    if row.in_flight is InFlight.ALL:
        return float(microbatches)
    if row.stages_per_rank is StagesPerRank.ONE:
        return float(min(microbatches, pp - rank))
    if row.stages_per_rank is StagesPerRank.V_SHAPE:
        return float(min(microbatches, pp))
    v = LOOPED_STAGES
    return min(microbatches * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1) / v


def bubble_slots(row: ScheduleRow, pp: int) -> float:
    """The step's idle time on a rank, in its time per micro-batch (all its stages, forward and backward)."""
    slots = (pp - 1) / stages_per_rank(row)
    return slots * ZERO_BUBBLE_LEFT if row.splits_backward else slots


def send_s(profile: DeviceProfile, nbytes: int, mesh: Mesh) -> float:
    """One point-to-point send of `nbytes` between neighbouring stages of `mesh`: over the node's GPU links when
    the stages split one node, else over its NICs, every rank of a stage's node sending at once."""
    if nbytes <= 0:
        return 0.0
    within_node, senders_per_node = mesh.pp > mesh.nodes, min(mesh.gpus_per_node, mesh.world_size // mesh.pp)
    topology = profile.topology
    if topology is not None:
        if within_node:
            return topology.base_latency_s + nbytes / topology.intra_bus_bytes_s
        share = topology.nics_per_node * topology.nic_bytes_s / max(1, senders_per_node)
        return topology.base_latency_s + topology.inter_hop_latency_s + nbytes / share
    link = profile.links.get("intra_node" if within_node else "inter_node") or profile.links["intra_node"]
    bandwidth = link.bus_bandwidth_bytes_s / (1 if within_node else max(1, senders_per_node))
    return link.latency_s + nbytes / bandwidth


@dataclass(frozen=True)
class HeldAllStep:
    """Per unit and option, bytes a pipelined stage holds at every forward and backward point beyond one
    micro-batch's timeline: the other micro-batches' activations in flight, the parameters FSDP keeps
    unsharded and their accumulating unsharded gradients."""

    activations: list[list[int]]  # once the rank's first backward is done (the gradients all accumulating)
    gathered: list[list[int]]
    grads: list[list[int]]
    buffers: int = 0  # held at every point, the optimizer step's too: torch's receive buffers for the step
    drained: bool = False  # its reductions run with no micro-batch in flight (one stage per rank)
    first: list[list[int]] | None = None  # until its first backward is done, where more are in flight then
    # its stages' outputs, which PipelineStage keeps for each micro-batch's backward: for those in flight once the
    # first backward is done, and before (at the points holding `activations`, and `first`)
    outputs: tuple[int, int] = (0, 0)

    def total(self, unit: int, option: int) -> int:
        flight = (self.first or self.activations)[unit][option]
        return flight + self.gathered[unit][option] + self.grads[unit][option]


def later_flight(row: ScheduleRow, flight: float, microbatches: int) -> float:
    """Micro-batches in flight on a rank once its first backward is done: on a rank of one stage, where the
    first backward came with every micro-batch in flight (GPipe; 1F1B with as many as its depth), one fewer;
    else as many (1F1B's steady state; looped stages: a bound)."""
    if row.stages_per_rank is StagesPerRank.ONE:
        return min(flight, microbatches - 1.0)
    return flight


def pipelined(table: CostTable, microbatches: int, flight: float, drained: bool = False,
              later: float | None = None) -> tuple[CostTable, HeldAllStep]:
    """A stage's table (built at `microbatches` per step) as the pipeline runs it, and what it holds beside
    one micro-batch's timeline with `flight` micro-batches in flight (`later` of them once its first backward is
    done: `later_flight`), `drained` where its reductions run with none in flight (see the module docstring).
    The table does not depend on the flight (`pipelined_table`), what it holds does (`held_all_step`)."""
    return pipelined_table(table, microbatches), held_all_step(table, flight, drained, later)


def pipelined_table(table: CostTable, microbatches: int) -> CostTable:
    """`pipelined`'s table: no parameters gathered or held per micro-batch (they are held all step), FSDP's
    collectives once per step spread over the micro-batches, the reductions beside the accumulated gradients."""
    upcast = table.precision.reduce_bytes / table.precision.compute_bytes
    costs = [[c.changed(gathered_bytes=0, held_bytes=0, comm_fwd_s=c.comm_fwd_s / microbatches,
                        comm_bwd_s=c.comm_bwd_s / microbatches,
                        reduce_peak_bytes=_accumulated_reduce_peak(c, upcast, table.precision.reduce_bytes))
              for c in unit_costs] for unit_costs in table.costs]
    return replace(table, costs=costs)


def held_all_step(table: CostTable, flight: float, drained: bool = False, later: float | None = None) -> HeldAllStep:
    """`pipelined`'s held bytes, from the stage's table as built."""
    saved = [0] * len(table.units)
    for seg in table.segments:
        saved[seg.unit] += seg.saved_bytes
    later = flight if later is None else later
    upcast = table.precision.reduce_bytes / table.precision.compute_bytes
    activations, first, gathered, grads = [], [], [], []
    for u, (options, unit_costs) in enumerate(zip(table.options, table.costs)):
        held = [c.activation_bytes if o.mode.checkpoints else saved[u] for o, c in zip(options, unit_costs)]
        activations.append([int(max(0.0, later - 1) * h) for h in held])
        first.append([int(max(0.0, flight - 1) * h) for h in held])
        gathered.append([c.gathered_bytes for c in unit_costs])
        # sharded gradients exist only after the reductions: until then the unsharded ones, accumulated in
        # the reduce dtype (FSDP2 upcasts them to accumulate), in their place
        grads.append([int(c.unsharded_grad_bytes * upcast) - c.grad_bytes if c.gathered_bytes else 0
                      for c in unit_costs])
    return HeldAllStep(activations, gathered, grads, drained=drained, first=first if later < flight else None)


def _accumulated_reduce_peak(cost, upcast: float, reduce_bytes: int) -> int:
    """A unit's reduction beside its accumulated gradient (counted among the gradients at every point): its input,
    and what the output (the sharded gradient, reduce dtype) and gloo's copy of the input are larger by than the
    accumulated gradient freed after the copy-in. A unit whose gradients are not accumulated unsharded (no
    gathered parameters) keeps its price."""
    if not cost.gathered_bytes:
        return cost.reduce_peak_bytes
    gloo_copy = cost.pending_reduce_bytes - cost.reduce_buffer_bytes
    accumulated = int(cost.unsharded_grad_bytes * upcast)
    return cost.reduce_buffer_bytes + max(0, cost.local_numel * reduce_bytes + gloo_copy - accumulated)


def makespan_s(slot_s: float, optimizer_s: float, row: ScheduleRow, pp: int, microbatches: int) -> float:
    """The step: m micro-batches plus the bubble, each a slot of the slowest rank (sends included), then the
    slowest rank's optimizer step."""
    return (microbatches + bubble_slots(row, pp)) * slot_s + optimizer_s
