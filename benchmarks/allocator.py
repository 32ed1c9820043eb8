"""Allocated vs reserved on CUDA for real plans, without a GPU: a step's allocations replayed through a model
of torch's caching allocator (cost_models/allocator.py).

How: one rank (rank 0 of 8) of each plan runs on fake tensors and torch's fake process group, as
autoplan/run/torch_tracker.py does, with `autoplan apply`'s step (the loss by worker.next_token_loss, the
optimizer as CUDA runs it: foreach). A live-tensor tracker (autoplan.run.memtrack) records every storage's
allocation and free, in order, with its size, from materialisation through a warm-up step and two more steps.
Each allocation is given the CUDA stream FSDP2 makes it on (its all-gather copy-in stream for the all-gather
buffers, its reduce-scatter stream for the reduction outputs and their fp32 casts, the default stream for
everything else): the caching allocator never lends a block cached for one stream to another.
The sequence is replayed through the allocator model: the reserved peak with no limit (what
torch.cuda.max_memory_reserved reports on a device with room to spare), and the smallest limit the step runs
in without an out-of-memory error (the allocator frees its cached segments under pressure): what a plan's
limit has to hold.

    python benchmarks/allocator.py            # the grid (about 2 minutes; run it under the heavy lock)
    python benchmarks/allocator.py --quick    # two small configurations

Not seen here (fake tensors run no kernel): cuBLAS/cuDNN workspaces and kernel scratch the allocator serves
(cuBLAS: a few MiB per handle and stream), and memory outside the allocator (CUDA context, NCCL's buffers).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from common import write_results

import autoplan
from autoplan.profile_store import load_profile
from autoplan.run.apply import apply, materialise, resolve_plan_model
from autoplan.run.data import vocab_size_of
from autoplan.run.memtrack import LiveTensorTracker
from autoplan.run.worker import next_token_loss
from cost_models.allocator import min_limit, replay, reserved_bound

PROFILE = "h100-sxm-80gb"
WORLD = 8
DEFAULT, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2  # streams
# (model, checkpoint, micro-batch, sequence, memory limit for the solver; None: all-shard uniformly). A solver's
# plan with a node-sharded (2-D mesh) unit does not run on fake tensors yet: the mesh reads a rank map's values.
GRID = [
    ("llama2-7b", "full", 1, 4096, None),
    ("llama2-7b", "full", 2, 4096, None),
    ("llama2-7b", "full", 4, 4096, None),
    ("llama2-7b", "none", 1, 4096, None),
    ("llama2-7b", "selective", 2, 4096, None),
    ("llama3-8b", "full", 1, 8192, None),
    ("llama3-8b", "full", 2, 8192, None),
    ("llama3-8b", "none", 1, 4096, None),
]
QUICK = [("llama2-7b[n_layers=4]", "full", 2, 1024, None), ("llama2-7b[n_layers=4]", "none", 1, 1024, None)]


def _stream() -> int:
    """The stream FSDP2 would allocate on now, from the calling frames (fsdp/_fully_shard/_fsdp_collectives)."""
    frame = sys._getframe(3)
    while frame is not None:
        name = frame.f_code.co_name
        if name == "foreach_all_gather":
            return ALL_GATHER
        if name == "foreach_reduce":  # the reduction input is made on the default stream, the rest on its own
            return REDUCE_SCATTER if "reduce_scatter_input" in frame.f_locals else DEFAULT
        frame = frame.f_back
    return DEFAULT


class AllocationRecorder(LiveTensorTracker):
    """The live-tensor tracker, writing each storage's allocations and frees as replay events."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self._event_key: dict[int, tuple[int, int]] = {}
        self._generation = 0

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


