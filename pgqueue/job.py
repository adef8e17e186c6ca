"""A claimed job: what the claim returned, and whether this worker has since lost it."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from .errors import LeaseLost
from .fencing import fenced_write

# Guards the lazy creation of ``Job.lost_event`` against a concurrent ``mark_lost``.
_LOST_LOCK = threading.Lock()


@dataclass
class Job:
    """One claim of a job. ``fence`` is this holder's token: every later write carries it."""

    id: int
    queue: str
    payload: dict[str, Any]
    fence: int
    attempts: int
    max_attempts: int
    lease_until: datetime | None
    # Set by whoever claimed the job: the connection to write with, and an event recorder.
    conn: psycopg.Connection | None = field(default=None, repr=False, compare=False)
    on_event: Callable[[str, Job], None] | None = field(default=None, repr=False, compare=False)
    # This holder's own view of its lease, on its monotonic clock: set from the moment the
    # claim was sent, pushed on by each heartbeat that took effect. Past it the job is lost
    # even if no statement said so (a keeper that cannot reach the server cannot learn it).
    deadline: float = field(default=math.inf, repr=False, compare=False)
    # What the last fenced write of the job itself left: 'done', 'ready' (retry in
    # ``retry_in`` seconds), 'dead'; 'running' while held.
    status: str = field(default="running", compare=False)
    retry_in: float | None = field(default=None, repr=False, compare=False)
    # A plain flag, and a threading.Event made only if someone asks for one: building an
    # Event per claimed job was the largest client cost of a Worker draining small jobs.
    _lost: bool = field(default=False, init=False, repr=False, compare=False)
    _lost_event: threading.Event | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def lost(self) -> bool:
        """True once a heartbeat or write found that someone else holds the job now, or
        once the lease ran out on this holder's clock with no heartbeat taking effect."""
        return self._lost or time.monotonic() >= self.deadline

    @property
    def lost_event(self) -> threading.Event:
        """A ``threading.Event`` set when the job is lost, for handlers that wait on it."""
        with _LOST_LOCK:
            if self._lost_event is None:
                self._lost_event = threading.Event()
                if self.lost:
                    self._lost_event.set()
            return self._lost_event

    def mark_lost(self) -> None:
        """Record that this holder's fence is stale (set by the worker, read by handlers)."""
        with _LOST_LOCK:
            self._lost = True
            if self._lost_event is not None:
                self._lost_event.set()

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLost`` if the job was taken over; call it between steps of long work."""
        if self._lost:
            raise LeaseLost(f"job {self.id}: fence {self.fence} is stale; discard this work")
        if self.lost:
            raise LeaseLost(
                f"job {self.id}: the lease ran out here before a heartbeat renewed it "
                "(another worker may hold it now); discard this work"
            )

    def fenced_write(
        self,
        table: str,
        key: Mapping[str, Any],
        values: Mapping[str, Any],
        *,
        upsert: bool = True,
        job_column: str = "job_id",
    ) -> bool:
        """Write to another table with this job's fence and id (see ``pgqueue.fenced_write``;
        the table needs a ``job_column`` beside ``fence``); return whether it took effect.
        The same statement checks the job in ``jobs`` too (``check_lease``): it must still
        be running with this fence and an unexpired lease. A refused write means this
        holder's claim is over: the job is marked lost. A row written by another job raises
        ``FenceConflict`` (the handler fails, so it is seen)."""
        if self.conn is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        # Known stale here (failed, timed out, told by a heartbeat): refused without a
        # round trip. Otherwise the statement itself checks the row's fence and the job's.
        took_effect = not self._lost and fenced_write(
            self.conn,
            table,
            key,
            values,
            self.fence,
            job_id=self.id,
            job_column=job_column,
            upsert=upsert,
            check_lease=True,
        )
        return self._wrote(took_effect)

    def _wrote(self, took_effect: bool) -> bool:
        """After a fenced write (Job's or AsyncJob's): a refusal means this holder's fence
        is stale, so the job is lost; record how it went."""
        if not took_effect:
            self.mark_lost()
        if self.on_event:
            self.on_event("fenced-write" if took_effect else "fenced-write-rejected", self)
        return took_effect
