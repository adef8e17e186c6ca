"""How an AsyncWorker keeps its leases: the keeper task (heartbeats at lease/3, the reaper,
local lease deadlines, timed flushes of the completion buffer) and the listener task
(LISTEN as a wake-up hint); with the small pieces the worker's tasks share: a held job
and its key, its batch and lane name, the bell that wakes the dispatcher, and a
connection that reopens itself. A mixin of ``AsyncWorker`` (pgqueue/async_worker.py),
which owns the state used here.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .async_job import AsyncJob
from .async_queue import AsyncQueue, async_connect
from .errors import ConnectError
from .events import EventLog
from .parts import _DISCONNECTS, Key, _key, describe, log

if TYPE_CHECKING:
    from .async_worker import AsyncWorker


class _Bell:
    """Wakes the dispatcher; the generation number closes the claim-then-wait race."""

    def __init__(self) -> None:
        self.generation = 0
        self._event: asyncio.Event | None = None

    def ring(self) -> None:
        self.generation += 1
        if self._event is not None:
            self._event.set()

    async def wait(self, seen: int, timeout: float) -> None:
        if self.generation != seen:
            return
        if self._event is None:
            self._event = asyncio.Event()
        self._event.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


class _Link:
    """One task's connection, reopened with capped exponential backoff when it drops."""

    def __init__(self, worker: AsyncWorker) -> None:
        self.worker = worker
        self.queue: AsyncQueue | None = None
        self._opening: asyncio.Lock | None = None

    async def get(self) -> AsyncQueue:
        if self.queue is not None:
            return self.queue
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # tasks sharing a link open one connection, not several
            delay = 0.05
            while self.queue is None:
                w = self.worker
                try:
                    self.queue = await AsyncQueue(
                        w.dsn, application_name=w.app_name, pgbouncer=w.pgbouncer
                    ).open()
                except ConnectError as exc:
                    if w.stopping:
                        raise
                    log.warning("%s: %s; retrying in %.1fs", w.name, exc, delay)
                    await asyncio.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 2.0)
        return self.queue

    async def drop(self) -> None:
        queue, self.queue = self.queue, None
        if queue is not None:
            with contextlib.suppress(Exception):  # already broken; nothing to release
                await queue.close()


class _Lanes:
    """Lane names for events and logs: the lowest free number for each held job."""

    def __init__(self, name: str, single: bool) -> None:
        self.name = name
        self.single = single
        self._free: list[int] = []
        self._next = 1

    def take(self) -> tuple[int, str]:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._next = self._next, self._next + 1
        return slot, self.name if self.single else f"{self.name}.{slot}"

    def give(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


@dataclass(eq=False)
class _Batch:
    left: int  # jobs of one claim whose handlers have not ended yet


@dataclass(eq=False)
class _Held:
    """A claimed job this worker has not finished: its lane, batch, and when it began."""

    job: AsyncJob
    slot: int
    lane: str
    batch: _Batch
    started: float | None = None  # time.monotonic() when the handler began
    timeout: float | None = None  # this job's (its task's, else the worker's)
    expiry_seen: bool = False  # the keeper has reported its lease running out here


class _Keeping:
    """Heartbeats, the reaper, deadlines and LISTEN (mixed into ``AsyncWorker``)."""

    # State owned by AsyncWorker.__init__.
    _in_flight: dict[Key, _Held]
    _finishing: set[Key]
    _buffer: list[tuple[_Held, float]]
    _bell: _Bell
    _stop: asyncio.Event
    _abandoned: bool
    events: EventLog
    name: str
    app_name: str
    dsn: str
    listen_dsn: str | None
    lease: float
    reap_interval: float
    flush_after: float
    queues: list[str]
    # (``_flush_soon``, which sends the buffered completions, is ``_Finishing``'s.)

    def _record(self, lane: str, kind: str, job: AsyncJob, detail: str = "") -> None:
        """Record an event of a job (AsyncWorker provides it)."""
        raise NotImplementedError

    # -- keeper: heartbeats, the reaper, local deadlines, late flushes -----------------
    async def _keep(self) -> None:
        link = _Link(self)
        beat_every = self.lease / 3
        next_beat = time.monotonic() + beat_every
        next_reap = time.monotonic() + self.reap_interval * random.uniform(0.5, 1.0)
        try:
            while not self._abandoned:
                if self._stop.is_set() and not self._in_flight:
                    break
                now = time.monotonic()
                try:
                    if now >= next_beat:
                        await self._heartbeat(await link.get())
                        next_beat = now + beat_every
                    if now >= next_reap and not self._stop.is_set():
                        await self._reap(await link.get())
                        next_reap = now + self.reap_interval
                    self._expire()
                    if self._buffer and now - self._buffer[0][1] >= self.flush_after:
                        self._flush_soon()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the keeper must not die silently either
                    await link.drop()
                    level = logging.WARNING if isinstance(exc, _DISCONNECTS) else logging.ERROR
                    log.log(level, "%s: keeper: %s; reconnecting", self.name, describe(exc))
                    await asyncio.sleep(0.1)
                    continue
                wait = min(0.1, max(0.005, min(next_beat, next_reap) - time.monotonic()))
                if self._buffer:
                    wait = min(wait, self.flush_after / 2)
                await asyncio.sleep(wait)
        finally:
            await link.drop()

    async def _heartbeat(self, queue: AsyncQueue) -> None:
        held = [h for h in self._in_flight.values() if not h.job.lost]
        if not held:
            return
        lost = {
            _key(j) for j in await queue.heartbeat_many([h.job for h in held], lease=self.lease)
        }
        rows = []
        for h in held:
            key = _key(h.job)
            if key not in lost:
                rows.append(("heartbeat", h.lane, h.job.id, h.job.fence, ""))
            elif key not in self._finishing and self._in_flight.get(key) is h:
                # (a job finished meanwhile is not lost: its ending tells how it went)
                rows.append(("lease-lost", h.lane, h.job.id, h.job.fence, ""))
                log.warning(
                    "%s: lost the lease on job %s (fence %s)", h.lane, h.job.id, h.job.fence
                )
        self.events.record_many(rows)

    def _expire(self) -> None:
        """Jobs whose lease ran out on this worker's clock are lost, whether or not a
        heartbeat could say so (a keeper cut off from the server cannot)."""
        now = time.monotonic()
        for held in list(self._in_flight.values()):
            job = held.job
            if now < job.deadline or held.expiry_seen or _key(job) in self._finishing:
                continue
            held.expiry_seen = True
            job.mark_lost()
            self._record(held.lane, "lease-lost", job, "lease ran out here")
            log.warning(
                "%s: the lease on job %s ran out before a heartbeat could renew it",
                held.lane,
                job.id,
            )

    async def _reap(self, queue: AsyncQueue) -> None:
        reaped = await queue.reap()
        self.events.record_many(("reap", self.name, r.id, r.fence, r.status) for r in reaped)
        if any(row.queue in self.queues and row.status == "ready" for row in reaped):
            self._bell.ring()

    # -- listener: LISTEN/NOTIFY as a wake-up hint ------------------------------------
    async def _hear(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                dsn = self.listen_dsn or self.dsn
                async with await async_connect(dsn, application_name=self.app_name) as conn:
                    await conn.execute("LISTEN pgqueue")
                    delay = 0.05
                    self._bell.ring()  # we may have missed hints while (re)connecting
                    while not self._stop.is_set():
                        async for note in conn.notifies(timeout=1.0):
                            if note.payload in self.queues:
                                self._bell.ring()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("%s: listener reconnecting (%s)", self.name, describe(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
