"""Figures for notebooks and reports. matplotlib is an optional extra: pip install 'autoplan[plot]'.

Each function returns a matplotlib Figure (built without pyplot, so nothing global is left open):
a notebook shows it as the cell's result (with `%matplotlib inline`), a script saves it with
`fig.savefig("memory.png")`. Pass `ax` to draw into an axes of your own figure instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from autoplan.api.frontier import FrontierPoint
from autoplan.errors import UsageError
from autoplan.plan.estimate import peak_index
from autoplan.plan.schema import Prediction
from cost_models.memory import PHASE_OF_POINT

# category field of MemoryBreakdown -> (legend label, colour); stacked bottom to top in this order
CATEGORY_STYLE = {
    "params_bytes": ("parameters", "#4c72b0"),
    "grads_bytes": ("gradients", "#dd8452"),
    "optimizer_bytes": ("optimizer states", "#55a868"),
    "activations_bytes": ("activations", "#c44e52"),
    "gathered_bytes": ("gathered parameters", "#8172b3"),
    "temporaries_bytes": ("temporaries", "#937860"),
}
BASELINE_STYLE = {"all-shard": ("#4c72b0", "--"), "all-shard+ckpt": ("#55a868", "-."),
                  "all-replicate": ("#dd8452", ":")}


def _unit(max_bytes: float) -> tuple[float, str]:
    """GB, or MB for small models, so that axis labels stay readable."""
    return (1e9, "GB") if max_bytes >= 1e9 else (1e6, "MB")


def _axes(ax, figsize: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UsageError("plots need matplotlib: pip install 'autoplan[plot]'") from exc
    if ax is not None:
        return ax.figure, ax
    figure = Figure(figsize=figsize, layout="constrained")
    return figure, figure.subplots()


PHASE_SHADE = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
MAX_FIGURE_WIDTH_IN = 12.0  # however deep the model: runs of like blocks share a label, not an inch each
LABEL_CHAR_IN, LABEL_GAP_IN = 0.055, 0.12  # a tick label's width per character (7 pt) and the gap between two
LABEL_ROTATED_IN = 0.14  # the room a rotated label takes along the axis
LIMIT_ON_SCALE_UP_TO = 3.0  # a limit up to this many times the peak is drawn on the axis
ROTATED_UP_TO = 40  # time points: up to this many, every group's label, rotated; beyond, horizontal ones
PEAK_COLOUR = "#d62728"


@dataclass
class _Group:
    """Consecutive time points of one phase that belong to one unit (its backward and its gradient
    reduction), or to a run of like units: paths that differ only in a trailing index
    (transformer.h.0 ... transformer.h.10) and the same decision."""

    phase: str
    module: str  # the unit's path as the timeline names it ("<root>", "loss", "transformer.h.3")
    prefix: str  # the path without its trailing index ("transformer.h.")
    decision: str
    first: int  # the group's first and last time point
    last: int
    start: int | None = None  # trailing index of the run's first and last unit; None: not an indexed unit
    end: int | None = None

    @property
    def labels(self) -> list[str]:
        """Its label, then shorter ones for less room: the path's last part only, then no decision."""
        if self.start is None:
            return [self.module]
        run = str(self.start) if self.start == self.end else f"{self.start}-{self.end}"
        short = self.prefix.rstrip(".").rsplit(".", 1)[-1] + "." + run if "." in self.prefix.rstrip(".") else None
        decision = f" ({self.decision})" if self.decision else ""
        candidates = [f"{self.prefix}{run}{decision}"] + ([f"{short}{decision}", short] if short else [])
        return list(dict.fromkeys(candidates + [f"{self.prefix}{run}"]))


def _groups(points, decisions: dict[str, str]) -> list[_Group]:
    groups: list[_Group] = []
    for position, point in enumerate(points):
        kind, _, module = point.point.partition(" ")
        phase, module = PHASE_OF_POINT.get(kind, kind), module or kind
        match = re.fullmatch(r"(.*?)(\d+)", module)
        prefix, index = (match.group(1), int(match.group(2))) if match else (module, None)
        decision = decisions.get(module, "")
        last = groups[-1] if groups else None
        if last is not None and (last.phase, last.prefix, last.decision) == (phase, prefix, decision) and (
                (index is None and last.start is None and last.module == module)
                or (index is not None and last.end is not None and abs(index - last.end) <= 1)):
            last.last, last.end = position, index if index is not None else last.end
            continue
        groups.append(_Group(phase, module, prefix, decision, position, position, index, index))
    return groups


