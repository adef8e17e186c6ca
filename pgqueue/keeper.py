"""How a Worker keeps its leases: the keeper thread (heartbeats at lease/3, the reaper,
local lease deadlines, handler timeouts that replace a lane, timed flushes of the
completion buffer) and the listener thread (LISTEN as a wake-up hint).

A mixin of ``Worker`` (pgqueue/worker.py), which owns the state used here.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from .db import connect
from .events import EventLog
from .job import Job
from .parts import (
    _DISCONNECTS,
    Key,
    _Bell,
    _Failure,
    _Held,
    _is_setup_error,
    _key,
    _Lane,
    _Link,
    describe,
    log,
)
from .queue import Queue


class _Keeping:
    """Heartbeats, the reaper, deadlines, timeouts and LISTEN (mixed into ``Worker``)."""

    # State owned by Worker.__init__.
    _lock: threading.Lock
    _in_flight: dict[Key, _Held]
    _finishing: set[Key]
    _buffer: list[tuple[Job, float]]
    _bell: _Bell
    _stop: threading.Event
    _halted: threading.Event
    _abandoned: threading.Event
    events: EventLog
    name: str
    app_name: str
    dsn: str
    listen_dsn: str | None
    lease: float
    reap_interval: float
    flush_after: float
    queues: list[str]
    timed_out: int

    _lanes: list[_Lane]

    def _give_up(self, exc: BaseException) -> None:
        """Stop the whole worker (Worker provides it)."""
        raise NotImplementedError

    def _start_lane(self, lane: _Lane) -> None:
        """Start a registered lane's thread (Worker provides it)."""
        raise NotImplementedError

    def _keep(self) -> None:
        link = _Link(self)
        beat_every = self.lease / 3
        next_beat = time.monotonic() + beat_every
        next_reap = time.monotonic() + self.reap_interval * random.uniform(0.5, 1.0)
        try:
            while not (self._halted.is_set() or self._abandoned.is_set()):
                if self._stop.is_set() and not self.in_flight:
                    break
                self._gate()  # a frozen process sends no heartbeats
                now = time.monotonic()
                try:
                    if now >= next_beat:
                        self._heartbeat(link.get())
                        next_beat = now + beat_every
                    if now >= next_reap and not self._stop.is_set():
                        self._reap(link.get())
                        next_reap = now + self.reap_interval
                    self._expire()
                    self._time_out(link)
                    # Stopping: completions wait no longer (the grace may end before).
                    self._flush(link, waited=0.0 if self._stop.is_set() else self.flush_after)
                except BaseException as exc:  # the keeper must not die silently either
                    link.drop()
                    if _is_setup_error(exc):
                        self._give_up(exc)  # a wrong setting: retrying cannot mend it
                        return
                    level = logging.WARNING if isinstance(exc, _DISCONNECTS) else logging.ERROR
                    log.log(level, "%s: keeper: %s; reconnecting", self.name, describe(exc))
                    time.sleep(0.1)
                    continue
                # Ticks of at most 0.1 s: a job claimed meanwhile may have a timeout or a
                # local deadline to watch (a tick that sends nothing costs no statement).
                wait = min(0.1, max(0.005, min(next_beat, next_reap) - time.monotonic()))
                if self._buffer:
                    wait = min(wait, self.flush_after / 2)
                if self._stop.is_set():
                    time.sleep(min(wait, 0.05))  # stopping: keep beating for the grace period
                else:
                    self._stop.wait(wait)
            if not self._halted.is_set():
                self._last_flush(link)
        finally:
            link.drop()

    def _last_flush(self, link: _Link) -> None:
        """Complete what is still buffered as the keeper leaves (a lane may have buffered a
        job after the loop's last flush): a finished job must not wait for its lease."""
        try:
            self._flush(link)
        except BaseException as exc:
            log.error("%s: keeper: last flush failed: %s", self.name, describe(exc))

    def _heartbeat(self, queue: Queue) -> None:
        with self._lock:
            held = [(h.job, h.lane) for h in self._in_flight.values() if not h.job.lost]
        if not held:
            return
        lost = {_key(job) for job in queue.heartbeat_many([j for j, _ in held], lease=self.lease)}
        with self._lock:
            # A job finished meanwhile is not lost: its complete/fail event tells how it ended.
            ended = {k for k in lost if k in self._finishing or k not in self._in_flight}
        for job, lane in held:
            if _key(job) in ended:
                continue
            if _key(job) in lost:
                self._record(lane.name, "lease-lost", job)
                log.warning("%s: lost the lease on job %s (fence %s)", lane.name, job.id, job.fence)
            else:
                self._record(lane.name, "heartbeat", job)

    def _expire(self) -> None:
        """Jobs whose lease ran out on this worker's clock are lost, whether or not a
        heartbeat could say so (a keeper cut off from the server cannot)."""
        now = time.monotonic()
        with self._lock:
            expired = [
                h
                for h in self._in_flight.values()
                if now >= h.job.deadline
                and not h.expiry_seen
                and _key(h.job) not in self._finishing
            ]
            for held in expired:
                held.expiry_seen = True
        for held in expired:
            held.job.mark_lost()
            self._record(held.lane.name, "lease-lost", held.job, "lease ran out here")
            log.warning(
                "%s: the lease on job %s ran out before a heartbeat could renew it",
                held.lane.name,
                held.job.id,
            )

    def _time_out(self, link: _Link) -> None:
        """Fail each handler past ``timeout`` (the fence rises: its late writes are refused),
        give back the unstarted jobs of its batch, and start a lane in its place."""
        now = time.monotonic()
        with self._lock:
            late = [
                h
                for h in self._in_flight.values()
                if h.started is not None
                and h.timeout is not None
                and now - h.started > h.timeout
                and _key(h.job) not in self._finishing
                and not h.lane.retired
            ]
            victims: list[tuple[_Held, list[Job], _Lane | None]] = []
            for held in late:
                held.lane.retired = True
                # Its successor is registered in the same breath, so no one ever sees the
                # worker with a lane fewer (a burst run would end there).
                successor = None
                if not self._stop.is_set():
                    successor = _Lane(held.lane.slot, held.lane.generation + 1)
                    self._lanes.append(successor)
                unstarted = [
                    h.job
                    for h in self._in_flight.values()
                    if h.lane is held.lane and h.started is None
                ]
                for job in [held.job, *unstarted]:
                    job.mark_lost()  # under the lock: the old lane cannot start it now
                    self._finishing.add(_key(job))
                victims.append((held, unstarted, successor))
        for held, unstarted, successor in victims:
            lane, job = held.lane, held.job
            self.timed_out += 1
            log.warning(
                "%s: job %s ran past the %gs timeout; failing it%s",
                lane.name,
                job.id,
                held.timeout,
                f" and starting lane {successor.name}" if successor else "",
            )
            error = f"TimeoutError: the handler ran past the {held.timeout:g} s timeout"
            self._finish(link, job, lane, "fail", _Failure(error))
            for sibling in unstarted:
                self._finish(link, sibling, lane, "release")
            # Started only now: its first claim must find the failed and released jobs
            # (a burst worker whose new lane found nothing to claim would end the run).
            if successor is not None:
                self._start_lane(successor)

    def _reap(self, queue: Queue) -> None:
        reaped = queue.reap()
        for row in reaped:
            self.events.record("reap", self.name, row.id, row.fence, row.status)
        if any(row.queue in self.queues and row.status == "ready" for row in reaped):
            self._bell.ring()

    # -- listener: LISTEN/NOTIFY as a wake-up hint ------------------------------------
    def _hear(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                with connect(self.listen_dsn or self.dsn, application_name=self.app_name) as conn:
                    conn.execute("LISTEN pgqueue")
                    delay = 0.05
                    self._bell.ring()  # we may have missed hints while (re)connecting
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if note.payload in self.queues:
                                self._bell.ring()
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("%s: listener reconnecting (%s)", self.name, describe(exc))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
