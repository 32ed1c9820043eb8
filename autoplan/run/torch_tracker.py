"""A second opinion on a plan's memory: torch's own FSDPMemTracker, on fake tensors, for rank 0 of the plan's world.

Why: autoplan's memory model and its live-tensor tracker (memtrack) were written together, so an error they
share would go unseen. torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker is an independent
implementation: it follows every storage that FSDP2, autograd and the optimizer make. Here it runs under
FakeTensorMode (no bytes are allocated, so a 7B model is tracked in seconds on a laptop) and on torch's fake
process group (this process is rank 0 of a world of the plan's size; collectives return at once), on the
CPU, since fake CUDA needs a CUDA build.

The step is `autoplan apply`'s: the loss of the model's output by `worker.next_token_loss`, with nothing
else holding the logits, then backward, then the optimizer step; it is tracked phase by phase (forward
with the loss, backward, optimizer step) after one untracked warm-up step, so that the optimizer's states
exist, as in the run. The optimizer is the plan's, run the way it runs on the profile's device: on a
CUDA profile torch's foreach implementation (its default on CUDA; on the CPU torch would step one tensor
at a time).

`hold_logits=True` runs the step as many training loops write it (`out = model(x); loss = f(out, y);
loss.backward()`): the caller's reference keeps the model's output (the bf16 logits) alive through the
whole backward, one micro-batch x sequence x vocabulary x 2-byte tensor more than `autoplan apply`, which
frees it once the loss has its fp32 copy (as torchtitan does with `del pred`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoplan.errors import UsageError
from autoplan.plan.schema import Plan
from autoplan.profile_store import load_profile
from autoplan.run.apply import apply, materialise, resolve_plan_model
from autoplan.run.data import vocab_size_of
from autoplan.run.replayable import check_fake_rank
from autoplan.run.report import predicted_phase_peaks
from autoplan.run.worker import next_token_loss
from cost_models.options import PRECISIONS, Dtype

__all__ = ["TrackerResult", "fake_rank", "rank_chunks", "track_plan"]


@dataclass
class TrackerResult:
    """torch's FSDPMemTracker beside the plan's prediction, per phase, for rank 0 of the plan's world."""

    model: str
    world_size: int
    micro_batch_size: int
    seq_len: int
    foreach: bool  # how the optimizer stepped (torch's foreach implementation, or one tensor at a time)
    hold_logits: bool
    predicted_phase_bytes: dict[str, int]
    tracked_phase_bytes: dict[str, int]  # the tracker's peak within each phase
    tracked_categories: dict[str, int]  # the tracker's categories at its highest phase's peak
    logits_bytes: int  # one micro-batch of logits in the compute dtype
    buffer_bytes: int  # the model's buffers (RoPE tables, ...): the tracker counts them, the prediction does not

    @property
    def predicted_peak_bytes(self) -> int:
        return max(self.predicted_phase_bytes.values())

    @property
    def tracked_peak_bytes(self) -> int:
        return max(self.tracked_phase_bytes.values())

    @property
    def error(self) -> float:
        """(predicted - tracked) / tracked peak."""
        return (self.predicted_peak_bytes - self.tracked_peak_bytes) / self.tracked_peak_bytes