def _tick_labels(groups: list[_Group], axes_width_in: float, n_points: int,
                 rotated: bool) -> list[tuple[float, str]]:
    """(position, text) of the groups that get a label: the widest group first, each with the longest of
    its labels that keeps clear of those already placed, so that no two overlap however many points there
    are. Rotated labels take LABEL_ROTATED_IN each along the axis, horizontal ones their text's width."""
    inches_per_point = axes_width_in / max(n_points, 1)
    placed: list[tuple[float, float, float, str]] = []  # (left, right) in inches, position, text
    for group in sorted(groups, key=lambda g: (g.first - g.last, g.first)):
        position = (group.first + group.last) / 2
        for text in group.labels[:1] if rotated else group.labels:
            half = (LABEL_ROTATED_IN if rotated else len(text) * LABEL_CHAR_IN + LABEL_GAP_IN) / 2
            left, right = position * inches_per_point - half, position * inches_per_point + half
            if all(right <= other_left or left >= other_right for other_left, other_right, _, _ in placed):
                placed.append((left, right, position, text))
                break
    return sorted((position, text) for _, _, position, text in placed)


def _title(result, prediction: Prediction, peak_text: str, limit_text: str) -> str:
    line = "memory per GPU over one training step"
    if hasattr(result, "model") and hasattr(result, "training"):
        c, t = result.cluster, result.training
        accumulation = f" x {t.grad_accum_steps} accumulation" if t.grad_accum_steps > 1 else ""
        line = (f"{result.model.name} on {c.world_size} GPU{'s' if c.world_size > 1 else ''}, "
                f"micro-batch {t.micro_batch_size}{accumulation}, sequence {t.seq_len}")
    return f"{line}\nmemory per GPU: peak {peak_text} at {prediction.peak_point}{limit_text}"


def plot_memory_timeline(result, *, limit_bytes: int | None = None, ax=None, title: str | None = None):
    """The per-rank memory at each time point of a training step, stacked by category, with the limit
    and the peak marked. Points are grouped by phase (forward, backward, optimizer step, shaded) and runs
    of like blocks share one label, so a model of any depth fits a figure at most 12 inches wide.

    `result`: a Plan or an Estimate (their `cluster.mem_limit_bytes` is the line drawn unless
    `limit_bytes` is given; the title names the model, world size and micro-batch), or a bare Prediction.
    """
    prediction: Prediction = result if isinstance(result, Prediction) else result.predicted
    if limit_bytes is None and hasattr(result, "cluster"):
        limit_bytes = result.cluster.mem_limit_bytes
    points = prediction.timeline
    n = len(points)
    decisions = {(unit.module or "<root>"): unit.label
                 for unit in getattr(result, "units", [])}
    figure, ax = _axes(ax, (min(MAX_FIGURE_WIDTH_IN, max(6.4, 0.22 * n + 3.2)), 4.8))

    peak = peak_index(prediction)
    # a limit far above the peak (a device's memory, say) would squash the bars: it stays off the scale
    limit_on_scale = limit_bytes is not None and limit_bytes <= LIMIT_ON_SCALE_UP_TO * points[peak].total_bytes
    top_bytes = max(points[peak].total_bytes, limit_bytes if limit_on_scale else 0)
    scale, unit = _unit(top_bytes)
    positions = list(range(n))
    bottoms = [0.0] * n
    for field, (label, colour) in CATEGORY_STYLE.items():
        heights = [getattr(p.breakdown, field) / scale for p in points]
        ax.bar(positions, heights, bottom=bottoms, width=0.85 if n <= 60 else 1.0, color=colour, label=label,
               linewidth=0)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    limit_text = ""
    if limit_bytes is not None:
        limit_scale, limit_unit = _unit(limit_bytes)
        limit_text = f" (limit {limit_bytes / limit_scale:.3g} {limit_unit})"
        ax.axhline(limit_bytes / scale, color="black", linestyle="--", linewidth=1.2,
                   label=f"limit {limit_bytes / limit_scale:.3g} {limit_unit}" + ("" if limit_on_scale else
                                                                                 " (off the scale)"))
    peak_value = points[peak].total_bytes / scale
    peak_text = f"{peak_value:.3g} {unit}"
    ax.plot([peak], [peak_value], marker="v", markersize=8, color=PEAK_COLOUR, linestyle="none",
            label=f"peak {peak_text}", zorder=5)
    # the label beside the marker, on the side with room (a peak at the step's end is common)
    side = "right" if peak > 0.85 * n else "left" if peak < 0.15 * n else "center"
    ax.annotate(f"peak {peak_text}", (peak, peak_value), xytext=({"right": -4, "left": 4}.get(side, 0), 9),
                textcoords="offset points", ha=side,
                fontsize=8, color=PEAK_COLOUR, fontweight="bold", zorder=6,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})

    groups = _groups(points, decisions)
    _shade_phases(ax, groups, n)
    _label_groups(ax, figure, groups, n)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, 1.15 * top_bytes / scale)  # room for the peak's label
    ax.set_ylabel(f"memory per GPU ({unit})")
    ax.set_title(title or _title(result, prediction, peak_text, limit_text), fontsize=10, pad=14)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