def record_plan(plan, steps: int = 3) -> tuple[list[tuple], list[int]]:
    """The allocation events of materialisation and `steps` training steps of rank 0 of `plan`'s world,
    and the event index at the start of each step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    fake_mode = FakeTensorMode()
    with fake_mode:
        resolved = resolve_plan_model(plan)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.cluster.world_size)
    recorder = AllocationRecorder()
    starts = []
    try:
        mesh = init_device_mesh("cpu", (plan.cluster.world_size,))
        with fake_mode:
            module, optimizer = apply(resolved.module, plan, mesh)
            for group in optimizer.param_groups:  # the optimizer as it runs on CUDA
                if "foreach" in group:
                    group["foreach"] = True
            with recorder:
                materialise(module, "cpu", 0)
                shape = (plan.training.micro_batch_size, plan.training.seq_len)
                vocab = vocab_size_of(module)
                ids, labels = torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)
                for _ in range(steps):
                    starts.append(len(recorder.events))
                    for _ in range(plan.training.grad_accum_steps):
                        loss = next_token_loss(module(ids), labels)
                        starts.append(-len(recorder.events))  # (negative: a phase, not a step) the backward
                        loss.backward()
                        del loss
                    starts.append(-len(recorder.events))  # the optimizer step
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            events = list(recorder.events)  # not the frees of tearing the model down
    finally:
        dist.destroy_process_group()
    return events, starts


def plan_for(model: str, checkpoint: str | None, batch: int | None, seq_len: int, limit: str | None):
    if limit is not None:
        return autoplan.search(model, limit, gpus=WORLD, profile=PROFILE, seq_len=seq_len)
    return autoplan.search(model, "1000GB", gpus=WORLD, profile=PROFILE, seq_len=seq_len, batch_size=batch,
                           strategy="shard", checkpoint=checkpoint, allow_over_device_mem=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small configurations")
    args = parser.parse_args()
    assert load_profile(PROFILE).device_type == "cuda"
    gib = 2 ** 30
    print(f"{'plan':<34} {'mb':>2} {'seq':>5} {'predicted':>9} {'live':>7} {'alloc':>7} {'reserved':>8} "
          f"{'needed':>7} {'res/alloc':>9} {'need/alloc':>10} {'bound':>7}  (GiB)")
    rows = []
    for model, checkpoint, batch, seq_len, limit in QUICK if args.quick else GRID:
        started = time.perf_counter()
        plan = plan_for(model, checkpoint, batch, seq_len, limit)
        events, starts = record_plan(plan)
        free_run = replay(events)
        needed = min_limit(events)
        predicted = plan.predicted.peak_mem_bytes
        label = f"{model} " + (f"shard+{checkpoint}" if limit is None else f"solver@{limit}")
        mb = plan.training.micro_batch_size
        print(f"{label:<34} {mb:>2} {seq_len:>5} {predicted / gib:>9.2f} {free_run.peak_requested / gib:>7.2f} "
              f"{free_run.peak_allocated / gib:>7.2f} {free_run.peak_reserved / gib:>8.2f} {needed / gib:>7.2f} "
              f"{free_run.peak_reserved / free_run.peak_allocated:>9.4f} {needed / free_run.peak_allocated:>10.4f} "
              f"{reserved_bound(predicted) / gib:>7.2f}  ({time.perf_counter() - started:.0f} s, "
              f"{len(events)} events, {free_run.segments} segments)", flush=True)
        rows.append({"model": model, "plan": label, "micro_batch": mb, "seq_len": seq_len,
                     "predicted_peak_bytes": predicted, "live_peak_bytes": free_run.peak_requested,
                     "allocated_peak_bytes": free_run.peak_allocated, "reserved_peak_bytes": free_run.peak_reserved,
                     "needed_limit_bytes": needed, "bound_bytes": reserved_bound(predicted),
                     "events": len(events), "segments": free_run.segments})
    worst = max(rows, key=lambda r: r["needed_limit_bytes"] / r["predicted_peak_bytes"])
    print(f"\nworst needed/predicted: {worst['needed_limit_bytes'] / worst['predicted_peak_bytes']:.4f} ({worst['plan']}, "
          f"mb {worst['micro_batch']}); bound/needed at least "
          f"{min(r['bound_bytes'] / r['needed_limit_bytes'] for r in rows):.4f}")
    path = write_results("allocator" + ("_quick" if args.quick else ""), {"rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
