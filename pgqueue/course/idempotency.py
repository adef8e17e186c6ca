"""Notebook 05's aids: an e-mail service outside the database, and the paused-worker story
replayed against it, so the notebook can count the e-mails that went out.

``FakeMailer`` stands for any effect the database cannot take back: every ``send`` delivers,
unless the service was built to de-duplicate and the call carries an idempotency key it has
seen before (as payment APIs do with an ``Idempotency-Key`` header).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..events import EventLog
from ..job import Job
from ..queue import Queue
from ..worker import Worker
from .faults import FaultyWorker
from .lab import wait_for

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What ends a worker's hold on a job, for waiting until both holders are through.
_ENDS = {"complete", "complete-rejected", "fail", "fail-rejected", "skipped"}


@dataclass(frozen=True)
class Message:
    """One e-mail the service delivered."""

    id: str
    to: str
    subject: str
    key: str | None
    sender: str  # the worker lane whose handler sent it
    at: float  # time.time()


class FakeMailer:
    """An e-mail service: ``send`` delivers a message and returns its id. With ``dedupe``,
    a call carrying an idempotency ``key`` the service has seen delivers nothing and
    returns the first message's id. Thread-safe; sends are recorded in ``events`` too."""

    def __init__(self, *, dedupe: bool = False, events: EventLog | None = None) -> None:
        self.dedupe = dedupe
        self.events = events
        self.delivered: list[Message] = []
        self.calls = 0
        self._by_key: dict[str, Message] = {}
        self._lock = threading.Lock()

    def send(self, to: str, subject: str, *, key: str | None = None, job: Job | None = None) -> str:
        """Deliver one e-mail (or, de-duplicating, recognise a repeated key); its message id."""
        sender = threading.current_thread().name.removeprefix("pgqueue-")
        with self._lock:
            self.calls += 1
            seen = self._by_key.get(key) if self.dedupe and key is not None else None
            if seen is None:
                message = Message(
                    f"m{len(self.delivered) + 1}", to, subject, key, sender, time.time()
                )
                self.delivered.append(message)
                if key is not None:
                    self._by_key.setdefault(key, message)
        if self.events is not None:
            kind = "email-duplicate" if seen is not None else "email-sent"
            job_id, fence = (job.id, job.fence) if job else (None, None)
            self.events.record(kind, sender, job_id, fence, key or "")
        return (seen or message).id


def paused_worker_story(
    dsn: str,
    handler: Callable[[Job], Any],
    *,
    payload: dict[str, Any],
    queue: str | None = None,
    pause: float = 2.0,
    lease: float = 1.0,
    events: EventLog | None = None,
) -> tuple[int, EventLog]:
    """Replay the paused worker with ``handler``: worker A claims the job and freezes as its
    handler starts, past its lease; B takes the job over and runs it; A wakes up and runs the
    rest of its handler as if no time had passed. Returns the job id and the events.

    Each story runs on a queue of its own (``emails-<n>`` unless ``queue`` is given): a job
    an earlier story left ready (a handler that raised is retried later) would otherwise be
    the first that this story's A claims."""
    events = events if events is not None else EventLog()
    queue = queue or f"emails-{time.monotonic_ns()}"
    with Queue(dsn) as q:
        job_id = q.enqueue(payload, queue=queue)
    common: dict[str, Any] = dict(
        queue=queue, dsn=dsn, lease=lease, poll_interval=0.05, reap_interval=0.1, listen=False
    )
    a = FaultyWorker(handler, name="A", events=events, **common)
    a.pause_on_next_claim(pause)
    b = Worker(handler, name="B", events=events, **common)
    a.start()
    try:
        wait_for(events, lambda e: e.kind == "claim" and e.job_id == job_id)
        b.start()  # B polls, reaps when A's lease runs out, and takes the job
        limit = 10 * (pause + lease) + 5
        for lane in ("A", "B"):
            wait_for(
                events,
                lambda e, lane=lane: e.worker == lane and e.job_id == job_id and e.kind in _ENDS,
                timeout=limit,
            )
    finally:
        a.stop(grace=1)
        b.stop(grace=1)
    return job_id, events


def plot_story(events: EventLog, *, title: str, lease: float | None = None) -> Figure:
    """The story's timeline (``pgqueue.course.plot.timeline``) with the e-mails on it: a
    filled envelope where one was delivered, a hollow one where the service recognised a
    repeated key and delivered nothing."""
    from matplotlib.lines import Line2D

    from .plot import as_frame, timeline

    fig = timeline(events, title=title, lease=lease)
    ax = fig.axes[0]
    rows = {label.get_text(): y for y, label in enumerate(ax.get_yticklabels())}
    frame = as_frame(events)
    extra = []
    for kind, face, label in (
        ("email-sent", "gold", "e-mail delivered"),
        ("email-duplicate", "white", "repeated key: nothing delivered"),
    ):
        mine = frame[(frame["kind"] == kind) & frame["worker"].isin(rows)]
        if not len(mine):
            continue
        ys = [rows[w] + 0.3 for w in mine["worker"]]  # just below the lane
        ax.scatter(mine["s"], ys, marker="s", s=90, facecolor=face, edgecolor="black", zorder=4)
        ax.scatter(mine["s"], ys, marker="v", s=30, facecolor="none", edgecolor="black", zorder=5)
        extra.append(
            Line2D(
                [],
                [],
                linestyle="",
                marker="s",
                markersize=9,
                markerfacecolor=face,
                markeredgecolor="black",
                label=label,
            )
        )
    legend = ax.get_legend()
    handles = [*(legend.legend_handles if legend else []), *extra]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )
    fig.tight_layout()
    return fig
