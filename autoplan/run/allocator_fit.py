"""Plans that fit under torch's CUDA caching allocator (`autoplan search --fit-allocator`).

Why: a CUDA run fails when the caching allocator cannot find or make a block, not when live tensors
reach the limit. What a step needs above its allocated peak (rounding, per-stream caches, segments that
a live block keeps from being freed) is 1-19% by plan in the replays of benchmarks/allocator.py, so a
flat factor (cost_models.allocator.reserved_bound) either wastes up to 18 points of a GPU or lets some
plans fail. Here the plan's own step is replayed instead: rank 0 of its world runs on fake tensors and
torch's fake process group (no GPU, no memory), every storage allocation and free is recorded in order
with the CUDA stream FSDP2 makes it on, and cost_models.allocator finds the smallest limit the step runs
in. If that is above the limit, the search runs again with the excess kept free (a larger headroom),
and its plan is replayed, until one fits: the headroom each plan gets is what its own step needs. The default
search's plan, fitted to the needed bound (cost_models.allocator_margin, which holds every replay), is the plan
that fits from the start: natively that bound leaves 5-12% of the limit unused on some models (its category
weights cannot tell how much a model's blocks strand), so the rounds after it search between it and the plan
that ran out, for the least headroom whose step fits.

Not seen by a replay (fake tensors run no kernel): cuBLAS/cuDNN workspaces and kernel scratch, counted
as the allocator model's SEGMENT_SLACK, and memory outside the allocator (CUDA context, NCCL buffers).
Plans that cannot be replayed yet are refused with the reason: units sharded within a node and replicated
across nodes (a 2-D mesh). Units offloaded to the host replay with their host state left out (on fake tensors the
host and the device are one memory: autoplan.run.host_storage tells them apart). Tensor-parallel plans replay
(FSDP2's join of the data- and tensor-parallel meshes runs outside the fake mode: autoplan.run.torch_tracker). A
recording of llama2-70b's rank 0 (80 layers) takes about 30 s here; its replay then runs the recorded steps on until
the allocator settles (cost_models.steady_steps: up to 20 steps, 1-15 CPU-s for a 7B model).
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autoplan.api.search import search
from autoplan.errors import InfeasibleError
from autoplan.plan.schema import Plan
from autoplan.run.apply import materialise
from autoplan.run.data import vocab_size_of
from autoplan.run.host_storage import HostStorage
from autoplan.run.memtrack import LiveTensorTracker
from autoplan.run.replayable import check_replayable
from autoplan.run.torch_tracker import fake_rank, rank_chunks
from autoplan.run.tp import training_context
from autoplan.run.worker import next_token_loss
from autoplan.settings import MAX_HEADROOM, SearchSettings
from autoplan.sizes import format_bytes
from cost_models.allocator import SEGMENT_SLACK
from cost_models.allocator_replay import replay_room, run_and_min_limit
from cost_models.steady_steps import Steps, repeat_steps

__all__ = ["STREAMS", "AllocatorReplay", "record_steady", "record_step", "replay_events", "replay_plan",
           "search_fitting_allocator"]

STREAMS = {"default": 0, "all_gather": 1, "reduce_scatter": 2}
MAX_ROUNDS = 6
BRACKET = 0.01  # headroom (a fraction of the limit) to which the fit is narrowed once a plan fits
CLOSE = 0.02  # a fitting plan whose step leaves at most this fraction of the limit unused ends the fit


def _stream() -> int:
    """The stream FSDP2 would allocate on now, from the calling frames (fsdp/_fully_shard/_fsdp_collectives)."""
    frame = sys._getframe(3)
    while frame is not None:
        name = frame.f_code.co_name
        if name == "foreach_all_gather":
            return STREAMS["all_gather"]
        if name == "foreach_reduce":  # the reduction input is made on the default stream, the rest on its own
            return STREAMS["reduce_scatter"] if "reduce_scatter_input" in frame.f_locals else STREAMS["default"]
        frame = frame.f_back
    return STREAMS["default"]


class _AllocationRecorder(LiveTensorTracker):
    """The live-tensor tracker, writing each storage's allocations and frees as replay events."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self._event_key: dict[int, tuple[int, int]] = {}
        self._generation = 0
        self.host = HostStorage(lambda storage: self._event_key.get(storage._cdata))  # offloaded state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented:  # a wrapper subclass's op: its inner ops come here instead
            self.host.outputs(func, args, kwargs, out)
        return out


    def _set_size(self, key: int, nbytes: int) -> None:
        if self._bytes_by_storage[key]:  # a resize frees the old block and takes a new one
            self.events.append(("free", self._event_key.pop(key)))
        if nbytes:
            self._generation += 1
            self._event_key[key] = (key, self._generation)
            self.events.append(("alloc", self._event_key[key], nbytes, _stream()))
        super()._set_size(key, nbytes)

    def _wrap_resize(self) -> None:
        """As the tracker's, but a storage it already counts is followed on the meta device too: a fake
        tensor's storage is a meta one, and FSDP2 frees and re-makes gathered parameters by resizing it."""
        original = torch.UntypedStorage.resize_
        recorder = self

        def resize_(storage, size):
            result = original(storage, size)
            if storage._cdata in recorder._bytes_by_storage or storage.device.type != "meta":
                recorder._track_storage(storage)
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_

    def _forget(self, key: int) -> None:
        with self._lock:
            if key in self._event_key:
                self.events.append(("free", self._event_key.pop(key)))
        super()._forget(key)


def record_step(plan: Plan, steps: int = 3, prepare: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None
                = None, shard_optimizer: bool = True) -> tuple[list[tuple], list[int]]:
    """The allocation events of materialisation and `steps` training steps of rank 0 of `plan`'s world, on
    fake tensors, the optimizer stepping foreach as on CUDA; and the event index at the start of each step
    (negative: the start of a backward or an optimizer step within it). Only the device's: offloaded state on the
    host is left out (autoplan.run.host_storage). `prepare(module, optimizer)`: run (and recorded) after
    materialisation, before the first step (benchmarks/allocator_max_split.py: optimizer states made early), with the
    optimizer that steps. `shard_optimizer`: step the parameters' local shards (the same events, a fifth faster:
    _ShardOptimizer); False steps the DTensor parameters themselves."""
    recorder = _AllocationRecorder()
    starts: list[int] = []
    with fake_rank(plan) as (_, module, optimizer, context), recorder, training_context(plan), recorder.host.copies():
        materialise(module, "cpu", 0)  # (loss_parallel under TP; FSDP2's host copies made real where offloaded)
        recorder.host.tag_offloaded(module)
        if shard_optimizer:
            optimizer = _ShardOptimizer(optimizer)
        if prepare is not None:
            prepare(module, optimizer.local if shard_optimizer else optimizer)
        shape = (plan.training.micro_batch_size, plan.training.seq_len)
        vocab = vocab_size_of(module)
        ids, labels = torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)
        for _ in range(steps):
            starts.append(len(recorder.events))
            for _ in range(plan.training.grad_accum_steps):
                with rank_chunks(context, ids, labels) as (rank_ids, rank_labels):  # context parallelism's chunks
                    loss = next_token_loss(module(rank_ids), rank_labels)
                    starts.append(-len(recorder.events))
                    loss.backward()
                    del loss
            starts.append(-len(recorder.events))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        events = list(recorder.events)  # not the frees of tearing the model down
    host = recorder.host.keys
    before = [0]  # device events before each event index
    for event in events:
        before.append(before[-1] + (event[1] not in host))
    return [event for event in events if event[1] not in host], [before[s] if s >= 0 else -before[-s] for s in starts]


