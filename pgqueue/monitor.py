"""Watch a queue live: ready, running and dead jobs by queue, the jobs finished per second,
and each running job's lease (time left, fence), in a notebook figure updated in place.

``pgqueue.monitor(q, ...)`` watches in the calling thread until its time is up, a condition
is met (``until``) or the cell is interrupted, and leaves the last figure in the output;
``with pgqueue.Monitor(q, ...):`` watches on a thread of its own beside your code. The
monitor reads the table on a connection of its own, a few cheap statements a look
(``sql/monitor.sql``: partial indexes and a primary-key range, never the done jobs), and
takes its time from the database. The figure is drawn by ``monitor_figure.py``; matplotlib
and IPython are imported only to draw.
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import IsolationLevel
from psycopg.conninfo import make_conninfo

from . import statements
from .async_queue import AsyncQueue
from .db import connect, pgbouncer_mode
from .errormap import pgqueue_error
from .errors import BadInput
from .inputs import queue_names
from .monitor_looks import (
    Counts,
    Lease,
    LimitLook,
    ScheduleLook,
    Snapshot,
    kept_jobs,
    side_notes,
)
from .options import whole
from .queue import Queue
from .worker import Face

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    Until = Callable[[], object] | Face | threading.Thread | threading.Event | str

__all__ = ["Counts", "Lease", "Monitor", "Snapshot", "monitor"]

# What the figure says in text (alt text on GitHub; the same on every look, for nbval).
ALT = "pgqueue monitor: ready, running and dead jobs by queue, throughput, running leases"


@cache
def _sql() -> dict[str, str]:
    text = resources.files("pgqueue").joinpath("sql/monitor.sql").read_text(encoding="utf-8")
    return statements.parse(text)


class _Eye:
    """The monitor's connection and what it remembers between looks (the counts and the
    newest id), to tell how many jobs finished in between."""

    def __init__(self, dsn: str, pgbouncer: bool, queues: list[str] | None, bars: int) -> None:
        self.conn = connect(dsn, application_name="pgqueue monitor", pgbouncer=pgbouncer)
        self.conn.isolation_level = IsolationLevel.REPEATABLE_READ  # one moment per look
        self.conn.read_only = True
        self.queues, self.bars = queues, bars
        self._newest: int | None = None
        self._before: dict[str, Counts] = {}
        self._first: datetime | None = None
        self._last: datetime | None = None
        with self.conn.transaction():
            row = self.conn.execute(_sql()["monitor_side_tables"]).fetchone()
        self._periodic, self._limited = row if row else (False, False)

    def look(self) -> Snapshot:
        sql = _sql()
        params = {"queues": self.queues, "after": self._newest, "limit": max(self.bars, 1)}
        try:
            with self.conn.transaction():
                at, newest = self.conn.execute(sql["monitor_clock"]).fetchone() or (None, 0)
                rows = self.conn.execute(sql["monitor_counts"], params).fetchall()
                leases = self.conn.execute(sql["monitor_leases"], params).fetchall()
                ticks = limits = []
                if self._periodic:
                    ticks = self.conn.execute(sql["monitor_schedules"], params).fetchall()
                if self._limited:
                    limits = self.conn.execute(sql["monitor_limits"], params).fetchall()
        except psycopg.Error as exc:
            mapped = pgqueue_error(exc)
            if mapped is None:
                raise
            raise mapped from None
        found: dict[str, dict[str, int]] = {}
        for queue, status, jobs in rows:
            found.setdefault(queue, {})[status] = int(jobs)
        queues = {}
        for queue in sorted(found.keys() | self._before.keys()):
            now = found.get(queue, {})
            counts = Counts(now.get("ready", 0), now.get("running", 0), now.get("dead", 0))
            if self._newest is not None:
                # A job that left the live and dead ones, and was not added since, finished.
                before = self._before.get(queue, Counts())
                gone = kept_jobs(before) - kept_jobs(counts) + now.get("added", 0)
                counts = Counts(counts.ready, counts.running, counts.dead, max(gone, 0))
            if kept_jobs(counts) or counts.finished:
                queues[queue] = counts
        self._before = {queue: counts for queue, counts in queues.items() if kept_jobs(counts)}
        self._newest = int(newest)
        first = self._first = self._first or at
        last, self._last = self._last, at
        return Snapshot(
            t=(at - first).total_seconds(),
            at=at,
            seconds=0.0 if last is None else (at - last).total_seconds(),
            queues=queues,
            leases=tuple(Lease(*row) for row in leases[: self.bars]),
            schedules=tuple(ScheduleLook(*row) for row in ticks),
            limits=_limit_looks(limits),
        )

    def close(self) -> None:
        self.conn.close()


def _limit_looks(rows: list[tuple[Any, ...]]) -> tuple[LimitLook, ...]:
    """``monitor_limits``'s rows (queue, per_group, group, jobs; no group: none running) as
    one LimitLook per queue."""
    found: dict[str, LimitLook] = {}
    for queue, per_group, group, jobs in rows:
        look = found.get(queue) or LimitLook(queue, int(per_group), ())
        if group is not None:
            look = LimitLook(queue, look.per_group, (*look.running, (group, int(jobs))))
        found[queue] = look
    return tuple(found.values())


# -- the monitor --------------------------------------------------------------------------


class Monitor:
    """Watch ``source`` (a ``Queue``, an ``AsyncQueue`` or a DSN) on a connection of its
    own, one look every ``every`` seconds, for ``queue`` (a name or a list; None: every
    queue). Stops after ``seconds``, or when ``until`` is done: a ``Worker`` (or
    ``AsyncWorker``) that has stopped working (a burst worker ran dry, or ``stop()``), a
    started thread that ended, an ``Event`` set, a callable that returns true, the text
    ``"drained"`` (the queues watched had ready or running jobs and have none left), or a
    list of these (all of them). ``bars``: the running jobs drawn, those whose leases end
    first. ``show``: in a notebook, a figure updated in place (the last one stays in the
    output); elsewhere a line of text a second; False shows nothing.

    ``run()`` watches in this thread (an interrupt, Ctrl-C, ends it like ``seconds``);
    ``start()``/``stop()`` or ``with`` watch on a thread of its own (``wait()`` for it to
    end by itself). ``snapshots`` holds every look, ``fences`` every running job seen with
    its fences, ``figure()`` draws the last look, ``frame()`` gives them as a DataFrame.
    """

    def __init__(
        self,
        source: Queue | AsyncQueue | str,
        queue: str | Sequence[str] | None = None,
        *,
        seconds: float | None = None,
        until: Until | Sequence[Until] | None = None,
        every: float = 0.25,
        bars: int = 10,
        show: bool = True,
    ) -> None:
        self._dsn, self._pgbouncer = _dsn_of(source)
        self.queues = None if queue is None else queue_names(queue)
        self.seconds = None if seconds is None else _seconds("seconds", seconds, 0.0)
        self.every = _seconds("every", every, 0.01)
        self.bars = whole("bars", bars, 0, 50)
        self._until = _conditions(until)
        self.show = bool(show)
        self.snapshots: list[Snapshot] = []
        self.stopped_by: str | None = None  # seconds, until, interrupted, stop or error
        self.error: BaseException | None = None
        self._eye: _Eye | None = None
        self._screen: _Screen | None = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._ended = threading.Lock()
        self._busy = False  # "drained": some look saw a ready or running job

    # -- watching -----------------------------------------------------------------------
    def run(self) -> Monitor:
        """Watch in this thread until ``seconds``, ``until`` or an interrupt; return self."""
        try:
            self._begin()
            self._watch()
        except KeyboardInterrupt:
            self.stopped_by = "interrupted"
        finally:
            self._end()
        return self

    def start(self) -> Monitor:
        """Take the first look here (a bad DSN or a missing table fails in the caller's
        thread), then watch, and draw, on a thread of its own; return self."""
        self._begin()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="pgqueue-monitor")
        self._thread.start()
        return self

    def stop(self) -> Monitor:
        """Stop watching (the thread's last look stays the last), leave the figure; return
        self. Raises what stopped the thread, if a look failed."""
        if self.stopped_by is None:
            self.stopped_by = "stop"
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        self._end()
        if self.error is not None:
            raise self.error
        return self

    def wait(self, timeout: float | None = None) -> Monitor:
        """Block until the watch started by ``start()`` ends by itself (its ``seconds`` or
        ``until``), or ``timeout`` seconds pass; return self."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self.stopped_by = "interrupted"
        self.stop()

    def _begin(self) -> None:
        if self._eye is not None:
            raise BadInput("this monitor has already watched: make a new one")
        self._eye = _Eye(self._dsn, self._pgbouncer, self.queues, self.bars)
        self._screen = _Screen(self.show)
        try:
            self._look()
        except BaseException:  # a missing table, a lost server: nothing left open
            self._eye.close()
            raise
        self._screen.reserve()  # its place in the caller's cell, then the first figure
        self._screen.update(self)

    def _serve(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # re-raised by stop(), in the caller's thread
            self.error, self.stopped_by = exc, "error"
        if not self._halt.is_set():  # ended by itself: leave the figure now
            self._end()

    def _watch(self) -> None:
        began = time.monotonic()
        deadline = None if self.seconds is None else began + self.seconds
        while True:
            pause = self.every - (time.monotonic() - self._looked)
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
            if self._halt.wait(max(pause, 0.0)):
                return
            reason = self._reason(deadline)
            self._look()  # once more when it is over, so the last look shows the end
            if reason is not None:
                self.stopped_by = reason
                return

    def _look(self) -> None:
        assert self._eye is not None and self._screen is not None
        self._looked = time.monotonic()
        snapshot = self._eye.look()
        self.snapshots.append(snapshot)
        self._busy = self._busy or snapshot.total.ready + snapshot.total.running > 0
        if len(self.snapshots) > 1:  # the first is shown once its place is taken (_begin)
            self._screen.update(self)

    def _reason(self, deadline: float | None) -> str | None:
        if deadline is not None and time.monotonic() >= deadline:
            return "seconds"
        if self._until is not None and self._until(self):
            return "until"
        return None

    def _end(self) -> None:
        if not self._ended.acquire(blocking=False):
            return
        if self._eye is not None:
            self._eye.close()
        if self._screen is not None and self.snapshots:
            self._screen.update(self, final=True)

    # -- what it saw ----------------------------------------------------------------------
    @property
    def done(self) -> int:
        """Jobs finished (done or cancelled) between the first look and the last."""
        return sum(s.total.finished for s in self.snapshots)

    @property
    def fences(self) -> dict[int, set[int]]:
        """Each running job seen, with every fence it was seen running under."""
        seen: dict[int, set[int]] = {}
        for snapshot in self.snapshots:
            for lease in snapshot.leases:
                seen.setdefault(lease.id, set()).add(lease.fence)
        return seen

    def figure(self) -> Figure:
        """The last look drawn as a new matplotlib figure (``monitor_figure.draw``)."""
        from .monitor_figure import draw

        return draw(self.snapshots, stopped_by=self.stopped_by)

    def frame(self) -> pd.DataFrame:
        """One row per look and queue: t, queue, ready, running, dead, finished, rate."""
        import pandas as pd

        rows = [
            {
                "t": s.t,
                "queue": queue,
                "ready": c.ready,
                "running": c.running,
                "dead": c.dead,
                "finished": c.finished,
                "rate": c.finished / s.seconds if s.seconds > 0 else float("nan"),
            }
            for s in self.snapshots
            for queue, c in s.queues.items()
        ]
        return pd.DataFrame(
            rows, columns=["t", "queue", "ready", "running", "dead", "finished", "rate"]
        )

    def __repr__(self) -> str:
        last = self.snapshots[-1].total if self.snapshots else Counts()
        return (
            f"<Monitor: {len(self.snapshots)} looks, {self.done} finished; last: {last.ready} "
            f"ready, {last.running} running, {last.dead} dead; stopped by {self.stopped_by}>"
        )


def monitor(
    source: Queue | AsyncQueue | str,
    queue: str | Sequence[str] | None = None,
    *,
    seconds: float | None = None,
    until: Until | Sequence[Until] | None = None,
    every: float = 0.25,
    bars: int = 10,
    show: bool = True,
) -> Monitor:
    """Watch a queue live until ``seconds`` have passed, ``until`` is done or the cell is
    interrupted (which ends the watch, not the cell), and return the ``Monitor`` with what
    it saw. With neither ``seconds`` nor ``until`` it watches until interrupted. Run the
    workers on threads (``Worker.start()``) or elsewhere; ``with pgqueue.Monitor(...):``
    watches beside code of your own instead. See ``Monitor`` for the arguments."""
    return Monitor(
        source, queue, seconds=seconds, until=until, every=every, bars=bars, show=show
    ).run()


# -- checking what it was given -----------------------------------------------------------
def _dsn_of(source: object) -> tuple[str, bool]:
    """The DSN to open the monitor's own connection with, and whether it is PgBouncer's."""
    if isinstance(source, str) and source.strip():
        return source, pgbouncer_mode(None)
    if isinstance(source, Queue | AsyncQueue):
        if source.closed:
            raise BadInput("monitor: the Queue's connection is closed; pass an open Queue")
        conn = source.conn
        dsn = conn.info.dsn
        if conn.info.password:  # not in info.dsn
            dsn = make_conninfo(dsn, password=conn.info.password)
        return dsn, source.pgbouncer
    raise BadInput(
        f"monitor needs a queue connection to watch: a pgqueue.Queue (or AsyncQueue, or a "
        f"DSN string), got {source!r}"
    )


def _seconds(what: str, value: object, lower: float) -> float:
    """A number of seconds above 0 and at least ``lower``, else a one-line error."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not (value > 0 and value >= lower)
    ):
        least = f"at least {lower:g}" if lower else "more than 0"
        raise BadInput(f"{what} must be a number of seconds ({least}), got {value!r}")
    return float(value)


def _conditions(until: object) -> Callable[[Monitor], bool] | None:
    """``until`` as one test of the monitor, or None; a one-line error for anything else."""
    if until is None:
        return None
    if isinstance(until, list | tuple):
        if not until:
            raise BadInput("until must not be an empty list (None: no condition)")
        tests = [_condition(each) for each in until]
        return lambda m: all(test(m) for test in tests)
    return _condition(until)


def _condition(until: object) -> Callable[[Monitor], bool]:
    if isinstance(until, str) and until == "drained":
        return lambda m: (
            m._busy and not (m.snapshots[-1].total.ready + m.snapshots[-1].total.running)
        )
    if isinstance(until, Face):
        return lambda m: until.finished
    if isinstance(until, threading.Thread):
        return lambda m: until.ident is not None and not until.is_alive()
    if isinstance(until, threading.Event):
        return lambda m: until.is_set()
    if callable(until) and not isinstance(until, str | type):
        return lambda m: bool(until())
    raise BadInput(
        "until must be a Worker, a thread, an Event, a callable, 'drained' or a list of "
        f"them, got {until!r}"
    )


# -- showing it ---------------------------------------------------------------------------
class _Screen:
    """Where the looks go: a figure in a notebook, updated in place (a display id) by a
    painter thread, so drawing never delays a look; a line of text at most once a second
    elsewhere; or nowhere (``show=False``)."""

    def __init__(self, show: bool) -> None:
        self.mode = "none" if not show else ("notebook" if _in_notebook() else "text")
        if self.mode == "notebook":  # imported now, so the first drawing times only itself
            import IPython.display  # noqa: F401
            import matplotlib.figure  # noqa: F401
        self._handle: Any = None
        self._figure: Figure | None = None
        self._printed = -math.inf
        self._painter: threading.Thread | None = None
        self._wanted = threading.Event()  # a look since the last drawing
        self._closing = threading.Event()

    def reserve(self) -> None:
        """Take the figure's place in the caller's cell now (text only until drawn)."""
        if self.mode == "notebook":
            from IPython.display import display

            self._handle = display({"text/plain": ALT}, raw=True, display_id=True)

    def update(self, monitor: Monitor, *, final: bool = False) -> None:
        if self.mode == "notebook" and final:
            self._closing.set()
            self._wanted.set()
            if self._painter is not None:
                self._painter.join()
            self._draw(monitor, final=True)
        elif self.mode == "notebook":
            if self._painter is None:
                self._painter = threading.Thread(
                    target=self._paint, args=(monitor,), daemon=True, name="pgqueue-monitor-draw"
                )
                self._painter.start()
            self._wanted.set()
        elif self.mode == "text" and (final or time.monotonic() - self._printed >= 1.0):
            self._printed = time.monotonic()
            print(_line(monitor, final), flush=True)

    def _paint(self, monitor: Monitor) -> None:
        while self._wanted.wait() and not self._closing.is_set():
            self._wanted.clear()
            began = time.monotonic()
            self._draw(monitor, final=False)
            # A drawing can take a good part of a second of CPU on a slow machine, beside
            # the workers: draw again after twice that at the soonest (a third drawing).
            if self._closing.wait(min(2 * (time.monotonic() - began), 2.0)):
                return

    def _draw(self, monitor: Monitor, *, final: bool) -> None:
        from .monitor_figure import draw

        self._figure = draw(
            monitor.snapshots, stopped_by=monitor.stopped_by if final else None, fig=self._figure
        )
        png = io.BytesIO()
        self._figure.savefig(png, format="png")
        self._handle.update({"image/png": png.getvalue(), "text/plain": ALT}, raw=True)


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (which can show a figure and update it)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _line(monitor: Monitor, final: bool) -> str:
    last = monitor.snapshots[-1]
    parts = [
        f"{queue}: {c.ready} ready, {c.running} running, {c.dead} dead"
        for queue, c in last.queues.items()
    ] or ["no jobs"]
    rate = "" if last.rate is None else f"; {last.rate:.0f} finished/s"
    end = f"; {monitor.done} finished, stopped by {monitor.stopped_by}" if final else ""
    return f"{last.t:6.1f} s  " + "; ".join(parts + side_notes(last)) + rate + end
