"""Claims that compete (lesson 02): the plumbing and the figures.

Who claimed which job; two sessions stepping through a two-statement claim; the runs of
lesson 02's claim races (its ``drain``, written in the notebook: events ``claim``,
``claim-begin``, ``lock-wait``, ``complete`` and ``complete-rejected``) summed up and drawn;
and the throughput against how long a claim holds its locks, beside two simple models. The
statements themselves stay in the lesson (or in ``counterfactuals.sql``) and are passed in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..db import connect
from ..events import EventLog
from ..queue import Queue
from . import plot

LABELS = {"no-skip-locked": "FOR UPDATE (waits)", "skip-locked": "FOR UPDATE SKIP LOCKED"}


def claims(events: EventLog) -> pd.DataFrame:
    """The claim events of a run, one row each (``worker``, ``job_id``, ``fence``, ...)."""
    frame = events.to_frame()
    return frame[frame["kind"] == "claim"]


def draw_who_claimed(events: EventLog, title: str, ax: Axes | None = None) -> Figure:
    """One row per worker, a tick at each job id it claimed; a job that more than one
    worker claimed gets a red line across the rows."""
    mine_all = claims(events)
    lanes = sorted(mine_all["worker"].unique())
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(lanes)))
    shared = mine_all.groupby("job_id")["worker"].nunique()
    for job_id in shared[shared > 1].index:
        ax.axvline(job_id, color="red", lw=1, alpha=0.6)
    for i, lane in enumerate(lanes):
        mine = mine_all[mine_all["worker"] == lane]
        ax.plot(mine["job_id"], [i] * len(mine), "|", ms=16, mew=2, color=f"C{i}")
    ax.plot([], [], "|", ms=10, mew=2, color="0.3", label="one claim")
    if (shared > 1).any():
        ax.plot([], [], "-", color="red", label="a job several workers claimed")
    counts = mine_all["worker"].value_counts()
    ax.set_yticks(range(len(lanes)), [f"{lane} ({counts[lane]} claims)" for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("job id")
    ax.set_ylabel("worker")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax.figure


class TwoSessions(NamedTuple):
    """Sessions A and B stepping through a two-statement claim of one ready job."""

    steps: pd.DataFrame  # session, statement, result: in the order they ran
    a_ids: list[int]  # what each SELECT read
    b_ids: list[int]
    a_rows: list[Any]  # what each UPDATE returned
    b_rows: list[Any]
    job: Any  # the row afterwards, a JobState (tidied up to done once read)


def two_sessions(
    dsn: str, select: str, mark: str, b_update: tuple[str, str], queue: str = "two-step"
) -> TwoSessions:
    """Enqueue one job; A and B each ``BEGIN`` and run ``select`` (ids of ready jobs);
    then A runs ``mark`` (an ``UPDATE`` by ``%(ids)s``) and commits, and B runs
    ``b_update`` = (its name, its statement) and commits. Every step is recorded."""
    steps: list[dict[str, str]] = []

    def step(who: str, conn: Any, what: str, query: str, params: Any = None) -> list[Any]:
        cur = conn.execute(query, params)
        rows = cur.fetchall() if cur.description else []
        if what == "SELECT":
            result = f"reads ids {[r[0] for r in rows]}"
        elif what.startswith("UPDATE"):
            result = f"{len(rows)} row(s): " + ", ".join(f"job {r[0]} fence {r[3]}" for r in rows)
        else:
            result = ""
        steps.append({"session": who, "statement": what, "result": result})
        return rows

    params = {"queue": queue, "limit": 1}
    with Queue(dsn) as q:
        job_id = q.enqueue({"n": 0}, queue=queue)
        with connect(dsn) as a, connect(dsn) as b:
            step("A", a, "BEGIN", "BEGIN")
            step("B", b, "BEGIN", "BEGIN")
            a_ids = [r[0] for r in step("A", a, "SELECT", select, params)]
            b_ids = [r[0] for r in step("B", b, "SELECT", select, params)]
            a_rows = step("A", a, "UPDATE (mark_running)", mark, {"ids": a_ids, "lease": 30})
            step("A", a, "COMMIT", "COMMIT")
            b_rows = step("B", b, b_update[0], b_update[1], {"ids": b_ids, "lease": 30})
            step("B", b, "COMMIT", "COMMIT")
        job = q.get(job_id)
        q.conn.execute("UPDATE jobs SET status = 'done' WHERE id = %s", [job_id])  # tidy up
    return TwoSessions(pd.DataFrame(steps), a_ids, b_ids, a_rows, b_rows, job)


def summary(runs: dict[str, EventLog]) -> pd.DataFrame:
    """One row per run: jobs done, jobs claimed twice, seconds (first event to last
    completion: connecting is not draining), jobs per second, seconds waited for locks, and
    the median time from a job's claim to its accepted completion (its work, and any wait
    of the completing ``UPDATE`` for a row lock)."""
    rows = {}
    for style, log in runs.items():
        frame = log.to_frame()
        done = frame[frame["kind"] == "complete"]
        waits = frame.loc[frame["kind"] == "lock-wait", "detail"].astype(float)
        seconds = done["s"].max() - frame["s"].min()
        claimed = frame[frame["kind"] == "claim"]
        twice = claimed.job_id.value_counts() > 1
        last_claim = claimed.groupby("job_id")["s"].max()  # the claim whose complete counted
        held = (done.set_index("job_id")["s"] - last_claim).dropna()
        rows[style] = {
            "jobs done": len(done),
            "jobs claimed twice": int(twice.sum()),
            "seconds": seconds,
            "jobs per second": len(done) / seconds,
            "seconds spent waiting for locks": waits.sum(),
            "median claim to complete (s)": held.median(),
        }
    return pd.DataFrame(rows).T


def draw_styles(runs: dict[str, EventLog]) -> Figure:
    """The two runs' timelines, one above the other, on one time scale."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    titles = {
        "no-skip-locked": "FOR UPDATE without SKIP LOCKED: claims wait in line",
        "skip-locked": "FOR UPDATE SKIP LOCKED: claims pass each other",
    }
    for ax, style in zip(axes, ("no-skip-locked", "skip-locked"), strict=True):
        plot.timeline(runs[style], ax=ax, annotate=False, title=titles[style])
    longest = max(log.to_frame()["s"].max() for log in runs.values())
    axes[1].set_xlim(0, longest * 1.05)
    return fig


