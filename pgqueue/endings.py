"""Every job's ending, for the engine: complete, fail or release by fence, each retried
across reconnects (the fence makes a retry safe) and, where a reply may have been lost, read
back and judged by ``rules.took_effect``; the completion buffer, flushed as one fenced
``complete_many`` at a time; and the counts of how jobs ended. The engine (``engine.py``)
owns the claims; ``Endings`` owns what happens once a claim's handler has ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import psycopg

from . import rules
from .async_queue import AsyncQueue
from .claims import Claim, Key, key_of
from .errors import ConnectError
from .events import EventLog
from .handlers import Failure, describe
from .inputs import column_text
from .job import Job
from .links import Bell, Link
from .options import WorkerOptions
from .rules import Phase

if TYPE_CHECKING:
    from .metrics import WorkerMetrics

log = logging.getLogger("pgqueue.worker")

FINISH_TRIES = 6  # tries of one complete/fail/release across reconnects


class Owner(Protocol):
    """What the endings read of the engine that owns them (and the claims)."""

    options: WorkerOptions
    phase: Phase
    session_dsn: str
    claims: dict[Key, Claim]
    events: EventLog
    metrics: WorkerMetrics | None
    _final_until: float  # no write is tried past this (monotonic)
    _recording: bool  # whether events are kept (the notebooks draw them)
    _bell: Bell
    _drop: Callable[[Claim], None]  # forget a claim and free its slot
    _wants_jobs: Callable[[], bool]
    _backoff_for: Callable[[Job], float]


class Endings:
    """The endings of one engine's jobs; their counts (``done``, ``failed``, ``dead``,
    ``rejected``, ``gave_up``) are the worker's."""

    def __init__(self, engine: Owner) -> None:
        self.engine = engine
        self.finishing: set[Key] = set()  # claims whose complete/fail/release is under way
        # Finished jobs whose completion waits to go out in one statement, with the time
        # each was added.
        self.buffer: list[tuple[Claim, float]] = []
        self.flusher: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()  # a complete, fail or release under way
        self.link = Link(engine)  # the connection the endings are written on
        self.done = 0  # jobs completed (accepted by fence)
        self.failed = 0  # failed attempts recorded (the job retries or goes dead)
        self.dead = 0  # of those, jobs that went dead
        self.rejected = 0  # late writes the database refused (someone else holds the job)
        self.gave_up = 0  # writes given up after retries, or whose lost reply cannot be told

    def own(self, claim: Claim) -> bool:
        """Take the right to finish the job; False if it is no longer this worker's."""
        key = key_of(claim.job)
        if self.engine.claims.get(key) is not claim or key in self.finishing:
            return False
        if self.engine.phase >= Phase.LEAVING:
            return False
        self.finishing.add(key)
        return True

    def spawn(self, claim: Claim, action: str, failure: Failure | None = None) -> None:
        task = asyncio.create_task(self.finish(claim, action, failure))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self.engine._wants_jobs():
            self.engine._bell.ring()

    async def finish(
        self, claim: Claim, action: str, failure: Failure | None = None, *, tried: bool = False
    ) -> None:
        """complete / fail / release by fence, retried across reconnects (the fence makes a
        retry safe). If a reply may have been lost (a retry, or ``tried``), the row is read
        back to learn whether the write took effect."""
        job = claim.job
        error = failure.error if failure else ""
        outcome = "gave-up"
        for attempt in range(FINISH_TRIES):
            if self.engine.phase >= Phase.HALTED or time.monotonic() >= self.engine._final_until:
                break
            try:
                queue = await self.link.get()
                if action == "complete":
                    ok = await queue.complete(job, claim.result)  # type: ignore[arg-type]
                elif action == "fail":
                    assert failure is not None
                    ok = await queue.fail(
                        job,  # type: ignore[arg-type]
                        error,
                        backoff=self.engine._backoff_for(job),
                        delay=failure.delay,
                        give_up=failure.give_up,
                        traceback=failure.traceback,
                    )
                else:
                    ok = await queue.release(job)  # type: ignore[arg-type]
                took: bool | None = ok
                if not ok and (attempt > 0 or tried):
                    took = await _took_effect(queue, action, job, error)
                outcome = "unknown" if took is None else "ok" if took else "refused"
                break
            except (psycopg.Error, ConnectError) as exc:
                await self.link.drop()
                log.warning(
                    "%s: %s of job %s failed (%s)", claim.lane, action, job.id, describe(exc)
                )
                await asyncio.sleep(0.05 * 2**attempt)
        if self.engine.phase < Phase.HALTED:
            self.settle([claim], action, {key_of(job): outcome}, error)
            if failure is not None and failure.traceback and log.isEnabledFor(logging.DEBUG):
                # The one-line log above says what failed; here is where (-v, or DEBUG).
                log.debug("%s: job %s raised:\n%s", claim.lane, job.id, failure.traceback.rstrip())

    def flush_soon(self) -> None:
        """Start the flusher unless it runs. It completes what is buffered in one fenced
        statement, then again what was buffered meanwhile, until nothing is: one statement
        in flight at a time, so under load each carries every completion that waited."""
        if self.buffer and (self.flusher is None or self.flusher.done()):
            name = f"pgqueue-{self.engine.options.name}-flush"
            self.flusher = asyncio.create_task(self._flush_all(), name=name)

    async def flushed(self) -> None:
        """Wait until every buffered completion went out (stopping)."""
        while self.buffer or (self.flusher is not None and not self.flusher.done()):
            self.flush_soon()
            assert self.flusher is not None
            await asyncio.wait([self.flusher])

    async def _flush_all(self) -> None:
        while self.due() and self.engine.phase < Phase.HALTED:
            try:
                await self.flush()
            except Exception as exc:  # not a lost connection (handled): leave them to lease
                log.error("%s: completing a batch: %s", self.engine.options.name, describe(exc))

    def due(self) -> list[Claim]:
        """The buffered jobs whose completion is due: all of them while stopping, else those
        whose batch is over, or all once the oldest has waited ``flush_after``."""
        now = time.monotonic()
        due = rules.flush_due(
            [now - buffered for _, buffered in self.buffer],
            [claim.batch.left for claim, _ in self.buffer],
            stopping=self.engine.phase >= Phase.STOPPING,
            flush_after=self.engine.options.flush_after,
        )
        return [self.buffer[i][0] for i in due]

    async def flush(self) -> None:
        """Complete the buffered jobs that are due in one fenced statement."""
        claims = self.due()
        if not claims:
            return
        due = set(map(id, claims))
        self.buffer = [(c, t) for c, t in self.buffer if id(c) not in due]
        try:
            queue = await self.link.get()
            jobs, results = [c.job for c in claims], [c.result for c in claims]
            done = await queue.complete_many(jobs, results)  # type: ignore[arg-type]
            rejected = {key_of(j) for j in done}
        except (psycopg.Error, ConnectError):
            await self.link.drop()
            for claim in claims:  # one by one; the batch may have committed before the cut
                await self.finish(claim, "complete", tried=True)
            return
        outcome = {key_of(c.job): "refused" if key_of(c.job) in rejected else "ok" for c in claims}
        self.settle(claims, "complete", outcome)

    def settle(
        self, claims: list[Claim], action: str, outcome: dict[Key, str], error: str = ""
    ) -> None:
        """Forget finished jobs, count them, record how each ended and log what needs a
        person's eyes (failures, refusals, give-ups)."""
        for claim in claims:
            self.engine._drop(claim)
        ends = [(claim, outcome[key_of(claim.job)]) for claim in claims]
        self.rejected += sum(end == "refused" for _, end in ends)
        self.gave_up += sum(end in ("gave-up", "unknown") for _, end in ends)
        ok = [claim.job for claim, end in ends if end == "ok"]
        if ok:
            self.engine._bell.ring()  # a slot of a limited group may be free: claim again now
        if action == "complete":
            self.done += len(ok)
        elif action == "fail":
            self.failed += len(ok)
            self.dead += sum(job.status == "dead" for job in ok)
        if self.engine.metrics is not None:
            self.engine.metrics.settled(action, ends)
        if self.engine._recording:
            self.engine.events.record_many(
                (
                    rules.end_kind(action, end),
                    c.lane,
                    c.job.id,
                    c.job.fence,
                    error if ok else action,
                )
                for c, end in ends
                for ok in [end == "ok"]
            )
        for claim, end in ends:
            _log_end(claim.lane, claim.job, action, end, error)