class _ShardOptimizer:
    """The plan's optimizer stepping the local shards of its DTensor parameters: the same tensors, ops and
    allocations in the same order (every foreach op of a DTensor list runs on the local tensors), without DTensor's
    sharding propagation for each foreach op over hundreds of parameters, which it does not cache: a fifth of
    a recording's time (llama2-7b at 4096 tokens: 9.1 -> 7.4 CPU-s; the events the same, checked in
    tests/test_steady_steps.py). Each step hands the gradients' local shards to the local parameters and takes
    them back after."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.pairs = [(param, getattr(param, "_local_tensor", param))
                      for group in optimizer.param_groups for param in group["params"]]
        local = iter(shard for _, shard in self.pairs)
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [next(local) for _ in group["params"]]} for group in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters  # (defaults hold some it does not take)
        self.local = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def step(self) -> None:
        for param, shard in self.pairs:
            if shard is not param:
                shard.grad = None if param.grad is None else getattr(param.grad, "_local_tensor", param.grad)
        self.local.step()
        for param, shard in self.pairs:
            if shard is not param:
                shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


@dataclass
class AllocatorReplay:
    """Rank 0's step under the caching allocator model. Bytes."""

    allocated_bytes: int  # the peak of allocated blocks (requests rounded to 512 B)
    reserved_bytes: int  # max_memory_reserved with no limit: every segment the allocator ever made, kept
    # the smallest limit the step runs in, and every limit of a grid up to 6% above it (to 2 MiB;
    # cost_models.allocator_replay.run_and_min_limit), plus SEGMENT_SLACK for kernel workspaces
    needed_bytes: int
    events: int


def replay_plan(plan: Plan) -> AllocatorReplay:
    """Record `plan`'s steps on fake tensors (`record_steady`) and replay them through the caching allocator model
    of the plan's configuration (expandable segments or native, with its `max_split_size_mb`; native for a plan that
    records none)."""
    check_replayable(plan)
    steps = record_steady(plan)
    return replay_events(steps.events, plan.cluster.expandable_segments, plan.cluster.max_split_size, steps)


def record_steady(plan: Plan) -> Steps:
    """`record_step`'s three steps carried on to at most STEADY_STEPS by repeating the last
    (cost_models.steady_steps): replayed with them (`replay_events(..., settle=)`), what the allocator needs once
    its cache has settled, where three steps can leave it short (natively up to 5% on the default plans of
    benchmarks/allocator.py, 13% on its grid). The three recorded steps alone where they do not repeat."""
    return repeat_steps(*record_step(plan))


def replay_events(events: list[tuple], expandable: bool, max_split_size: int | None = None,
                  settle: Steps | None = None) -> AllocatorReplay:
    """A recorded step (`record_step`'s events) through the caching allocator model, native or with expandable
    segments (natively, `max_split_size` as PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb, in bytes): its peaks, and the
    smallest limit it runs in plus SEGMENT_SLACK. `settle`: `record_steady`'s steps, whose events these are: each
    run ends once the allocator has settled (cost_models.allocator_replay.run_and_min_limit)."""
    free_run, needed = run_and_min_limit(events, max_split_size, expandable=expandable, settle=settle)
    return AllocatorReplay(free_run.peak_allocated, free_run.peak_reserved, needed + SEGMENT_SLACK, len(events))


