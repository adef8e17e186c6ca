"""Notebook 07's throughput figure: the spread of repeated runs, on linear axes, with the
model drawn apart from what was measured."""

from __future__ import annotations

import matplotlib
import pandas as pd

from pgqueue.course import polling_lab

matplotlib.use("Agg")


def test_burst_spread_gives_min_median_max_seconds_per_interval_and_series() -> None:
    bursts = pd.DataFrame(
        {
            "poll_interval_s": [0.1, 0.1, 0.1, 1.0, 1.0, 1.0] * 2,
            "listen": [False] * 6 + [True] * 6,
            "all_done_s": [0.2, 0.3, 0.4, 0.3, 0.7, 1.1] + [0.2] * 6,
        }
    )
    backlog = pd.DataFrame({0: [100.0, 50.0], 1: [200.0, 100.0]}, index=[0.1, 1.0])  # jobs/s
    spread = polling_lab.burst_spread(bursts, backlog, burst=20)
    assert list(spread.index) == [0.1, 1.0]
    assert spread.loc[1.0, ("bursts, polling only", "median")] == 0.7
    assert spread.loc[1.0, ("bursts, polling only", "max")] == 1.1
    assert spread.loc[0.1, ("backlog", "min")] == 0.1  # 20 jobs at 200 jobs/s
    assert spread.loc[0.1, ("backlog", "max")] == 0.2


def test_plot_burst_times_is_linear_with_error_bars_and_says_measured_and_model() -> None:
    import matplotlib.pyplot as plt

    index = pd.Index([0.1, 0.5, 1.0])
    part = pd.DataFrame({"min": [0.2] * 3, "median": [0.25, 0.45, 0.7], "max": [0.3, 0.7, 1.2]})
    part.index = index
    spread = pd.concat(
        {"bursts, polling only": part, "bursts, polling + LISTEN": part, "backlog": part}, axis=1
    )
    fig = polling_lab.plot_burst_times(spread, burst=20, unwaited_s=0.2, runs=5)
    try:
        [ax] = fig.axes
        assert ax.get_xscale() == ax.get_yscale() == "linear"
        assert ax.get_title() and "(s)" in ax.get_xlabel() and "seconds" in ax.get_ylabel()
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert sum(label.startswith("measured") for label in labels) == 3
        assert sum(label.startswith("model") for label in labels) == 2
        assert len(ax.containers) == 3  # an error bar per measured series
    finally:
        plt.close(fig)
