"""The paused-worker story of the fencing lesson: worker A freezes past its lease, B takes
the job over, A wakes up and writes late.

``replay`` runs the story with two real workers on a database of the lesson's, ``tell``
says it in words, ``stored_fences`` reads the fences the database stored in the job's row
and the report's row, and ``draw`` draws it as Kleppmann does (workers on top, the rows that
decide below) with a short legend. The handler, and so the write under test, is the
notebook's own: ``replay`` takes a function that builds it for a worker's name. ``Life``
records one job's row step by step, for the fail that raises the fence.
Teaching aids, not the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..events import Event, EventLog
from ..queue import Queue
from ..worker import Handler, Worker
from . import stories
from .faults import FaultyWorker
from .lab import wait_for
from .timeline import timeline

if TYPE_CHECKING:
    import pandas as pd
    import psycopg
    from matplotlib.figure import Figure

__all__ = ["Life", "Story", "draw", "replay", "stored_fences", "tell"]


class Story(NamedTuple):
    """One run of the story: what the workers did, and the id of the report job."""

    log: EventLog
    job_id: int


def replay(
    dsn: str, handler_for: Callable[[str], Handler], pause: float = 2.0, lease: float = 1.0
) -> Story:
    """Enqueue one report job; start worker A (``FaultyWorker``), told to freeze ``pause``
    seconds as its next job starts, and at once worker B, each running
    ``handler_for(name)`` with a ``lease`` of that many seconds. B finds nothing to do
    until A's lease runs out and B's reaper puts the job back. Returns once someone's
    complete was accepted and A has ended its attempt (its complete or fail, accepted or
    refused). The ``reports`` table is emptied first."""
    log = EventLog()
    with Queue(dsn) as producer:
        producer.conn.execute("DELETE FROM reports")
        job_id = producer.enqueue({"report": 1}, queue="reports")
    common: dict[str, Any] = {
        "queue": "reports",
        "dsn": dsn,
        "lease": lease,
        "poll_interval": 0.05,
        "reap_interval": 0.1,
        "listen": False,
        "events": log,
    }
    a = FaultyWorker(handler_for("A"), name="A", **common)
    a.pause_on_next_claim(pause)
    a.start()
    try:
        wait_for(log, "claim")
        b = Worker(handler_for("B"), name="B", **common).start()
        try:
            wait_for(log, "complete", timeout=pause + lease + 10)

            def a_done(e: Event) -> bool:
                return e.worker == "A" and e.kind.startswith(("complete", "fail"))

            wait_for(log, a_done, timeout=pause + 10)
        finally:
            b.stop()
    finally:
        a.stop()
    return Story(log, job_id)


# What each event says in words ("{detail}" etc. are the event's fields).
_SAY = {
    "claim": "claims job {job_id} and gets fence {fence}",
    "pause": "freezes for {detail} s",
    "reap": "(reaper) A's lease has run out: job {job_id} is {detail} again",
    "fenced-write": "writes the report with fence {fence}: accepted",
    "fenced-write-rejected": "writes the report with fence {fence}: REFUSED, 0 rows",
    "unfenced-write": "writes the report, no fence check: accepted",
    "complete": "completes job {job_id} with fence {fence}: accepted",
    "complete-rejected": "completes job {job_id} with fence {fence}: REFUSED, 0 rows",
    "fail-rejected": "fails job {job_id} with fence {fence}: REFUSED, 0 rows",
    "lease-lost": "learns it lost job {job_id}: {detail}",
}
_HOW_LOST = {"lease ran out here": "its own clock says the lease ran out"}


def tell(log: EventLog) -> None:
    """Print the story in words, in the order it happened (heartbeats left out)."""
    for e in log.events():
        if e.kind == "lease-lost":
            e = e._replace(detail=_HOW_LOST.get(e.detail, "a heartbeat was refused"))
        if e.kind in _SAY:
            print(f"{e.worker}: " + _SAY[e.kind].format(**e._asdict()))


def stored_fences(conn: psycopg.Connection, story: Story) -> dict[str, pd.DataFrame]:
    """The fence the job's row and report row 1 held each time it changed during the
    story (from ``stories.watch``'s log, on the database's clock): ``{lane: frame}``."""
    return {
        f"jobs row #{story.job_id}": stories.fences(conn, "jobs", id=story.job_id),
        "reports row 1": stories.fences(conn, "reports", since=story.log.started, id=1),
    }


def draw(
    conn: psycopg.Connection,
    story: Story,
    title: str,
    storage: Mapping[str, pd.DataFrame] | None = None,
) -> Figure:
    """The story on a timeline: lanes A and B, the leases the database set, and (with
    ``storage``, from ``stored_fences``) a lane per stored row with an arrow for every
    claim and write reaching it. A write that checked no fence is drawn orange, not green,
    and a stored fence that went back is labelled where it did. The legend names only
    what this story can show, a few entries grouped by colour."""
    import matplotlib.pyplot as plt

    kinds = {e.kind for e in story.log.events()}
    # The legend goes on first, so that the timeline's layout and labels leave room for it.
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.75 * (2 + len(storage or {}))))
    from matplotlib.legend_handler import HandlerTuple

    handles, labels = _legend(kinds, stored=bool(storage))
    ax.legend(
        handles,
        labels,
        handler_map={tuple: HandlerTuple(ndivide=None)},
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    timeline(
        story.log,
        storage=storage,
        lanes=["A", "B"],
        leases=stories.leases(conn),
        title=title,
        legend=False,
        ax=ax,
    )
    if storage:
        _recolour_unchecked_writes(ax, story.log)
        _mark_fences_going_back(ax, storage, story.log.started)
    return fig


class Life:
    """One job's life taken by hand: ``step(what, returned)`` records what a statement
    returned and the job's row after it (status, attempts, fence), and returns every step
    so far as a DataFrame."""

    def __init__(self, q: Queue, job_id: int) -> None:
        self.q, self.job_id = q, job_id
        self.rows: list[tuple[str, object, str, int, int]] = []

    def step(self, what: str, returned: object = "") -> pd.DataFrame:
        import pandas as pd

        state = self.q.get(self.job_id)
        assert state is not None, f"job {self.job_id} is gone"
        self.rows.append((what, returned, state.status, state.attempts, state.fence))
        return pd.DataFrame(self.rows, columns=["step", "returned", "status", "attempts", "fence"])


def _recolour_unchecked_writes(ax: Any, log: EventLog) -> None:
    """The storage arrows of ``unfenced-write`` events, orange: they carried no check."""
    times = [e.t - log.started for e in log.events("unfenced-write")]
    for text in ax.texts:
        arrow = getattr(text, "arrow_patch", None)
        if arrow is not None and any(abs(text.xy[0] - s) < 1e-9 for s in times):
            arrow.set_color("darkorange")


def _mark_fences_going_back(ax: Any, storage: Mapping[str, pd.DataFrame], started: float) -> None:
    """Where a stored fence became smaller than the one before, say so in red."""
    lanes = [label.get_text() for label in ax.get_yticklabels()]
    for name, frame in storage.items():
        fences = [int(f) for f in frame["fence"]]
        for i in range(1, len(fences)):
            if fences[i] < fences[i - 1]:
                s = float(frame["t"].iloc[i]) - started
                y = lanes.index(name)
                ax.annotate(
                    f"{fences[i - 1]} → {fences[i]}: the stored fence went back",
                    xy=(s, y),
                    xytext=(s, y + 0.42),
                    ha="center",
                    fontsize=8.5,
                    color="red",
                    arrowprops={"arrowstyle": "-", "color": "red", "lw": 0.8},
                )
                bottom, top = ax.get_ylim()
                ax.set_ylim(max(bottom, y + 0.65), top)


def _legend(kinds: set[str], *, stored: bool) -> tuple[list[Any], list[str]]:
    """Ten entries at most, each a colour with the marks that share it: the handles (a
    tuple draws its marks side by side) and their labels."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def mark(marker: str, color: str, *, hollow: bool = False) -> Line2D:
        face = "none" if hollow else color
        return Line2D([], [], linestyle="", marker=marker, color=color, markerfacecolor=face)

    lease = Line2D([], [], color="tab:red", alpha=0.5)
    entries: list[tuple[Any, str]] = [
        (Patch(facecolor="0.8", alpha=0.6), "A paused"),
        (Patch(facecolor="tab:blue", alpha=0.3), "holding the job (red: its end refused)"),
        ((lease, mark("|", "0.35")), "lease in the database, heartbeat (dotted: ran out)"),
        (mark(">", "tab:blue"), "claim" + (": the row hands out a new fence" if stored else "")),
        ((mark("D", "tab:green"), mark("s", "tab:green")), "write, complete: accepted"),
    ]
    if "unfenced-write" in kinds:
        entries.append((mark("P", "darkorange"), "write with no fence check: accepted"))
    entries += [
        (mark("X", "red"), "late write refused: 0 rows"),
        (mark("^", "black"), "reaper takes the job back"),
        (mark("d", "tab:purple", hollow=True), "A's own clock: lease ran out"),
    ]
    if stored:
        entries.append(
            (Line2D([], [], color="0.45", linewidth=5, alpha=0.35), "fence stored in the row")
        )
    return [h for h, _ in entries], [label for _, label in entries]