def _shade_phases(ax, groups, n: int) -> None:
    """Each phase's span shaded, divided by a line and named above the axes."""
    phase_runs: list[list] = []  # [phase, first, last] of each phase's span
    for group in groups:
        if phase_runs and phase_runs[-1][0] == group.phase:
            phase_runs[-1][2] = group.last
        else:
            phase_runs.append([group.phase, group.first, group.last])
    for phase, first, last in phase_runs:
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_SHADE.get(phase, "grey"), alpha=0.07, linewidth=0)
        if first:
            ax.axvline(first - 0.5, color="grey", linewidth=0.8)
        ax.text((first + last) / 2, 1.0, phase if last - first >= 0.08 * n else phase[:3] + ".",
                transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8, color="dimgrey")


def _label_groups(ax, figure, groups, n: int) -> None:
    """One tick label per run of like points, and the run's extent as a bracket under the axis."""
    axes_width_in = ax.get_position().width * figure.get_size_inches()[0]
    rotated = n <= ROTATED_UP_TO
    ticks = _tick_labels(groups, max(axes_width_in, 1.0), n, rotated)
    ax.set_xticks([position for position, _ in ticks], [text for _, text in ticks], fontsize=7,
                  rotation=90 if rotated else 0)
    ax.tick_params(axis="x", length=0, pad=8)
    for group in groups:
        if group.last > group.first:
            ax.plot([group.first - 0.3, group.last + 0.3], [-0.02, -0.02], color="dimgrey", linewidth=1.5,
                    transform=ax.get_xaxis_transform(), clip_on=False, solid_capstyle="butt")


def plot_frontier(points: Sequence[FrontierPoint], *, ax=None, title: str | None = None):
    """Throughput against the memory limit: autoplan's plans and the uniform baselines (from `frontier`)."""
    if not points:
        raise UsageError("plot_frontier needs at least one point: run autoplan.frontier over some limits")
    figure, ax = _axes(ax, (6.4, 4.2))
    scale, unit = _unit(max(p.mem_limit_bytes for p in points))
    limits = [p.mem_limit_bytes / scale for p in points]
    nan = float("nan")
    for name in points[0].baselines:
        colour, style = BASELINE_STYLE.get(name, ("grey", "--"))
        values = [p.baselines.get(name) for p in points]
        ax.plot(limits, [nan if v is None else v for v in values], linestyle=style, marker=".", color=colour,
                label=name)
    values = [p.throughput_samples_s for p in points]
    ax.plot(limits, [nan if v is None else v for v in values], color="#c44e52", marker="o", linewidth=2,
            label="autoplan")
    ax.set_xscale("log")
    ax.set_xticks(limits, [f"{v:g}" for v in limits])
    ax.minorticks_off()
    ax.set_xlabel(f"memory limit per GPU ({unit})")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "throughput under a memory limit (gaps: does not fit)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return figure


__all__ = ["plot_frontier", "plot_memory_timeline"]
