"""One rank of `autoplan apply`: build the plan's model, apply the plan, train, measure.

Started by torch.distributed.run (see launch.py) as `python -m autoplan.run.worker run_spec.json`.
Each rank writes its measurements to `rank<N>.json` in the run directory after every step, so the
launcher's process can report what was measured even when a rank dies part-way through. On a run over
several nodes the ranks of the other nodes also put their results in the rendezvous store (hosted on
node 0) after every step, and rank 0 writes them into its run directory: node 0 reports on every rank.

A rank records what it is doing (`RankResult.doing`), so that memory the allocator refuses is reported
as what could not be allocated, and where, instead of a traceback. SIGINT and SIGTERM end a rank at once.
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the line that makes SIGINT end a rank while it imports torch
import signal

if __name__ == "__main__":  # a rank (python -m autoplan.run.worker): see procs.rank_signals
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import contextlib
import dataclasses
import functools
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.fileio import write_text_atomic
from autoplan.models.inputs import ModelInputs
from autoplan.plan.schema import load_plan
from autoplan.run.apply import apply, materialise, model_for_plan
from autoplan.run.attention import planned_attention
from autoplan.run.data import AlpacaTokens, BatchShape, SyntheticTokens, rank_micro_batches, vocab_size_of
from autoplan.run.fsdp import watch_host_state
from autoplan.run.host_memory import keep_freed_memory
from autoplan.run.memtrack import RankMemory, allocation_failure
from autoplan.run.named_inputs import NamedInputs, micro_batch_loss, next_token_loss
from autoplan.run.node_relay import FirstNodeRelay
from autoplan.run.phase_clock import PhaseClock
from autoplan.run.pipeline import PipelinedModel, train_pipeline_step
from autoplan.run.procs import die_with_parent, rank_signals
from autoplan.run.resume import Checkpoints
from autoplan.run.tp import training_context

__all__ = ["RankResult", "RunSpec", "TrainingRun", "main", "next_token_loss", "train", "train_measured",
           "train_untracked"]


@dataclass
class RunSpec:
    """What every rank runs; written by the launching process, read by each rank."""

    plan_path: str
    run_dir: str  # where ranks write rank<N>.json
    device: str  # "cuda" (nccl) or "cpu" (gloo)
    steps: int  # timed steps, after the warm-up
    warmup_steps: int
    dry_run: bool  # fewer ranks than the plan's world
    seed: int = 0
    lr: float = 1e-3
    data_path: str | None = None  # Alpaca JSON; None = synthetic tokens
    model_factory: str | None = None
    mem_limit_bytes: int | None = None
    timeout_s: float = 300.0
    save_dir: str | None = None  # --save: checkpoints in step-<N> folders under it
    save_every: int | None = None  # --save-every: steps between checkpoints (None: at the end only)
    resume: str | None = None  # --resume: a checkpoint (or a --save folder) to start from
    allocator_conf: str | None = None  # CUDA: the PYTORCH_CUDA_ALLOC_CONF the ranks run with (None: torch's default)

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunSpec":
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class RankResult:
    rank: int
    status: str = "running"  # running | ok | oom | failed
    phase: str = "starting"  # starting (build, apply, materialise) | training | done
    doing: str = "starting"  # what the rank is doing now, e.g. "running the backward of micro-batch 2 of 4"
    pid: int = 0
    error: str | None = None
    steps_done: int = 0
    losses: list[float] = field(default_factory=list)  # per step: this rank's mean loss
    first_step: int = 0  # steps taken before this run (resumed from a checkpoint)
    step_times_s: list[float] = field(default_factory=list)  # per step, warm-up included
    # CPU: steps after those above, timed with the live-tensor tracker off (see train)
    untracked_step_times_s: list[float] = field(default_factory=list)
    peak_mem_bytes_by_step: list[int] = field(default_factory=list)
    # per step, the peak within each phase: forward (loss included), backward, optimizer step
    phase_peak_bytes_by_step: list[dict[str, int]] = field(default_factory=list)
    # per step timed with no memory tracker on (on the CPU the untracked ones), the seconds in each phase
    phase_times_s_by_step: list[dict[str, float]] = field(default_factory=list)
    peak_mem_bytes: int = 0  # since the start, materialisation included
    peak_rss_bytes: int = 0
    mem_source: str = ""  # what peak_mem_bytes counts
    # offloaded units' parameters, gradients and optimizer states (on the host), at the latest optimizer step
    host_state_bytes: int = 0
    pipeline_rank: int | None = None  # a pipelined plan: the stage group this rank is in

    @staticmethod
    def path(run_dir: str | os.PathLike, rank: int) -> Path:
        return Path(run_dir) / f"rank{rank}.json"

    def save(self, run_dir: str | os.PathLike) -> None:
        write_text_atomic(self.path(run_dir, self.rank), json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, run_dir: str | os.PathLike, rank: int) -> "RankResult | None":
        try:
            return cls(**json.loads(cls.path(run_dir, rank).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train(spec: RunSpec, rank: int, world_size: int, result: RankResult, sender: FirstNodeRelay | None = None) -> None:
    """Build, apply, materialise and train; `result` is updated (and saved) as the run goes."""
    sender = sender or FirstNodeRelay.from_environment(rank, world_size)
    plan = load_plan(spec.plan_path)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        keep_freed_memory()  # freed memory stays mapped, as CUDA's caching allocator keeps it (host_memory.py)
    mesh = plan.cluster.mesh  # a context- or tensor-parallel group shares its rows, and so do a pipeline's stages
    stage_ranks, per_row = world_size // mesh.pp, mesh.tp * mesh.cp  # a stage's ranks (fewer on a dry run)
    data_rank_, data_world = rank % stage_ranks // per_row, stage_ranks // per_row
    result.pipeline_rank = rank // stage_ranks if mesh.pp > 1 else None
    shape = BatchShape(plan.training.micro_batch_size, plan.training.grad_accum_steps, data_world,
                       plan.training.seq_len)
    memory = RankMemory(device, spec.mem_limit_bytes)
    result.mem_source = memory.source
    with memory, training_context(plan), contextlib.ExitStack() as running:
        result.doing = "building and sharding the model"
        model = model_for_plan(plan, spec.model_factory, plan_file=spec.plan_path)
        running.enter_context(planned_attention(plan, model, device.type))  # the kernels the plan priced
        data = (
            AlpacaTokens(spec.data_path, vocab_size_of(model)) if spec.data_path
            else NamedInputs(ModelInputs.parse(plan.model.inputs), model, seed=spec.seed) if plan.model.inputs
            else SyntheticTokens(vocab_size_of(model), seed=spec.seed)
        )
        model, optimizer = applied = apply(model, plan, lr=spec.lr, dry_run=spec.dry_run)
        result.doing = "materialising the model (to_empty, init_weights)"
        materialise(model, device, spec.seed)
        untracked = spec.steps if memory.tracker is not None else 0
        checkpoints = Checkpoints(spec.save_dir, spec.save_every, spec.warmup_steps + spec.steps + untracked - 1,
                                  data_label=spec.data_path or f"synthetic tokens, seed {spec.seed}")
        result.doing = f"loading the checkpoint {spec.resume}"
        data = checkpoints.resume(spec.resume, model, optimizer, data, shape)
        result.first_step = checkpoints.first
        result.peak_mem_bytes = memory.peak_and_reset()
        result.phase = "training"
        result.save(spec.run_dir)

        def step_done(step: int, label: str, step_s: float, step_loss: float) -> None:
            result.doing = "saving a checkpoint"
            saved = checkpoints.after_step(step, model, optimizer, plan, shape)
            if saved is not None:
                memory.peak_and_reset()  # what saving held is no step's
            result.save(spec.run_dir)
            sender.send(result)
            if rank == 0:
                print(f"[autoplan apply] {label}, rank 0: loss {step_loss:.4f} on its micro-batches, {step_s:.3f} s"
                      + (f"; checkpoint {saved}" if saved else ""), flush=True)

        run = TrainingRun(model, optimizer, data, data_rank_, shape, memory, result, spec.warmup_steps, spec.steps,
                          step_done, applied.context)
        train_measured(run)
    with training_context(plan), planned_attention(plan, model, device.type):
        train_untracked(run)


@dataclass(frozen=True)
class TrainingRun:
    """What a rank trains, and where its measurements go: the same for its measured steps and its untracked
    ones (train_measured, train_untracked), on the ranks of `autoplan apply` and in its fake world."""

    model: torch.nn.Module  # applied and materialised
    optimizer: torch.optim.Optimizer
    data: object  # SyntheticTokens or AlpacaTokens: `global_batch(step, shape)`
    rank: int  # the data-parallel rank whose micro-batches this rank takes
    shape: BatchShape
    memory: RankMemory
    result: RankResult  # filled in as the steps go
    warmup_steps: int
    steps: int
    step_done: Callable[[int, str, float, float], None] | None = None  # (step, label, seconds, loss)
    context: object = None  # a context-parallel plan's ContextParallel (autoplan.run.context)


def train_measured(run: TrainingRun) -> None:
    """Train warmup_steps + steps steps, with `run.memory` entered: per step the time, the loss and the peak
    within each phase go into `run.result`; then `step_done(step, label, seconds, loss)` is called.
    Shared by the ranks of `autoplan apply` and its fake world (autoplan.run.fake_world)."""
    memory, result = run.memory, run.result
    watch_host_state(run.model, run.optimizer, lambda nbytes: setattr(result, "host_state_bytes", nbytes))
    clock = PhaseClock(memory.device)
    for step in range(run.warmup_steps + run.steps):
        micro_batches = _batches(run, step)
        phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}

        def phase_done(phase: str) -> None:
            clock.done(phase)
            phase_peaks[phase] = max(phase_peaks[phase], memory.peak_and_reset())

        clock.start()
        step_s, step_loss = _train_step(run.model, run.optimizer, micro_batches, memory.device, phase_done, result,
                                        run.context)
        if memory.tracker is None:  # the tracker's Python on every op would be in the phases' times
            result.phase_times_s_by_step.append(clock.seconds())
        result.step_times_s.append(step_s)
        result.losses.append(step_loss)
        result.phase_peak_bytes_by_step.append(phase_peaks)
        result.peak_mem_bytes_by_step.append(max(phase_peaks.values()))
        result.peak_mem_bytes = max(result.peak_mem_bytes, *phase_peaks.values())
        result.peak_rss_bytes = _peak_rss_bytes()
        result.steps_done = step + 1
        if run.step_done is not None:
            phase = "warm-up" if step < run.warmup_steps else "timed" if memory.tracker is None else "memory"
            run.step_done(step, f"step {step + 1}/{run.warmup_steps + run.steps} ({phase})", step_s, step_loss)


def train_untracked(run: TrainingRun) -> None:
    """CPU, after `run.memory` was left: the live-tensor tracker runs Python on every op, which on a small model
    more than doubles the step, so the step time is measured again over `steps` steps with the tracker off
    (into `result.untracked_step_times_s`, and by phase into `phase_times_s_by_step`). Nothing to do when the
    memory was CUDA's allocator's."""
    if run.memory.tracker is None:
        return
    total, clock = run.warmup_steps + run.steps, PhaseClock(run.memory.device)
    for step in range(total, total + run.steps):
        micro_batches = _batches(run, step)
        clock.start()
        step_s, step_loss = _train_step(run.model, run.optimizer, micro_batches, run.memory.device, clock.done,
                                        run.result, run.context)
        run.result.untracked_step_times_s.append(step_s)
        run.result.phase_times_s_by_step.append(clock.seconds())
        if run.step_done is not None:
            run.step_done(step, f"untracked step {step + 1 - total}/{run.steps} (timed, memory tracker off)", step_s,
                          step_loss)


def _batches(run: TrainingRun, step: int):
    shape = run.shape
    run.result.doing = (f"making step {step + 1}'s batch of token ids ({shape.global_batch_size:,} sequences x "
                        f"{shape.seq_len + 1} ids; every rank makes the whole global batch)")
    # Copies of this rank's rows, so that the global batch is freed at once: a rank of a large world would
    # otherwise hold every rank's tokens through the step (64 ranks x micro-batch 8 x 65 ids: 266 KB), which
    # no training job holds and no prediction counts.
    return [(ids if isinstance(ids, dict) else ids.clone(), labels.clone())
            for ids, labels in rank_micro_batches(run.data.global_batch(step, shape), run.rank, shape)]


def _train_step(model, optimizer, micro_batches, device: torch.device, phase_done=None,
                result: RankResult | None = None, context=None) -> tuple[float, float]:
    """One optimizer step over this rank's micro-batches: (seconds, mean loss on this rank).
    `phase_done(phase)` is called as forward (loss included), backward and the optimizer step end;
    `result.doing` says which is under way. `context`: a context-parallel plan's, each micro-batch's
    forward and backward on this rank's chunks of its sequences inside `context.shard`."""
    result = result or RankResult(rank=-1)
    if isinstance(model, PipelinedModel):  # the schedule runs the micro-batches' forwards and backwards
        return train_pipeline_step(model, optimizer, micro_batches, device, phase_done, result)
    start_s = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    for index, (inputs, labels) in enumerate(micro_batches, start=1):
        with context.shard(inputs.to(device), labels.to(device)) if context else \
                contextlib.nullcontext((inputs, labels)) as (inputs, labels):
            result.doing = f"running the forward of micro-batch {index} of {len(micro_batches)}"
            loss = micro_batch_loss(model, inputs, labels, device) / len(micro_batches)
            if phase_done:
                phase_done("forward")
            result.doing = f"running the backward of micro-batch {index} of {len(micro_batches)}"
            loss.backward()
            if phase_done:
                phase_done("backward")
        loss_sum += loss.detach()
    result.doing = "running the optimizer step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # FSDP2 works on several streams: wait for all of them
    if phase_done:
        phase_done("optimizer")
    step_loss = loss_sum.item()
    return time.perf_counter() - start_s, step_loss


