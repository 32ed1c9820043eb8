"""What a pipeline costs and holds: the formulas the search prices each stage and the whole step with.

A pipeline of degree pp runs a step's m micro-batches through stages of contiguous units, one (or, for a
looped schedule, v) per pipeline rank. Against running every unit on every rank it changes these things,
each priced here from a schedule's row (cost_models.schedules) and a stage's cost table:

- **Activations in flight.** A rank holds the saved activations of every micro-batch whose forward it ran
  and whose backward it has not: GPipe all m; 1F1B pp - r on pipeline rank r; interleaved 1F1B
  Megatron's count, (pp - r - 1) x 2 + (v - 1) x pp + 1 chunks of 1/v of the rank's units (rank 0:
  pp (1 + (pp - 1) / (pp v)) micro-batches' worth, Narayanan et al. 2021); torch's zero-bubble schedules
  (interleaved and ZB-V) as 1F1B's rank 0 on every rank, 2 pp stage-chunks (counted from their own
  `pipeline_order` at pp 2, 4, 8 and m = pp..4 pp: benchmarks/zero_bubble.py, tests/test_pipeline_search.py).
  `in_flight`. Those two split each backward: an input-gradient pass (I, `retain_graph`) keeps the micro-batch's
  saved activations and the gradient of every weight op's output until its weight pass (W), so a rank also
  holds those gradients for the chunks of its later stage whose I ran and W has not (at the peak, the one
  whose I just ran included: r + 1 on rank r for interleaved zero bubble, 1 for ZB-V; the first stage runs
  no I); at each of the later stage's backward points, what the running I keeps that a full backward frees;
  and the weight passes' gradients in the compute dtype until FSDP2 accumulates them. `deferred`,
  `split_backward`. Until the rank's first backward is done no
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

__all__ = ["LOOPED_STAGES", "ZERO_BUBBLE_LEFT", "HeldAllStep", "bubble_slots", "deferred", "held_all_step",
           "in_flight", "later_flight", "makespan_s", "pipelined", "pipelined_table", "refusal", "send_s",
           "split_backward", "stages_per_rank", "weight_output_bytes"]

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
    if row.splits_backward:  # torch's zero-bubble orders: 2 pp chunks on every rank (the module docstring)
        return float(min(microbatches, pp))
    v = LOOPED_STAGES
    return min(microbatches * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1) / v


def deferred(row: ScheduleRow, pp: int, rank: int, microbatches: int) -> int:
    """Stage-chunks of pipeline rank `rank`'s later stage whose input-gradient pass ran and whose weight pass has
    not, at the rank's peak (its most chunks in flight), the one whose input-gradient pass just ran included:
    counted from torch's `pipeline_order` (tests/test_pipeline_search.py). 0 where the backward is not split."""
    if not row.splits_backward:
        return 0
    return 1 if row.stages_per_rank is StagesPerRank.V_SHAPE else min(microbatches, rank + 1)


def weight_output_bytes(ops: list) -> tuple[int, ...]:
    """Per op, the gradient of its output where it is a weight op (one computing parameter gradients), else 0: what
    an input-gradient pass keeps for the weight pass, per micro-batch (the output's bytes: its gradient has its shape
    and dtype)."""
    return tuple(op.out_bytes if op.param_grad_bytes else 0 for op in ops)


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
    # per segment (None: not of the rank's later stage, or no split backward), per unit and option: what the split
    # backward's input-gradient pass of the later stage holds at that segment's backward point beyond a full
    # backward's (`split_backward`)
    split: tuple | None = None

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


def held_all_step(table: CostTable, flight: float, drained: bool = False, later: float | None = None,
                  split: tuple | None = None) -> HeldAllStep:
    """`pipelined`'s held bytes, from the stage's table as built; `split`: the rank's `deferred` chunks, the first
    op of its later stage, of its stages that split their backward, and per op its weight output's bytes
    (`weight_output_bytes`), where the backward splits (`split_backward`)."""
    others, points, split_units = split_backward(table, *split) if split else ([0] * len(table.units), None, set())
    saved = [0] * len(table.units)
    for seg in table.segments:
        saved[seg.unit] += seg.saved_bytes
    later = flight if later is None else later
    upcast = table.precision.reduce_bytes / table.precision.compute_bytes
    activations, first, gathered, grads = [], [], [], []
    for u, (options, unit_costs) in enumerate(zip(table.options, table.costs)):
        held = [c.activation_bytes if o.mode.checkpoints else saved[u] for o, c in zip(options, unit_costs)]
        activations.append([int(max(0.0, later - 1) * h) + others[u] for h in held])
        first.append([int(max(0.0, flight - 1) * h) + others[u] for h in held])
        gathered.append([c.gathered_bytes for c in unit_costs])
        # sharded gradients exist only after the reductions: until then the unsharded ones, accumulated in
        # the reduce dtype (FSDP2 upcasts them to accumulate), in their place; a weight pass's, in the compute dtype,
        # wait beside them for the next input-gradient pass's post-backward to accumulate them (`split_backward`)
        pending = [c.unsharded_grad_bytes if u in split_units and upcast > 1 else 0 for c in unit_costs]
        grads.append([int(c.unsharded_grad_bytes * upcast) - c.grad_bytes + w if c.gathered_bytes else 0
                      for c, w in zip(unit_costs, pending)])
    return HeldAllStep(activations, gathered, grads, drained=drained, first=first if later < flight else None,
                       split=points)


def split_backward(table: CostTable, pending: int, later_op: int, split_op: int,
                   op_grads: tuple[int, ...]) -> tuple[list, tuple, set]:
    """What torch's split backward holds on a rank beyond a full backward's timeline (`deferred`: `pending` chunks of
    its later stage, its ops from `later_op`, whose input-gradient pass (I) ran and weight pass (W) has not; its
    stages from op `split_op` split their backward, the model's first stage does not; `op_grads`: per op, its weight
    output's gradient bytes), per unit (and option):
    - the other pending chunks' weight-output gradients, at every point;
    - per segment of the later stage, at its backward point, what the running chunk's I holds beyond the full
      backward priced there: I runs with `retain_graph`, so the segment's activations a full backward has freed by
      its peak and every later segment's stay, beside the weight outputs' gradients of the segment and the later
      ones; the loss's activations excepted (I detaches the stage's output, freeing what lies above its last weight
      op: torch's `stage_backward_input`);
    - the units with weight ops in split stages: W writes their gradients in the compute dtype, and FSDP2
      accumulates them into the reduce dtype only at the unit's next post-backward, at the end of its next I
      (measured on one layer under FSDP2, bf16 / fp32: every parameter's gradient set after each W, none after
      the next I)."""
    segments = table.segments
    later = [seg.first_op >= later_op for seg in segments]
    grads = [sum(op_grads[seg.first_op:seg.last_op + 1]) if on else 0 for seg, on in zip(segments, later)]
    others = [0] * len(table.units)
    for seg, g, on in zip(segments, grads, later):
        others[seg.unit] += (pending - 1) * (g - (seg.saved_bytes if on and seg.outside_model else 0))
    first_of: dict[int, int] = {}
    for i, seg in enumerate(segments):
        first_of.setdefault(seg.unit, i)
    done = [[0] * len(options) for options in table.options]  # later segments' input-gradient passes, done
    points: list = [None] * len(segments)
    for i in reversed(range(len(segments))):
        seg, u = segments[i], segments[i].unit
        if not later[i]:
            break
        options, costs = table.options[u], table.costs[u]
        here = [grads[i] + (0 if o.mode.checkpoints else seg.saved_bytes - seg.bwd_peak.activations) for o in options]
        points[i] = [row if v != u else [d + h for d, h in zip(row, here)] for v, row in enumerate(done)]
        kept = [0 if seg.outside_model else c.activation_bytes * (first_of[u] == i) if o.mode.checkpoints
                else seg.saved_bytes for o, c in zip(options, costs)]
        done[u] = [d + grads[i] + k for d, k in zip(done[u], kept)]
    split_units = {seg.unit for seg in segments
                   if seg.first_op >= split_op and any(op_grads[seg.first_op:seg.last_op + 1])}
    return others, tuple(points), split_units


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
