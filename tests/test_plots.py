"""Figures: the memory timeline stacked by category with the limit, and the throughput frontier."""

import pytest

import autoplan

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def traced():
    return autoplan.trace("gpt2-tiny", seq_len=64)


def test_memory_timeline_stacks_every_category_under_the_limit(traced):
    plan = autoplan.search(traced, "20MB", gpus=2)
    figure = autoplan.plots.plot_memory_timeline(plan)
    ax = figure.axes[0]
    points = plan.predicted.timeline
    assert len(ax.patches) == 6 * len(points)  # one bar per category per time point
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[1:] == ["parameters", "gradients", "optimizer states", "activations", "gathered parameters",
                          "temporaries"]
    assert labels[0] == "limit 20 MB"
    # the stacked bars reach each point's total
    tops = [max(bar.get_y() + bar.get_height() for bar in ax.patches[i::len(points)]) for i in range(len(points))]
    assert tops == pytest.approx([p.total_bytes / 1e6 for p in points])


def test_memory_timeline_of_an_estimate_uses_its_limit(traced):
    result = autoplan.estimate(traced, "replicate", gpus=2, batch_size=4, mem="1GB")
    figure = autoplan.plots.plot_memory_timeline(result)
    assert "limit 1 GB" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]


def test_frontier_plot_draws_autoplan_and_each_baseline(traced, tmp_path):
    points = autoplan.frontier(traced, ["1MB", "10MB", "40MB"], gpus=2)
    figure = autoplan.plots.plot_frontier(points)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert set(lines) == {"autoplan", "all-shard", "all-shard+ckpt", "all-replicate"}
    ys = list(lines["autoplan"].get_ydata())
    assert ys[0] != ys[0]  # nothing fits in 1 MB: a gap (NaN)
    assert ys[1:] == pytest.approx([p.throughput_samples_s for p in points[1:]])
    figure.savefig(tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_figures_go_into_a_given_axes_and_leave_pyplot_alone(traced):
    from matplotlib.figure import Figure

    figure = Figure()
    axes = figure.subplots(1, 2)
    plan = autoplan.search(traced, "20MB", gpus=2)
    assert autoplan.plots.plot_memory_timeline(plan, ax=axes[0]) is figure
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []
