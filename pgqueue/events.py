"""A cheap, thread-safe record of what workers did, for timelines and tests.

Kinds: claim, heartbeat, lease-lost, skipped (lost before it started), complete,
complete-rejected, fail, fail-rejected, release, release-rejected, reap, fenced-write,
fenced-write-rejected, pause, crash.
Appending is one tuple under a lock (a batch: one lock and one timestamp for all of it);
``to_frame()`` turns the record into pandas.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pandas as pd


class Event(NamedTuple):
    """One thing that happened: when (seconds since the epoch), what, who, to which job."""

    t: float
    kind: str
    worker: str
    job_id: int | None = None
    fence: int | None = None
    detail: str = ""


class EventLog:
    """Append-only list of ``Event``s shared by any number of threads."""

    def __init__(self, maxlen: int | None = 200_000) -> None:
        # Bounded, so a long-running worker's record cannot grow without limit.
        self._events: deque[Event] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.started = time.time()

    def record(
        self,
        kind: str,
        worker: str,
        job_id: int | None = None,
        fence: int | None = None,
        detail: str = "",
    ) -> None:
        """Add one event stamped with the current time."""
        event = Event(time.time(), kind, worker, job_id, fence, detail)
        with self._lock:
            self._events.append(event)

    def record_many(self, rows: Iterable[tuple[str, str, int | None, int | None, str]]) -> None:
        """Add several events, each ``(kind, worker, job_id, fence, detail)``, stamped with
        one time: what happened to a whole claimed batch happened in one round trip."""
        t = time.time()
        events = [Event(t, *row) for row in rows]
        with self._lock:
            self._events.extend(events)

    def events(self, kind: str | None = None) -> list[Event]:
        """A copy of the events so far, optionally of one kind."""
        with self._lock:
            snapshot = list(self._events)
        return [e for e in snapshot if kind is None or e.kind == kind]

    def count(self, kind: str) -> int:
        """How many events of ``kind`` were recorded."""
        return len(self.events(kind))

    def clear(self) -> None:
        """Forget every event and restart the clock."""
        with self._lock:
            self._events.clear()
            self.started = time.time()

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def to_frame(self) -> pd.DataFrame:
        """A DataFrame with one row per event; column ``s`` is seconds since the log began."""
        import pandas as pd

        frame = pd.DataFrame(self.events(), columns=list(Event._fields))
        # Whole numbers with gaps (a pause has no job), not floats: job 7, not 7.0.
        frame = frame.astype({"job_id": "Int64", "fence": "Int64"})
        frame["s"] = frame["t"] - self.started
        return frame

    def as_dicts(self) -> list[dict[str, Any]]:
        """The events as plain dicts (for JSON)."""
        return [e._asdict() for e in self.events()]


class NullEventLog(EventLog):
    """An event record that records nothing: for production runs, where nobody draws the
    timeline (``Worker(record_events=False)``; the command-line worker's default)."""

    def record(
        self,
        kind: str,
        worker: str,
        job_id: int | None = None,
        fence: int | None = None,
        detail: str = "",
    ) -> None:
        """Drop the event."""

    def record_many(self, rows: Iterable[tuple[str, str, int | None, int | None, str]]) -> None:
        """Drop the events."""