def draw_throughput(runs: dict[str, EventLog], title: str) -> Figure:
    """Jobs finished over time, one line per claim style."""
    return plot.throughput({LABELS[k]: v for k, v in runs.items()}, title=title)


def draw_rates(rates: pd.DataFrame, overhead: float, workers: int, work: float) -> Figure:
    """Measured jobs per second against the hold, for both styles, beside two models:
    ``workers / (hold + work + overhead)`` side by side, and at most ``1 / hold`` in line."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    holds = pd.Series(np.linspace(0, max(rates.index), 201))
    side_by_side = workers / (holds + work + overhead)
    ax.plot(
        1000 * holds,
        side_by_side,
        ":",
        color="C0",
        label=f"model: {workers} side by side, {workers}/(hold + work + o)",
    )
    in_line = pd.concat([side_by_side, 1 / holds], axis=1).min(axis=1)  # 1/0 is inf
    ax.plot(1000 * holds, in_line, ":", color="C3", label="model: one at a time, at most 1/hold")
    for style, color, marker in (("skip-locked", "C0", "o"), ("no-skip-locked", "C3", "s")):
        ax.plot(
            1000 * rates.index,
            rates[style],
            marker,
            color=color,
            ms=8,
            label=f"measured: {LABELS[style]}",
        )
    ax.set_xlabel("claim transaction held open (ms)")
    ax.set_ylabel("throughput (jobs/s)")
    ax.set_title(f"{workers} workers, {1000 * work:g} ms of work per job: the cost of waiting")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