async def _took_effect(queue: AsyncQueue, action: str, job: Job, error: str) -> bool | None:
    """After a retry, read the job's row back and ask ``rules.took_effect`` whether an
    earlier try committed although its reply was lost (None: cannot be told)."""
    got = await queue.get(job.id)
    row = None if got is None else rules.Row(got.status, got.fence, got.attempts, got.last_error)
    took = rules.took_effect(
        action,  # type: ignore[arg-type]
        rules.Held(job.fence, job.attempts),
        row,
        column_text(error, 10_000),
    )
    if took and row is not None:
        job.status = {"complete": "done", "release": "ready"}.get(
            action, "dead" if row.status == "dead" else "ready"
        )
    return took


def _log_end(lane: str, job: Job, action: str, end: str, error: str) -> None:
    """Log what needs a person's eyes: a refused write, a give-up, a failed attempt."""
    if end == "refused":
        why = f"fence {job.fence} is stale (another holder has it)"
        log.warning("%s: late %s of job %s refused: %s", lane, action, job.id, why)
    elif end == "unknown":
        log.warning(
            "%s: the reply to the %s of job %s was lost, and its row has moved on since "
            "(another claim or write): whether it took effect cannot be told; "
            "`pgqueue show %s` shows where the job is now",
            lane,
            action,
            job.id,
            job.id,
        )
    elif end == "gave-up":
        then = "its lease will run out and the reaper will return it"
        log.warning(
            "%s: gave up on the %s of job %s after %d tries; %s",
            lane,
            action,
            job.id,
            FINISH_TRIES,
            then,
        )
    elif action == "fail":
        then = "now dead" if job.status == "dead" else f"retry in {job.retry_in or 0.0:.1f}s"
        first = error.splitlines()[0] if error else ""
        attempt = f"attempt {job.attempts} of {job.max_attempts}"
        log.warning(
            "%s: job %s (%s) failed, %s: %s; %s", lane, job.id, job.queue, attempt, first, then
        )