@contextmanager
def _mesh_joins_outside(fake_mode):
    """FSDP2 joins a unit's data-parallel mesh with its tensor-parallel one (`DeviceMesh._concatenate`, in
    `_init_sharding_spec_tp`), which builds the joined mesh's rank tensor from the real rank map: under a
    FakeTensorMode that fails (a real tensor among fake ones). The join is rank bookkeeping, not a model tensor,
    so it runs with the fake mode set aside; everything else stays fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    join = DeviceMesh._concatenate

    def outside(meshes):
        with unset_fake_temporarily():
            return join(meshes)

    DeviceMesh._concatenate = staticmethod(outside)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(join)


@contextmanager
def fake_rank(plan: Plan, model: str | None = None):
    """`plan` applied to its model as rank 0 of its world, on fake tensors and torch's fake process group, on the
    CPU: yields (the model's name, the module, the optimizer, the context-parallel plan's ContextParallel or None:
    each micro-batch's forward and backward run on the rank's chunks inside its `shard`, as a run's do) inside the
    FakeTensorMode, not yet materialised (the caller decides what watches materialisation). On a CUDA profile the
    optimizer steps foreach, as CUDA runs it. `model` names the model of a plan made from a factory. The process
    group is destroyed on exit."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_available() and dist.is_initialized():
        raise UsageError("a process group is already initialised in this process; a fake rank needs its own "
                         "(call torch.distributed.destroy_process_group() first, or run it in a fresh process)")
    world = plan.cluster.world_size
    fake_mode = FakeTensorMode()
    with fake_mode:  # meta parameters made outside the mode would not be fake ones
        resolved = resolve_plan_model(plan, model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with fake_mode, _mesh_joins_outside(fake_mode):
            applied = apply(resolved.module, plan, mesh)
            module, optimizer = applied
            if load_profile(plan.cluster.profile).device_type == "cuda":  # the plan's optimizer as CUDA runs it
                for group in optimizer.param_groups:
                    if "foreach" in group:
                        group["foreach"] = True
            yield resolved.name, module, optimizer, applied.context
    finally:
        dist.destroy_process_group()


def track_plan(plan: Plan, hold_logits: bool = False, model: str | None = None, seed: int = 0) -> TrackerResult:
    """Run one warm-up step and one tracked step of `plan` as rank 0 of its world on fake tensors and a
    fake process group, under torch's FSDPMemTracker. `model` names the model of a plan made from a
    factory (as `autoplan apply --model`). The process group is destroyed on return."""
    world = plan.cluster.world_size
    if world < 2:
        raise UsageError(f"the plan is for a world of {world} rank; the tracker stands in for a world of several")
    check_fake_rank(plan)
    predicted = predicted_phase_peaks(plan)
    if predicted is None:
        raise UsageError("the plan's prediction has no timeline to compare with (estimate it again)")
    foreach = load_profile(plan.cluster.profile).device_type == "cuda"
    training = plan.training
    with fake_rank(plan, model) as (model_name, module, optimizer, context):
        materialise(module, "cpu", seed)
        vocab = vocab_size_of(module)
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        shape = (training.micro_batch_size, training.seq_len)
        ids, labels = torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)
        tracked, categories = _tracked_step(module, optimizer, (ids, labels), hold_logits, context)
    compute_bytes = Dtype(PRECISIONS[training.dtype].compute_dtype).bytes
    return TrackerResult(
        model=model_name, world_size=world, micro_batch_size=training.micro_batch_size, seq_len=training.seq_len,
        foreach=foreach, hold_logits=hold_logits, predicted_phase_bytes=predicted, tracked_phase_bytes=tracked,
        tracked_categories=categories, buffer_bytes=buffer_bytes,
        logits_bytes=training.micro_batch_size * training.seq_len * vocab * compute_bytes,
    )


def _tracked_step(module, optimizer, batch: tuple[torch.Tensor, torch.Tensor], hold_logits: bool,
                  context=None) -> tuple[dict[str, int], dict[str, int]]:
    """One untracked warm-up step (the optimizer's states are made), then one step under FSDPMemTracker: its
    peak within each phase, and its categories at the highest phase's peak. `context`: a context-parallel plan's
    (fake_rank's), each forward and backward on the rank's chunks inside its `shard`."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    ids, labels = batch
    tracker = FSDPMemTracker(module, optimizer)
    tracker.track_inputs((ids, labels))
    tracked: dict[str, int] = {}
    categories: dict[str, int] = {}

    def record(name: str) -> None:
        """The tracker's peak since it was entered, as the peak of phase `name` when higher than
        the phases before it in the same context (a backward below its forward's peak is not seen)."""
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
        if snapshot["Total"] > max(tracked.values(), default=0) or name == "forward":
            categories.clear()
            categories.update({str(getattr(k, "value", k)): v for k, v in snapshot.items()
                               if k != "Total" and v})
        tracked[name] = snapshot["Total"]

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with rank_chunks(context, ids, labels) as (rank_ids, rank_labels):  # warm-up: the optimizer's states are made
        next_token_loss(module(rank_ids), rank_labels).backward()
    step()
    tracker.reset_mod_stats()
    with tracker, rank_chunks(context, ids, labels) as (rank_ids, rank_labels):  # the tracker follows both
        output = module(rank_ids)
        loss = next_token_loss(output, rank_labels)
        if not hold_logits:
            del output
        record("forward")
        loss.backward()
        del loss
        record("backward")
        output = None
    tracker.reset_mod_stats()
    with tracker:  # entering resets the tracker's peak to what is alive now
        step()
        record("optimizer")
    return tracked, categories


def rank_chunks(context, ids: torch.Tensor, labels: torch.Tensor):
    """A micro-batch as the rank runs it: a context-parallel plan's chunks of it (ContextParallel.shard, ring
    attention on inside), else itself."""
    return context.shard(ids, labels) if context is not None else nullcontext((ids, labels))
