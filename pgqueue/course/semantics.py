"""Notebook 12's experiments: priorities under a constant stream of urgent work (starvation,
and aging as its cure). Teaching aids, not the queue."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..queue import Queue
from ..worker import Worker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Aging, the course's way: every tick, ready jobs that waited longer than a bound are raised
# to the top priority. They keep their run_at, so among the top priority they go first.
AGING = """
UPDATE jobs SET priority = %(top)s
WHERE queue = %(queue)s AND status = 'ready' AND priority < %(top)s
  AND run_at < now() - make_interval(secs => %(after)s)
"""


def produce(dsn: str, queue: str, seconds: float, per_s: float, priority: int = 10) -> None:
    """Enqueue jobs of ``priority`` (payload class ``high``) into ``queue`` at ``per_s`` a
    second for ``seconds``, catching up after a slow moment (run it in a thread)."""
    with Queue(dsn) as producer:
        began = time.monotonic()
        sent = 0
        while (elapsed := time.monotonic() - began) < seconds:
            due = int(elapsed * per_s) - sent
            if due > 0:
                producer.enqueue_many([{"class": "high"}] * due, queue=queue, priority=priority)
                sent += due
            time.sleep(0.01)


def waits(dsn: str, queue: str, timeout: float = 60.0) -> pd.DataFrame:
    """Once every job of ``queue`` is done: one row per job, its class (the payload's),
    when it was enqueued and started (seconds since the first enqueue, database time) and
    how long it waited; ``attrs["stream_end"]``: when the last ``high`` job came."""
    with Queue(dsn) as q:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            (left,) = q.conn.execute(
                "SELECT count(*) FROM jobs WHERE queue = %s AND status <> 'done'", [queue]
            ).fetchone() or (0,)
            if not left:
                break
            time.sleep(0.05)
        rows: list[Any] = q.conn.execute(
            "SELECT payload->>'class', run_at, started_at FROM jobs WHERE queue = %s", [queue]
        ).fetchall()
    frame = pd.DataFrame(rows, columns=["class", "enqueued_at", "started_at"])
    t0 = frame["enqueued_at"].min()
    frame["enqueued"] = (frame["enqueued_at"] - t0).dt.total_seconds()
    frame["started"] = (frame["started_at"] - t0).dt.total_seconds()
    frame["waited"] = frame["started"] - frame["enqueued"]
    frame = frame.drop(columns=["enqueued_at", "started_at"]).sort_values("started")
    frame.attrs["stream_end"] = float(frame.loc[frame["class"] == "high", "enqueued"].max())
    return frame.reset_index(drop=True)


def starvation(
    dsn: str,
    *,
    queue: str = "starve",
    seconds: float = 1.5,
    arrivals_per_s: float = 50.0,
    work: float = 0.025,
    prefill: int = 15,
    low_jobs: int = 5,
    high: int = 10,
    aging_after: float | None = None,
) -> pd.DataFrame:
    """Notebook 12's starvation experiment (written out in its first cell) as one call, for
    its aging run and its controls: one lane runs jobs of ``work`` seconds while ``produce``
    sends priority-``high`` jobs faster than that; ``low_jobs`` of priority 0 wait from the
    start. With ``aging_after``, ready jobs older than that are raised to ``high`` every
    50 ms. The ``waits`` frame, with ``attrs["aging_after"]``."""
    with Queue(dsn) as q:
        q.conn.execute("DELETE FROM jobs WHERE queue = %s", [queue])
        q.enqueue_many([{"class": "high"}] * prefill, queue=queue, priority=high)
        q.enqueue_many([{"class": "low"}] * low_jobs, queue=queue, priority=0)
    worker = Worker(
        lambda job: time.sleep(work), queue=queue, dsn=dsn, poll_interval=0.05, listen=False
    )
    stop = threading.Event()

    def age() -> None:
        with Queue(dsn) as ager:
            params = {"top": high, "queue": queue, "after": aging_after}
            while not stop.wait(0.05):
                ager.conn.execute(AGING, params)

    ager = threading.Thread(target=age) if aging_after is not None else None
    worker.start()
    if ager:
        ager.start()
    try:
        produce(dsn, queue, seconds, arrivals_per_s, high)
        frame = waits(dsn, queue)
    finally:
        stop.set()
        if ager:
            ager.join()
        worker.stop(grace=1)
    frame.attrs["aging_after"] = aging_after
    return frame


def plot_waits(runs: dict[str, pd.DataFrame], *, title: str) -> Figure:
    """Waiting time against enqueue time, one panel per run, a colour per class."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.8), sharey=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (label, frame) in zip(axes, runs.items(), strict=True):
        for cls, color, marker in (("high", "tab:blue", "."), ("low", "tab:red", "o")):
            part = frame[frame["class"] == cls]
            ax.scatter(
                part["enqueued"],
                part["waited"],
                color=color,
                marker=marker,
                s=14 if cls == "high" else 45,
                label=f"priority {cls} ({len(part)} jobs)",
            )
        ax.axvline(frame.attrs["stream_end"], color="0.4", ls=":", label="the urgent stream stops")
        if frame.attrs.get("aging_after") is not None:
            ax.axhline(
                frame.attrs["aging_after"],
                color="tab:red",
                ls="--",
                lw=1,
                label=f"aging: raised after {frame.attrs['aging_after']:g} s",
            )
        ax.set_title(label)
        ax.set_xlabel("enqueued at (s since the first job)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center")
    axes[0].set_ylabel("waited before it started (s)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
