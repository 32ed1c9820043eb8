"""`autoplan apply` before any rank starts: every check that can refuse the run, and what the user is told.

A rank takes seconds to start and a launcher's failure is noisy, so whatever can be checked in the
launching process is checked there, first: the report path is writable; the plan file reads; the plan
matches its model, built on the meta device (fingerprint, every unit's module, sharding kinds, precision,
optimizer, sequence length against the model's positions); the world size, the GPUs, the data file and
the memory limit. Then the user is told what will run: which model (named by what is built, and said so
when the plan names it otherwise), the steps (warm-up, timed and, on the CPU, untracked) and about how
long they take (an estimate from the plan's predicted step time), and warnings that do not stop the run:
a plan costed for another kind of device, a profile of another device of the same kind (another CPU,
another GPU: the estimate then says it may not hold; autoplan/machine.py), a bf16 plan on a CPU without
bf16 matrix units, or a predicted peak larger than this machine's memory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autoplan.errors import PlanFileError, UsageError
from autoplan.fileio import check_writable
from autoplan.machine import bf16_note, device_mismatch
from autoplan.models.resolve import check_seq_len
from autoplan.plan.schema import Plan, load_plan
from autoplan.profile_store import load_profile
from autoplan.run.apply import check_plan, check_world_size, model_label_note, resolve_plan_model
from autoplan.run.attention import check_attention
from autoplan.run.data import AlpacaTokens, BatchShape, vocab_size_of
from autoplan.run.launch import Nodes, run_allocator_conf
from autoplan.run.report import profile_note
from autoplan.run.resume import CheckpointFlags
from autoplan.run.worker import RunSpec
from autoplan.sizes import format_bytes, parse_mem_bytes

__all__ = ["PreparedRun", "RunOptions", "check_nodes", "check_report_path", "prepare_run", "run_outline"]

_ENDPOINT = re.compile(r"^\[?[A-Za-z0-9_.:%-]+?\]?:\d{1,5}$")


@dataclass
class PreparedRun:
    """A run checked and ready to launch on this node."""

    plan: Plan
    spec: RunSpec
    nproc: int  # ranks on this node
    nodes: Nodes
    model: str  # the model that runs, named by what is built
    warnings: list[str] = field(default_factory=list)  # said before the run; none stops it
    model_note: str | None = None  # the plan names its model otherwise than what runs
    device_note: str | None = None  # this machine is not the device the plan's profile describes
    said: list[str] = field(default_factory=list)  # what else the run does (checkpoints), said before it

    @property
    def world_size(self) -> int:
        return self.nproc * self.nodes.count


def check_report_path(path: str | os.PathLike, plan: str | os.PathLike | None = None,
                      data: str | os.PathLike | None = None) -> None:
    """UsageError unless a report can be written at `path` (see fileio.check_writable), and it is not the plan
    or the data file the run reads."""
    check_writable(path, "report", param="report", example="report.json",
                   inputs=(("the plan file", plan), ("the `data` file", data)))


def check_nodes(nodes: Nodes) -> None:
    if nodes.count < 1:
        raise UsageError(f"`nnodes` must be at least 1, got {nodes.count}")
    if nodes.count == 1:
        if nodes.rdzv_endpoint is not None or nodes.rank:
            raise UsageError("`rdzv_endpoint` and `node_rank` are for runs over several nodes: give `nnodes` too")
        return
    if not 0 <= nodes.rank < nodes.count:
        raise UsageError(f"`node_rank` {nodes.rank} is not a node of {nodes.count}: give 0 to {nodes.count - 1}")
    if nodes.rdzv_endpoint is None:
        raise UsageError(f"a run over {nodes.count} nodes needs `rdzv_endpoint` HOST:PORT, an address of node 0 "
                         "that every node reaches (the same on every node), e.g. node0.cluster:29500")
    if not _ENDPOINT.match(nodes.rdzv_endpoint):
        raise UsageError(f"`rdzv_endpoint` {nodes.rdzv_endpoint!r} is not HOST:PORT (e.g. node0.cluster:29500)")


@dataclass(frozen=True)
class RunOptions:
    """What `autoplan apply` is asked besides the plan file: its flags, as given (prepare_run checks them)."""

    model: str | None = None  # --model: the factory of a plan made from one (None: the plan's own config)
    nproc: int | None = None  # ranks on this node (None: the plan's world over the nodes)
    nodes: Nodes = field(default_factory=Nodes)
    steps: int = 5  # timed steps after the warm-up
    warmup: int = 2
    data: str | None = None  # an Alpaca JSON file (None: synthetic tokens)
    report: str | None = None  # where node 0 writes the report
    mem_limit: str | None = None  # a size, or "plan" for the plan's limit (None: no limit)
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 300.0  # longest a rank waits for its peers in a collective
    checkpoints: CheckpointFlags = field(default_factory=CheckpointFlags)


def prepare_run(plan_path: str, options: RunOptions | None = None) -> PreparedRun:
    """Everything checked before any rank starts; `options` are `autoplan apply`'s flags."""
    options = options or RunOptions()
    nodes = options.nodes
    check_nodes(nodes)
    if options.report is not None and nodes.rank == 0:  # node 0 writes the report
        check_report_path(options.report, plan_path, options.data)
    plan, resolved = _plan_and_model(plan_path, options.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_attention(plan, device)  # the plan's attention kernels run here
    nproc = _ranks_per_node(plan, nodes, options.nproc, device)
    world = nproc * nodes.count
    shape = BatchShape(plan.training.micro_batch_size, plan.training.grad_accum_steps, world, plan.training.seq_len)
    if options.data is not None:
        AlpacaTokens(options.data, vocab_size_of(resolved.module)).global_batch(0, shape)  # UsageError when unusable
    if plan.pipeline is not None and (options.checkpoints.save_dir or options.checkpoints.resume):
        raise UsageError("checkpoints (`--save`, `--resume`) of a pipelined plan's run are not built yet; run it "
                         "without them")
    said = options.checkpoints.check(plan, resolved.module)
    allocator_conf, allocator_warning = run_allocator_conf(plan.cluster.allocator_conf, device)
    spec = _run_spec(plan_path, plan, options, device, world < plan.cluster.world_size, allocator_conf)
    prepared = PreparedRun(plan, spec, nproc, nodes, resolved.name, model_note=model_label_note(plan, resolved),
                           said=said)
    _warn(prepared, device, allocator_warning, shape)
    return prepared


def _plan_and_model(plan_path: str, model: str | None):
    """The plan file, and its model built on the meta device, checked against each other."""
    plan = load_plan(plan_path)
    resolved = resolve_plan_model(plan, model, plan_path)
    check_plan(resolved.module, plan)
    try:
        check_seq_len(resolved, plan.training.seq_len)
    except UsageError as exc:
        raise PlanFileError(f"the plan cannot run on its model: {str(exc).replace('`seq_len`', 'seq_len')}; "
                            "make the plan again (`autoplan search --seq-len`)") from None
    return plan, resolved


def _ranks_per_node(plan: Plan, nodes: Nodes, nproc: int | None, device: str) -> int:
    """The ranks this node runs (the plan's world over the nodes unless given), checked against the plan's world
    and this node's GPUs."""
    planned = plan.cluster.world_size
    if nproc is None:
        if planned % nodes.count:
            raise UsageError(f"the plan's {planned} ranks do not split evenly over {nodes.count} nodes; "
                             "give the ranks per node with `nproc`")
        nproc = planned // nodes.count
    world = nproc * nodes.count
    if world > planned:
        ranks = f"`nproc` {nproc}" + (f" x {nodes.count} nodes is {world} ranks," if nodes.count > 1 else " is")
        raise UsageError(f"{ranks} more ranks than the plan's world of {planned}; re-run "
                         f"`autoplan search --gpus {world}` for that world")
    check_world_size(world, plan, dry_run=True)
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise UsageError(
            f"the plan needs {nproc} GPUs on this node and it has {torch.cuda.device_count()}; run it where there are "
            f"{nproc}, or as a dry run with `nproc` {torch.cuda.device_count()}"
        )
    return nproc


def _run_spec(plan_path: str, plan: Plan, options: RunOptions, device: str, dry_run: bool,
              allocator_conf: str | None) -> RunSpec:
    """What every rank runs: the flags with their paths made absolute and the memory limit in bytes."""
    mem_limit_bytes = None
    if options.mem_limit is not None:
        mem_limit_bytes = (plan.cluster.mem_limit_bytes if options.mem_limit == "plan"
                           else parse_mem_bytes(options.mem_limit))
    checkpoints, data = options.checkpoints, options.data
    return RunSpec(
        plan_path=str(Path(plan_path).resolve()), run_dir="", device=device, steps=options.steps,
        warmup_steps=options.warmup, dry_run=dry_run, seed=options.seed, lr=options.lr,
        data_path=data and str(Path(data).resolve()), model_factory=options.model, mem_limit_bytes=mem_limit_bytes,
        timeout_s=options.timeout,
        save_dir=checkpoints.save_dir and str(Path(checkpoints.save_dir).resolve()), save_every=checkpoints.save_every,
        resume=checkpoints.resume and str(Path(checkpoints.resume).resolve()), allocator_conf=allocator_conf,
    )


def _warn(prepared: PreparedRun, device: str, allocator_warning: str | None, shape: BatchShape) -> None:
    """What is said before the run without stopping it: another model name, another device, the allocator's
    configuration, a peak larger than this machine."""
    plan = prepared.plan
    if prepared.model_note:
        prepared.warnings.append(prepared.model_note)
    note = profile_note(plan, device)
    if note:
        prepared.warnings.append(f"{note}: the step-time comparison will be meaningless here. To compare time as "
                                 "well, plan with a profile of this machine (`autoplan profiles` lists them; "
                                 "`autoplan search ... --profile cpu-gloo-2` on a CPU)")
    else:
        prepared.device_note = _device_notes(plan, device, prepared.warnings)
    if allocator_warning:
        prepared.warnings.append(allocator_warning)
    memory = _memory_warning(plan, shape, prepared.nproc, device)
    if memory:
        prepared.warnings.append(memory)


def _device_notes(plan: Plan, device: str, warnings: list[str]) -> str | None:
    """For a plan costed for this kind of device: warn where this machine is another device than the profile's
    (returned: the time estimate says it may not hold), and where a bf16 plan would run emulated on this CPU."""
    profile = load_profile(plan.cluster.profile)  # profile_note found it
    mismatch = device_mismatch(profile)
    if mismatch:
        warnings.append(mismatch)
    bf16 = bf16_note(profile, plan.training.dtype) if device == "cpu" else None
    if bf16:
        warnings.append(f"{bf16} (`autoplan search ... --dtype fp32 --profile {profile.name}` makes one)")
    return mismatch


def _memory_warning(plan: Plan, shape: BatchShape, nproc: int, device: str) -> str | None:
    """Said when the plan's predicted peak (and its batch of token ids) will not fit this machine."""
    tokens = shape.global_batch_size * (shape.seq_len + 1) * 8  # every rank makes the whole batch of int64 ids
    per_rank = plan.predicted.peak_mem_bytes + tokens
    if device == "cuda":
        have, need, where = torch.cuda.get_device_properties(0).total_memory, per_rank, "each GPU has"
    else:
        have, need = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), per_rank * nproc
        where = f"its {nproc} rank(s) need about {format_bytes(need)} and this machine has"
    if need <= have:
        return None
    return (f"the plan predicts a peak of {format_bytes(plan.predicted.peak_mem_bytes)} per rank, plus "
            f"{format_bytes(tokens)} for each step's batch of token ids; {where} {format_bytes(have)}: "
            "the run will likely run out of memory")


