"""Figures for notebooks and reports. matplotlib is an optional extra: pip install 'autoplan[plot]'.

Each function returns a matplotlib Figure (built without pyplot, so nothing global is left open):
a notebook shows it as the cell's result (with `%matplotlib inline`), a script saves it with
`fig.savefig("memory.png")`. Pass `ax` to draw into an axes of your own figure instead.
"""

from __future__ import annotations

from typing import Sequence

from autoplan.api.frontier import FrontierPoint
from autoplan.errors import UsageError
from autoplan.plan.schema import Prediction

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


def plot_memory_timeline(result, *, limit_bytes: int | None = None, ax=None, title: str | None = None):
    """The per-rank memory at each time point of a training step, stacked by category, with the limit.

    `result`: a Plan or an Estimate (their `cluster.mem_limit_bytes` is the line drawn unless
    `limit_bytes` is given), or a bare Prediction.
    """
    prediction: Prediction = result if isinstance(result, Prediction) else result.predicted
    if limit_bytes is None and hasattr(result, "cluster"):
        limit_bytes = result.cluster.mem_limit_bytes
    points = prediction.timeline
    figure, ax = _axes(ax, (max(6.0, 0.28 * len(points) + 3), 4.2))

    peak = max(range(len(points)), key=lambda i: points[i].total_bytes)
    top_bytes = max(points[peak].total_bytes, limit_bytes or 0)
    scale, unit = _unit(top_bytes)
    positions = list(range(len(points)))
    bottoms = [0.0] * len(points)
    for field, (label, colour) in CATEGORY_STYLE.items():
        heights = [getattr(p.breakdown, field) / scale for p in points]
        ax.bar(positions, heights, bottom=bottoms, width=0.85, color=colour, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if limit_bytes is not None:
        ax.axhline(limit_bytes / scale, color="black", linestyle="--", linewidth=1.2,
                   label=f"limit {limit_bytes / scale:.3g} {unit}")
    ax.annotate(f"peak {points[peak].total_bytes / scale:.3g} {unit}", (peak, points[peak].total_bytes / scale),
                xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
    # phase boundaries: forward points, then backward points, then the optimizer step
    for i in range(1, len(points)):
        if points[i].point.split(" ")[0] != points[i - 1].point.split(" ")[0]:
            ax.axvline(i - 0.5, color="grey", linewidth=0.6)

    step = max(1, len(points) // 40)  # at most ~40 tick labels
    ax.set_xticks(positions[::step], [p.point for p in points][::step], rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(points) - 0.4)
    ax.set_ylim(0, 1.12 * top_bytes / scale)  # room for the labels
    ax.set_ylabel(f"memory per GPU ({unit})")
    ax.set_title(title or f"memory timeline of one training step (peak at {prediction.peak_point})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


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
