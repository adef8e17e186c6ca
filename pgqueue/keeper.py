"""The keeper: one task of the engine's, on a connection of its own, that heartbeats every
held job (``heartbeat_many`` every ``rules.beat_every(lease)``), marks a job lost when its
lease ran out on this worker's clock (``rules.expired``), fails a handler past its timeout at
once (``rules.late``), and sends completions that waited ``flush_after``. It never waits
behind a handler, the reaper or a locked row: each heartbeat is a task of its own, and the
statement skips locked rows."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import rules
from .async_queue import AsyncQueue
from .claims import Claim, Key, key_of
from .endings import Endings
from .events import EventLog
from .handlers import Failure, describe
from .job import Job
from .links import DISCONNECTS, Link
from .options import WorkerOptions
from .rules import Phase

log = logging.getLogger("pgqueue.worker")


class Owner(Protocol):
    """What the keeper reads and calls of the engine that owns it and the claims."""

    options: WorkerOptions
    phase: Phase
    session_dsn: str
    claims: dict[Key, Claim]
    ends: Endings
    events: EventLog
    seams: Any  # the course's FaultyWorker freezes a worker here (engine.Seams)
    _plain: Any  # the plain lanes (lanes.PlainLanes), or None
    _running: dict[Claim, asyncio.Task[None]]  # async jobs, a task each
    _broken_setup: Callable[[BaseException], Any]  # an awaitable: give up for good?
    _record: Callable[[str, str, Job, str], None]
    _give_back_slot: Callable[[], None]
    _slot_freed: Callable[[], None]
    _count_down: Callable[[Claim], None]
    _timed_out: Callable[[Claim], Failure]


class Keeper:
    """The keeper of one engine's claims (see the module's docstring)."""

    def __init__(self, engine: Owner) -> None:
        self.engine = engine

    async def run(self) -> None:
        link = Link(self.engine)
        beat_every = rules.beat_every(self.engine.options.lease)
        next_beat = time.monotonic() + beat_every
        # Each heartbeat is a task of its own: a statement stuck on a half-open connection
        # holds up neither the local deadlines nor the timed flushes of this loop.
        beating: asyncio.Task[None] | None = None
        try:
            while self.engine.phase < Phase.LEAVING:
                if self.engine.phase == Phase.STOPPING and not self.engine.claims:
                    break
                self.engine.seams._gate()  # a frozen process sends no heartbeats
                now = time.monotonic()
                try:
                    if now >= next_beat and (beating is None or beating.done()):
                        if beating is not None:
                            beating.result()  # how the last one ended: raises its error
                        beating = asyncio.create_task(self.beat(link))
                        next_beat = now + beat_every
                    self.expire()
                    self.time_out()
                    waited = (
                        0.0
                        if self.engine.phase == Phase.STOPPING
                        else self.engine.options.flush_after
                    )
                    if self.engine.ends.buffer and now - self.engine.ends.buffer[0][1] >= waited:
                        self.engine.ends.flush_soon()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the keeper must not die silently either
                    beating = None
                    await link.drop()
                    if await self.engine._broken_setup(exc):
                        return
                    level = logging.WARNING if isinstance(exc, DISCONNECTS) else logging.ERROR
                    name = self.engine.options.name
                    log.log(level, "%s: keeper: %s; reconnecting", name, describe(exc))
                    await asyncio.sleep(0.1)
                    continue
                # Ticks of at most 0.1 s: a job claimed meanwhile may have a local deadline
                # to watch (a tick that sends nothing costs no statement).
                wait = min(0.1, max(0.005, next_beat - time.monotonic()))
                if self.engine.ends.buffer:
                    wait = min(wait, self.engine.options.flush_after / 2)
                await asyncio.sleep(wait)
        finally:
            if beating is not None:
                beating.cancel()
                await asyncio.gather(beating, return_exceptions=True)
            await link.drop()

    async def beat(self, link: Link) -> None:
        await self.heartbeat(await link.get())

    async def heartbeat(self, queue: AsyncQueue) -> None:
        held = [c for c in self.engine.claims.values() if not c.job.lost]
        if not held:
            return
        jobs = [c.job for c in held]
        lost = {
            key_of(j) for j in await queue.heartbeat_many(jobs, lease=self.engine.options.lease)
        }  # type: ignore[arg-type]
        if self.engine.phase >= Phase.HALTED:
            return
        rows = []
        for c in held:
            key = key_of(c.job)
            if key not in lost:
                rows.append(("heartbeat", c.lane, c.job.id, c.job.fence, ""))
            elif key not in self.engine.ends.finishing and self.engine.claims.get(key) is c:
                # (a job finished meanwhile is not lost: its ending tells how it went)
                rows.append(("lease-lost", c.lane, c.job.id, c.job.fence, ""))
                log.warning(
                    "%s: lost the lease on job %s (fence %s)", c.lane, c.job.id, c.job.fence
                )
        self.engine.events.record_many(rows)

    def expire(self) -> None:
        """Jobs whose lease ran out on this worker's clock are lost, whether or not a
        heartbeat could say so (a keeper cut off from the server cannot)."""
        now = time.monotonic()
        for claim in list(self.engine.claims.values()):
            job = claim.job
            seen = claim.expiry_seen or key_of(job) in self.engine.ends.finishing
            if seen or not rules.expired(job.deadline, now):
                continue
            claim.expiry_seen = True
            job.mark_lost()
            self.engine._record(claim.lane, "lease-lost", job, "lease ran out here")
            log.warning(
                "%s: the lease on job %s ran out before a heartbeat could renew it",
                claim.lane,
                job.id,
            )

    def time_out(self) -> None:
        """Fail each job whose handler ran past its timeout at once (the fence rises, so
        its late writes are refused) and free its slot: a coroutine is cancelled, a hung
        lane retired (a new one takes its place; the thread ends when its handler does)."""
        now = time.monotonic()
        for claim, task in list(self.engine._running.items()):
            if rules.late(claim.started, claim.timeout, now) and not claim.timed_out:
                claim.timed_out = True
                task.cancel()
                self.engine._give_back_slot()
                self.fail_late(claim)
        for lane, claim in self.engine._plain.running() if self.engine._plain is not None else []:
            if rules.late(claim.started, claim.timeout, now) and self.engine._plain.retire(
                lane, claim
            ):
                self.fail_late(claim)

    def fail_late(self, claim: Claim) -> None:
        claim.job.mark_lost()  # first: nothing the handler writes from now on counts
        failure = self.engine._timed_out(claim)
        if self.engine.ends.own(claim):
            self.engine.ends.spawn(claim, "fail", failure)
        self.engine._count_down(claim)
        self.engine._slot_freed()