def run_outline(prepared: PreparedRun) -> list[str]:
    """What will run and about how long it takes, said before the run starts."""
    spec, plan = prepared.spec, prepared.plan
    warmup = (f"{spec.warmup_steps} warm-up step(s) (trained, not timed: the first steps allocate memory and "
              "warm up), then " if spec.warmup_steps else "")
    if spec.device == "cuda":
        steps = (f"{warmup}{spec.steps} timed step(s) (the step time is their median; peak memory is taken over "
                 "every step)")
        total = spec.warmup_steps + spec.steps
    else:
        steps = (f"{warmup}{spec.steps} step(s) measured for memory (the live-tensor tracker watches every op, which "
                 f"slows them), then {spec.steps} untracked step(s) timed with the tracker off (the step time is "
                 "their median)")
        total = spec.warmup_steps + 2 * spec.steps
    lines = [f"runs {steps}: {total} steps in all", *prepared.said]
    if profile_note(plan, spec.device) is None:
        estimate = total * plan.predicted.step_time_s
        slower = "; steps measured for memory take longer on the CPU" if spec.device == "cpu" else ""
        lines.append(f"estimate: about {_duration(estimate)} of training ({total} steps x the plan's predicted "
                     f"{plan.predicted.step_time_s * 1e3:.1f} ms per step{slower}), after the ranks start"
                     + ("; it may not hold: this machine is not the device the plan's profile describes (see the "
                        "warning)" if prepared.device_note else ""))
    else:
        lines.append("no time estimate: the plan's predicted step time is for another kind of device")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "1 s or less"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"
