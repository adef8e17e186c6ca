"""Cancelling a running job, for the lesson on how jobs end (06): the worker that runs the
handler while the notebook cancels its job, how the holder was first told, and the story's
timeline with the moment of ``q.cancel()`` marked. The cancel itself stays in the notebook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..events import Event, EventLog
from ..job import Job
from ..worker import Worker

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@contextmanager
def running(
    handler: Callable[[Job], Any],
    dsn: str,
    *,
    queue: str,
    events: EventLog,
    lease: float,
    name: str = "w",
) -> Iterator[Worker]:
    """A worker of one lane running ``handler`` on ``queue`` (polling every 50 ms), stopped
    when the block ends, however it ends."""
    worker = Worker(
        handler, queue=queue, dsn=dsn, lease=lease, poll_interval=0.05, events=events, name=name
    ).start()
    try:
        yield worker
    finally:
        worker.stop(grace=1)


def first_told(events: EventLog) -> Event:
    """The first moment the holder learnt it had lost the job: its first refused fenced
    write or the heartbeat that found the fence risen, whichever came first."""
    told = events.events("fenced-write-rejected") + events.events("lease-lost")
    if not told:
        raise LookupError("the holder was never told: no refused write and no lost lease")
    return min(told, key=lambda e: e.t)


def plot_cancel(events: EventLog, cancelled_at: float, *, title: str) -> Figure:
    """The timeline of ``events`` (``pgqueue.course.plot.timeline``) with a dashed line at
    ``cancelled_at`` (``time.time()`` just before ``q.cancel()``)."""
    from .plot import timeline

    fig = timeline(events, title=title)
    ax = fig.axes[0]
    at = cancelled_at - events.started
    ax.axvline(at, color="tab:red", ls="--", lw=1)
    ax.annotate(
        "q.cancel()",
        (at, -0.45),
        color="tab:red",
        fontsize=8,
        ha="right",
        xytext=(-3, 0),
        textcoords="offset points",
    )
    return fig