def main(argv: list[str] | None = None) -> None:
    rank_signals()
    die_with_parent()  # a rank never outlives its launcher
    argv = sys.argv[1:] if argv is None else argv
    spec = RunSpec.load(argv[0])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = RankResult(rank=rank, pid=os.getpid())
    result.save(spec.run_dir)
    sender = None
    exit_code = 1
    try:
        backend = "nccl" if spec.device == "cuda" else "gloo"
        if spec.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # The timeout bounds how long a rank waits in a collective for a peer that is gone.
        result.doing = "joining the process group"
        dist.init_process_group(backend, timeout=timedelta(seconds=spec.timeout_s))
        sender = FirstNodeRelay.from_environment(rank, world_size)
        train(spec, rank, world_size, result, sender)
        result.status, result.phase, result.doing = "ok", "done", "done"
        exit_code = 0
    except BaseException as exc:  # noqa: BLE001 - any failure is reported, then the rank exits
        refused = allocation_failure(exc)
        if refused is not None:  # out of memory: what could not be allocated, and where; no traceback
            result.status, result.error = "oom", f"{refused}, while {result.doing}"
        else:
            result.status, result.error = "failed", f"{type(exc).__name__}: {exc}".strip()
            traceback.print_exc()
    result.peak_rss_bytes = _peak_rss_bytes()
    result.save(spec.run_dir)  # results are on disk before any teardown
    if sender is not None:
        try:
            sender.send(result)
        except Exception:  # noqa: BLE001 - node 0 is gone: nothing to report to
            pass

    # Teardown. destroy_process_group() has been seen to abort gloo runs after training finished
    # (a rank closes its sockets while a peer's gloo threads still use them). So: wait until every
    # rank is done with its collectives and has written its result, then leave the process without
    # tearing down the process group; the OS closes the sockets. On failure there is no barrier:
    # the launcher stops the other ranks.
    if exit_code == 0:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer failing here is reported by the launcher
            exit_code = 1
    if sender is not None:
        sender.collect(functools.partial(RankResult.path, spec.run_dir))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main()
