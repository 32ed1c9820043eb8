"""`--torchtitan CONFIG.toml` on `estimate` and `search`: a team's torchtitan job config as the settings, and
autoplan's plan printed beside it.

The config gives the model, the sequence, the batch, the precision, the optimizer and (for an estimate) the
layout; the cluster is autoplan's flags (`--gpus`, `--nodes`, `--gpus-per-node`, `--profile`), as torchrun
gives it to torchtitan. A flag that the config decides is refused with it, rather than silently preferred.
"""

from __future__ import annotations

import argparse
from collections import Counter

from autoplan.sizes import format_bytes

__all__ = ["add_torchtitan_flag", "beside", "job_header", "torchtitan_job"]

# what the config decides: given with --torchtitan these are refused (an estimate also takes the layout from it)
_FROM_CONFIG = ("model", "seq_len", "global_batch", "dtype", "optimizer")
_LAYOUT = ("batch_size", "strategy", "checkpoint", "offload", "tp", "sequence_parallel", "plan", "pins", "pin")


def add_torchtitan_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--torchtitan", metavar="CONFIG.toml", default=None,
                        help=f"a torchtitan job config (llama3): its model, sequence, batch, precision and optimizer"
                             f"{what}; the cluster is --gpus, --nodes, --gpus-per-node, --profile")


def torchtitan_job(args: argparse.Namespace, fields: dict, estimate: bool):
    """The job the config describes on the flags' cluster (autoplan.api.torchtitan.TorchtitanJob); a flag that
    the config decides is a usage error."""
    from autoplan.api.torchtitan import read_torchtitan
    from autoplan.errors import UsageError
    from autoplan.settings import mesh_of

    decided = [name for name in _FROM_CONFIG + (_LAYOUT if estimate else ()) if fields.get(name) not in (None, False)]
    if decided:
        raise UsageError(f"`torchtitan` {args.torchtitan} decides {', '.join(f'`{name}`' for name in decided)}; "
                         "leave them out (or leave out `torchtitan`)")
    return read_torchtitan(args.torchtitan, mesh_of(fields.get("gpus"), fields.get("nodes"),
                                                    fields.get("gpus_per_node")))


def job_header(job) -> list[str]:
    """What the config was read as, and what is approximated or ignored."""
    lines = [f"torchtitan config {job.path.name}: {job.flavor} (autoplan's {job.model}), {job.layout}; "
             f"micro-batch {job.local_batch_size}, {job.global_batch} samples per step; sequence length "
             f"{job.seq_len}; {job.dtype}, {job.optimizer}; checkpointing {_checkpointing(job)}"]
    return lines + [f"note: {note}" for note in job.notes]


def _checkpointing(job) -> str:
    blocks = [pin.split("=")[1] for pin in job.pin if pin.startswith("layers.")]
    if blocks:
        return "every few blocks: " + ", ".join(pin.split("=")[0] for pin in job.pin if "+ckpt" in pin)
    return f"{job.checkpoint} on the blocks"


def _decisions(units) -> str:
    """Units by decision: "shard_keep x1, shard+sel x32, shard x2"."""
    return ", ".join(f"{label} x{n}" for label, n in Counter(u.label.replace(" ", "") for u in units).items())


def beside(job, theirs, plan) -> str:
    """autoplan's plan beside the config's estimate: layout, batch, step time, throughput, peak memory."""
    t, p = theirs.predicted, plan.predicted
    c = plan.cluster
    speedup = p.throughput_samples_s / t.throughput_samples_s if t.throughput_samples_s else float("inf")
    limit = theirs.cluster.mem_limit_bytes
    over = t.peak_mem_bytes - limit
    fits = "fits" if over <= 0 else f"over {format_bytes(limit)} by {format_bytes(over)}"
    rows = [
        ("layout", job.layout.split(" (")[0], (f"FSDP over {c.world_size // (c.tp_degree * c.cp_degree)} ranks"
                                               + (f" x context parallel {c.cp_degree}" if c.cp_degree > 1 else "")
                                               + (f" x tensor parallel {c.tp_degree}" if c.tp_degree > 1 else "")
                                               + (" (sequence parallel)" if c.sequence_parallel else ""))),
        ("units", _decisions(theirs.units), _decisions(plan.units)),
        ("micro-batch", f"{theirs.training.micro_batch_size} x {theirs.training.grad_accum_steps} accumulation",
         f"{plan.training.micro_batch_size} x {plan.training.grad_accum_steps} accumulation"),
        ("step time", f"{t.step_time_s * 1e3:,.1f} ms", f"{p.step_time_s * 1e3:,.1f} ms"),
        ("throughput", f"{t.throughput_tokens_s:,.0f} tokens/s", f"{p.throughput_tokens_s:,.0f} tokens/s "
                                                                  f"({speedup:.2f}x)"),
        ("peak memory per GPU", f"{format_bytes(t.peak_mem_bytes)} ({fits})",
         f"{format_bytes(p.peak_mem_bytes)} (limit {format_bytes(c.mem_limit_bytes)})"),
    ]
    width = max(28, *(len(mine) for _, mine, _ in rows))
    lines = [f"beside the torchtitan config {job.path.name} ({plan.training.global_batch_size} samples per step "
             f"both):", f"  {'':<20} {'torchtitan config':<{width}}  autoplan"]
    lines += [f"  {name:<20} {mine:<{width}}  {ours}" for name, mine, ours in rows]
    return "\n".join(lines)
