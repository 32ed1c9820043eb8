"""The record `autoplan.estimate` returns, and its readable table.

An estimate is a plan's predictions for one fixed strategy (or a plan file's decisions) with nothing
searched: the per-rank peak by category, the memory timeline and the step time.
"""

from __future__ import annotations

from autoplan.plan.pipeline_report import pipeline_lines
from autoplan.plan.pipeline_spec import PipelineSpec
from autoplan.plan.report import (mfu_text, pricing_lines, reserved_is_device, sequence_text, throughput_text,
                                  unmodelled_text)
from autoplan.plan.schema import ClusterSpec, ModelRef, Prediction, TrainingSpec, UnitDecision, _Strict
from autoplan.sizes import format_bytes
from cost_models.memory import MemCategory

__all__ = ["Estimate", "format_estimate", "peak_index", "CATEGORY_LABELS", "PEAK_MARK"]

_LABELS = {
    MemCategory.PARAMS: "parameters", MemCategory.GRADS: "gradients", MemCategory.OPTIMIZER: "optimizer states",
    MemCategory.ACTIVATIONS: "activations", MemCategory.GATHERED: "gathered parameters",
    MemCategory.TEMPORARIES: "temporaries",
}
PEAK_MARK = "<- peak"  # ends the timeline row of the peak
# a plan's MemoryBreakdown field ("params_bytes", ...) -> its label, in the categories' order
CATEGORY_LABELS = {f"{category.value}_bytes": _LABELS[category] for category in MemCategory}


class Estimate(_Strict):
    """Predictions for one fixed strategy; `predicted` has the peak, its breakdown, the timeline, step time."""

    model: ModelRef
    strategy: str  # "shard", "replicate+ckpt", ... or "plan <file>"
    description: str
    cluster: ClusterSpec  # mem_limit_bytes: the limit compared with (the device's memory unless given)
    training: TrainingSpec
    units: list[UnitDecision]
    predicted: Prediction
    pipeline: PipelineSpec | None = None  # a pipelined mesh's stages (`pp` above 1)

    @property
    def fits(self) -> bool:
        """Whether the step runs in the limit: what the CUDA caching allocator needs where the profile is a
        GPU's, the live peak elsewhere."""
        return self.needed_bytes <= self.cluster.mem_limit_bytes

    @property
    def needed_bytes(self) -> int:
        p = self.predicted
        return p.needed_bytes if p.needed_bytes is not None else p.peak_mem_bytes

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer states per rank (what ZeRO estimators count)."""
        step = self.predicted.timeline[-1].breakdown
        return step.params_bytes + step.grads_bytes + step.optimizer_bytes

    def table(self, timeline: bool = False) -> str:
        return format_estimate(self, timeline=timeline)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython / Jupyter display
        printer.text(self.table())


def format_estimate(est: Estimate, timeline: bool = False) -> str:
    c, t, p = est.cluster, est.training, est.predicted
    limit_name = "device memory" if c.mem_limit_bytes == c.device_mem_bytes else "limit"
    verdict = "fits" if est.fits else f"does not fit (over by {format_bytes(est.needed_bytes - c.mem_limit_bytes)})"
    lines = [
        f"autoplan estimate: {est.model.name} ({est.model.n_params:,} parameters, traced by {est.model.tracer})",
        f"strategy {est.strategy}: {est.description}",
        f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s), profile {c.profile}; micro-batch {t.micro_batch_size} x "
        f"{t.grad_accum_steps} accumulation x "
        + (f"{c.world_size // c.pp_degree} data-parallel ranks x {c.pp_degree} pipeline stages" if c.pp_degree > 1
           else f"{c.world_size} GPUs" if c.tp_degree == c.cp_degree == 1 else
           f"{c.world_size // (c.tp_degree * c.cp_degree)} data-parallel ranks (tensor-parallel degree {c.tp_degree}"
           + (", sequence parallel" if c.sequence_parallel else "")
           + (f", context-parallel degree {c.cp_degree}" if c.cp_degree > 1 else "") + ")")
        + f" = {t.global_batch_size} samples per step; {sequence_text(est.model, t.seq_len)}; "
        f"{t.dtype}, {t.optimizer}",
        *pricing_lines(est.model),
        "",
        f"per-GPU memory at the peak ({p.peak_point}):",
    ]
    breakdown = p.breakdown.model_dump()
    lines += [f"  {CATEGORY_LABELS[key]:<20} {format_bytes(breakdown[key]):>12}" for key in CATEGORY_LABELS]
    lines += [
        f"  {'total (allocated)':<20} {format_bytes(p.peak_mem_bytes):>12}"
        + (f"  of {format_bytes(c.mem_limit_bytes)} {limit_name}: {verdict}" if p.needed_bytes is None else ""),
    ]
    if p.needed_bytes is not None:
        lines += [
            f"  {'needed':<20} {format_bytes(p.needed_bytes):>12}  of {format_bytes(c.mem_limit_bytes)} {limit_name}: "
            f"{verdict} (what torch's CUDA caching allocator needs to run the step, with {c.allocator_conf})",
            f"  {'reserved':<20} {format_bytes(p.reserved_bytes):>12}  at most (torch.cuda.max_memory_reserved with "
            "memory to spare" + ("; the device's memory: the allocator frees its cache before it would pass it)"
                                 if reserved_is_device(est) else ")"),
        ]
        if caveat := unmodelled_text(c.allocator_conf):
            lines.append(f"  {caveat}")
    lines += [
        f"valley (held after the step: parameters, gradients, optimizer states) {format_bytes(est.model_state_bytes)} "
        "per GPU",
    ]
    if p.host_mem_bytes:
        lines.append(f"host memory (offloaded state, pinned) {format_bytes(p.host_mem_bytes)} per GPU, "
                     f"{format_bytes(p.host_mem_per_node_bytes)} per node"
                     + (f" of {format_bytes(c.host_mem_bytes)}" if c.host_mem_bytes else ""))
    lines += [
        f"step time {p.step_time_s * 1e3:.1f} ms; "
        + throughput_text(est.model, p.throughput_samples_s, p.throughput_tokens_s) + mfu_text(p),
    ]
    lines += pipeline_lines(est)
    if timeline:
        header = f"{'time point':<36} {'total':>11}" + "".join(f" {k.removesuffix('_bytes'):>11}" for k in CATEGORY_LABELS)
        lines += ["", header, "-" * len(header)]
        peak = peak_index(p)
        for index, point in enumerate(p.timeline):
            parts = point.breakdown.model_dump()
            lines.append(f"{point.point[:36]:<36} {format_bytes(point.total_bytes):>11}"
                         + "".join(f" {format_bytes(parts[k]):>11}" for k in CATEGORY_LABELS)
                         + (f"  {PEAK_MARK}" if index == peak else ""))
    return "\n".join(lines)


def peak_index(prediction: Prediction) -> int:
    """The timeline row of the peak: the first point of the peak's name at the peak's total (a unit's name
    can appear twice: the root before and after the blocks), else the largest total."""
    timeline = prediction.timeline
    for index, point in enumerate(timeline):
        if point.point == prediction.peak_point and point.total_bytes == prediction.peak_mem_bytes:
            return index
    return max(range(len(timeline)), key=lambda i: timeline[i].total_bytes)

