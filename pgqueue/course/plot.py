"""Figures for the course: per-worker timelines of claims, leases and fences, and
throughput curves, drawn with matplotlib from an ``EventLog`` (or its DataFrame).

A timeline has one lane per worker and time in seconds on the x axis, like the
paused-client diagram in Kleppmann's "How to do distributed locking": you see who held
which job with which fence, when a worker froze, when the reaper took a job back, and
which late writes the database refused.

This module is the notebooks' door: the timeline itself is laid out and drawn step by step
in ``timeline.py``, its bars in ``timeline_bars.py``, its storage lanes in
``timeline_storage.py``, from the event kinds, marks and legend in ``plot_parts.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..events import EventLog
from .plot_parts import _lane_order, as_frame
from .timeline import timeline

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["as_frame", "claims_per_worker", "fencing", "throughput", "timeline"]


def fencing(
    events: EventLog | pd.DataFrame,
    storage: Mapping[str, pd.DataFrame],
    *,
    title: str = "Fencing: the database refuses the writes of an old fence",
    lanes: Sequence[str] | None = None,
    leases: pd.DataFrame | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Kleppmann's fencing figure for one job: the workers' lanes on top, and below them
    the rows the database stores (``storage``, see ``timeline``), with the fence each one
    held over time and an arrow for every claim and write between them. A late write
    reaching a row whose fence moved on is marked where it lands: ``1 ≠ 2: refused`` on the
    job's row (its writes carry its current fence), ``1 < 2: refused`` on a side row."""
    return timeline(events, storage=storage, lanes=lanes, leases=leases, title=title, ax=ax)


def claims_per_worker(
    events: EventLog | pd.DataFrame,
    *,
    title: str = "Jobs claimed per worker",
    ax: Axes | None = None,
) -> Figure:
    """Bar chart of how many claims each worker lane made (a fair share looks flat)."""
    import matplotlib.pyplot as plt

    frame = as_frame(events)
    counts = frame[frame["kind"] == "claim"].groupby("worker").size()
    counts = counts.reindex(sorted(counts.index, key=_lane_order))
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3))
    else:
        fig = ax.figure
    ax.bar(counts.index, counts.values, color="tab:blue", label="claims")
    ax.set_xlabel("worker")
    ax.set_ylabel("jobs claimed (count)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def throughput(
    runs: Mapping[str, EventLog | pd.DataFrame],
    *,
    kinds: Iterable[str] = ("complete",),
    title: str = "Jobs finished over time",
    ax: Axes | None = None,
) -> Figure:
    """Cumulative count of ``kinds`` events over time, one line per labelled run."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
    else:
        fig = ax.figure
    wanted = list(kinds)
    for label, events in runs.items():
        frame = as_frame(events)
        times = frame.loc[frame["kind"].isin(wanted), "s"].sort_values()
        ax.step([0.0, *times], range(len(times) + 1), where="post", label=label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("jobs finished (count)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