def search_fitting_allocator(settings: SearchSettings, say: Callable[[str], None] = lambda line: None,
                             rounds: int = MAX_ROUNDS, default: tuple[Plan, AllocatorReplay] | None = None,
                             ) -> tuple[Plan, list[AllocatorReplay]]:
    """The fastest plan whose step fits the memory limit under the caching allocator, within `rounds` searches,
    each plan's step replayed: first the live bytes planned to the limit less the settings' headroom; if that
    step needs more than the limit, the default search's plan (fitted to the needed bound, which holds every
    replay; with `fit_to` "allocated", searches with more headroom by a secant step until one fits); then,
    between the largest headroom that failed and the smallest that fitted, the headroom where the replays'
    need meets the limit (kept inside the bracket's middle half), until the bracket is BRACKET wide or a plan's
    step needs within CLOSE of the limit; a replay's figure is held to the limit less what a GPU needed beyond a
    replay (allocator_replay.GPU_REPLAY_ERROR: 1% with expandable segments, 2% natively). Returns the fitting plan
    with the least headroom (its prediction records `allocator_needed_bytes`) and every round's replay (a plan
    found again not replayed again); InfeasibleError if none fits. `default`: the default plan and its replay."""
    bound_fitted = settings if settings.fit_to == "needed" else None
    settings = SearchSettings.create(settings, fit_to="allocated")  # the replay fits the live bytes, not a bound
    headroom, replays, previous = settings.headroom, [], None
    seen = {} if default is None else {_replayed_as(default[0]): default[1]}  # each plan's replay, once
    failed, best, limit = None, None, None  # (headroom, needed) of the largest that failed; (headroom, plan, needed)
    for round_ in range(1, rounds + 1):
        from_bound = round_ > 1 and best is None and bound_fitted is not None
        if from_bound and default is not None:
            plan, result = default
        else:
            plan = search(settings=bound_fitted if from_bound else SearchSettings.create(settings, headroom=headroom))
            result = seen.get(key := _replayed_as(plan)) or seen.setdefault(key, replay_plan(plan))
        limit, peak = plan.cluster.mem_limit_bytes, plan.predicted.peak_mem_bytes
        room = replay_room(limit, plan.cluster.expandable_segments)  # the GPU's need: up to 2% more
        replays.append(result)
        if from_bound:
            headroom, bound_fitted = 1 - peak / limit, None  # its live bytes, as a headroom
        say(f"allocator replay {round_}: predicted peak {format_bytes(peak)}, {_needs(result, room, limit)}, headroom "
            f"{headroom:.1%}{', the plan fitted to the needed bound' if from_bound else ''})")
        if result.needed_bytes <= room:
            prediction = plan.predicted.model_copy(update={"allocator_needed_bytes": result.needed_bytes})
            if best is None or headroom < best[0]:
                best = (headroom, plan.model_copy(update={"predicted": prediction}), result.needed_bytes)
        elif failed is None or headroom > failed[0]:
            failed = (headroom, result.needed_bytes)
        if best is not None and (failed is None or best[0] - failed[0] <= BRACKET or best[2] >= room * (1 - CLOSE)):
            break
        if best is not None:
            headroom = _between(failed, best, room)
        elif bound_fitted is None:
            # plan lower by the overshoot, over how much the need fell per byte of peak last round (a secant step:
            # a leaner plan needs less, but by less than its peak fell, since part of the excess is fixed)
            slope = 1.0
            if previous is not None and previous[0] != peak:
                slope = min(1.0, max(0.1, (previous[1] - result.needed_bytes) / (previous[0] - peak)))
            previous = (peak, result.needed_bytes)
            target = peak - (result.needed_bytes - room) / slope
            headroom = min(max(1 - target / limit, headroom + BRACKET), MAX_HEADROOM - BRACKET)
            if headroom <= failed[0]:
                break
    if best is not None:
        return best[1], replays
    raise InfeasibleError(
        f"no plan fits {format_bytes(limit)} under the caching allocator after {len(replays)} round(s): the last "
        f"needed {format_bytes(replays[-1].needed_bytes)} (at most {format_bytes(room)} leaves room for what a GPU "
        "needs beyond a replay); try a larger --mem, a smaller --batch-size, or checkpointing")


def _replayed_as(plan: Plan) -> str:
    """What a replay of `plan` reads, as text: the plan less its predictions, its search's record and the headroom
    it was searched with (two plans alike in the rest record the same allocations)."""
    data = plan.model_dump(mode="json", exclude={"predicted", "solver", "timing", "baselines"})
    data["cluster"].pop("mem_headroom", None)
    for unit in data["units"]:
        unit.pop("predicted", None)
    return json.dumps(data, sort_keys=True)


def _needs(result: AllocatorReplay, room: int, limit: int) -> str:
    return (f"needs a limit of {format_bytes(result.needed_bytes)} under the caching allocator (at most "
            f"{format_bytes(room)} within the limit {format_bytes(limit)}")


def _between(failed: tuple, best: tuple, limit: int) -> float:
    """The headroom to try between one whose plan needed more than `limit` (failed: headroom, needed) and one whose
    plan fitted (best: headroom, plan, needed): where the need, linear in the headroom between the two, is the
    limit less half a BRACKET; kept in the bracket's middle half, so that each round narrows it by a quarter or
    more whatever the plans do."""
    width = best[0] - failed[0]
    target = limit * (1 - BRACKET / 2)
    share = (failed[1] - target) / max(failed[1] - best[2], 1)
    return failed[0] + width * min(0.75, max(0.25, share))
