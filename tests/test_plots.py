"""Figures: the memory timeline stacked by category with the limit, and the throughput frontier."""

import pytest

import autoplan

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def traced():
    return autoplan.trace("gpt2-tiny", seq_len=64)


def test_memory_timeline_stacks_every_category_under_the_limit(traced):
    plan = autoplan.search(traced, "20MB", gpus=2, fit_to="allocated")
    figure = autoplan.plots.plot_memory_timeline(plan)
    ax = figure.axes[0]
    points = plan.predicted.timeline
    bars = [bar for container in ax.containers for bar in container]
    assert len(bars) == 6 * len(points)  # one bar per category per time point
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[2:] == ["parameters", "gradients", "optimizer states", "activations", "gathered parameters",
                          "temporaries"]
    assert labels[:2] == ["limit 20 MB", f"peak {plan.predicted.peak_mem_bytes / 1e6:.3g} MB"]
    # the stacked bars reach each point's total
    tops = [max(bar.get_y() + bar.get_height() for bar in bars[i::len(points)]) for i in range(len(points))]
    assert tops == pytest.approx([p.total_bytes / 1e6 for p in points])


def test_memory_timeline_of_an_estimate_uses_its_limit(traced):
    result = autoplan.estimate(traced, "replicate", gpus=2, batch_size=4, mem="1GB")
    figure = autoplan.plots.plot_memory_timeline(result)
    # a limit far above the peak is named, not drawn to scale (the bars would be a sliver)
    assert "limit 1 GB (off the scale)" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert figure.axes[0].get_ylim()[1] < 2 * result.predicted.peak_mem_bytes / 1e6


def _title(figure) -> str:
    return figure.axes[0].get_title()


def _peak_marker(figure):
    [marker] = [line for line in figure.axes[0].get_lines() if line.get_label().startswith("peak ")]
    return marker


def test_memory_timeline_names_the_run_and_marks_the_peak(traced, tmp_path):
    plan = autoplan.search(traced, "20MB", gpus=2, fit_to="allocated")
    figure = autoplan.plots.plot_memory_timeline(plan)
    title = _title(figure)
    assert "gpt2-tiny" in title and "on 2 GPUs" in title and f"micro-batch {plan.training.micro_batch_size}" in title
    assert f"at {plan.predicted.peak_point}" in title
    peak = autoplan.plan.estimate.peak_index(plan.predicted)
    assert list(_peak_marker(figure).get_xdata()) == [peak]
    assert list(_peak_marker(figure).get_ydata()) == pytest.approx([plan.predicted.peak_mem_bytes / 1e6])
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert {"forward", "backward"} <= set(texts)  # the phases are named over their spans
    figure.savefig(tmp_path / "tiny.png")


@pytest.mark.slow  # tracing 48 blocks
def test_memory_timeline_of_a_deep_model_fits_a_normal_figure():
    """48 blocks (152 time points): one figure at most 12 inches wide, the runs of like blocks labelled
    once each, with no two labels overlapping."""
    deep = autoplan.estimate("gpt2-tiny[n_layers=48]", "shard", checkpoint=True, gpus=4, batch_size=2, seq_len=32)
    points = deep.predicted.timeline
    assert len(points) > 150
    figure = autoplan.plots.plot_memory_timeline(deep)
    width, height = figure.get_size_inches()
    assert width <= 12 and height <= 6
    ax = figure.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "transformer.h.0-47 (shard +ckpt)" in labels and "transformer.h.47-0 (shard +ckpt)" in labels
    assert len(labels) < 12
    figure.canvas.draw()
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels()), key=lambda box: box.x0)
    assert all(left.x1 <= right.x0 for left, right in zip(boxes, boxes[1:]))
    assert "gpt2-tiny[n_layers=48] on 4 GPUs, micro-batch 2" in _title(figure)
    assert _peak_marker(figure).get_xdata()[0] == autoplan.plan.estimate.peak_index(deep.predicted)


def test_estimate_timeline_marks_the_peak_row(traced):
    from autoplan.plan.estimate import PEAK_MARK

    result = autoplan.estimate(traced, "shard", gpus=2, batch_size=4)
    lines = result.table(timeline=True).splitlines()
    rows = lines[lines.index(next(line for line in lines if line.startswith("time point"))) + 2:]
    assert len(rows) == len(result.predicted.timeline)
    marked = [row for row in rows if row.endswith(PEAK_MARK)]
    assert len(marked) == 1 and marked[0].startswith(result.predicted.peak_point)


def test_frontier_plot_draws_autoplan_and_each_baseline(traced, tmp_path):
    points = autoplan.frontier(traced, ["100KB", "10MB", "40MB"], gpus=2, fit_to="allocated")
    figure = autoplan.plots.plot_frontier(points)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert set(lines) == {"autoplan", "all-shard", "all-shard+sel", "all-shard+ckpt", "all-replicate"}
    ys = list(lines["autoplan"].get_ydata())
    assert ys[0] != ys[0]  # nothing fits in 100 KB: a gap (NaN)
    assert ys[1:] == pytest.approx([p.throughput_samples_s for p in points[1:]])
    figure.savefig(tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_figures_go_into_a_given_axes_and_leave_pyplot_alone(traced):
    from matplotlib.figure import Figure

    figure = Figure()
    axes = figure.subplots(1, 2)
    plan = autoplan.search(traced, "20MB", gpus=2, fit_to="allocated")
    assert autoplan.plots.plot_memory_timeline(plan, ax=axes[0]) is figure
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []
