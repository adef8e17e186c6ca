"""How an AsyncWorker runs and ends each job: the job's task, which runs the handler in a
task of its own (cancelled at its timeout) and then fails the job or buffers its
completion; complete, fail and release by fence, retried across reconnects and read back
when a reply was lost; the buffer that sends a batch's completions in one statement; and
the bookkeeping and one-line logs of how each job ended. A mixin of ``AsyncWorker``
(pgqueue/async_worker.py), which owns the state used here.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Any

import psycopg

from .async_job import AsyncJob, ConnectionPool
from .async_keeper import _Bell, _Held, _Lanes, _Link
from .async_queue import AsyncQueue
from .errors import ConnectError, GiveUp, RetryAfter, retry_delay
from .events import EventLog
from .params import _text
from .parts import _FINISH_TRIES, Key, _Failure, _key, describe, end_kind, log, log_end

if TYPE_CHECKING:
    from .async_worker import AsyncHandler
    from .tasks import Tasks


class _Finishing:
    """Each job's task and finishing jobs by fence (mixed into ``AsyncWorker``)."""

    # State owned by AsyncWorker.__init__.
    _in_flight: dict[Key, _Held]
    _finishing: set[Key]
    _running: dict[Key, asyncio.Task[None]]
    _orphans: set[asyncio.Task[Any]]
    _buffer: list[tuple[_Held, float]]
    _flusher: asyncio.Task[None] | None
    _writes: _Link
    _pool: ConnectionPool | None
    _lanes: _Lanes
    _bell: _Bell
    _abandoned: bool
    handler: AsyncHandler | Tasks
    tasks: Tasks | None
    timeout: float | None
    backoff: float
    complete_in_batches: bool
    events: EventLog
    name: str
    done: int
    failed: int
    dead: int
    timed_out: int
    rejected: int
    gave_up: int

    def _record(self, lane: str, kind: str, job: AsyncJob, detail: str = "") -> None:
        """Record an event of a job (AsyncWorker provides it)."""
        raise NotImplementedError

    # -- one job: the handler, then its ending -------------------------------------------
    async def _run_job(self, held: _Held) -> None:
        key = _key(held.job)
        try:
            if self._begin(held):
                failure = await self._call(held)
                if self._own_finish(held):
                    if failure is not None:
                        await self._finish(held, "fail", failure)
                    elif self.complete_in_batches:
                        self._buffer.append((held, time.monotonic()))
                    else:
                        await self._finish(held, "complete")
            held.batch.left -= 1
            if held.batch.left == 0:
                self._flush_soon()  # the batch is over: its completions go now, together
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the bookkeeping failed: leave the job to its lease
            self._forget(held, f"{describe(exc)}")
        finally:
            self._running.pop(key, None)
            self._bell.ring()  # a slot is free

    def _begin(self, held: _Held) -> bool:
        """Mark the job started, unless it was lost (taken over, or its lease ran out here)
        before its turn: running it then could run it twice."""
        key = _key(held.job)
        if self._in_flight.get(key) is not held or key in self._finishing:
            return False
        if not held.job.lost:
            held.started = time.monotonic()
            held.timeout = self._timeout_for(held.job)
            return True
        self._drop(held)
        self._record(held.lane, "skipped", held.job, "lease lost before it started")
        return False

    async def _call(self, held: _Held) -> _Failure | None:
        """Run the handler in a task of its own; None on success, else how it failed. Past
        its timeout the task is cancelled and left to end by itself."""
        job = held.job
        assert self._pool is not None
        job.borrow = self._pool.get
        handler = asyncio.create_task(self._invoke(job), name=f"pgqueue-{held.lane}-handler")
        try:
            done, _ = await asyncio.wait([handler], timeout=held.timeout)
        except asyncio.CancelledError:  # the worker's own cancellation: pass it on
            handler.cancel()
            raise
        if done:
            return _Failure("CancelledError") if handler.cancelled() else handler.result()
        job.mark_lost()  # first: nothing the handler writes from now on is accepted
        handler.cancel()
        self._orphans.add(handler)
        handler.add_done_callback(self._orphans.discard)
        self.timed_out += 1
        log.warning(
            "%s: job %s ran past the %gs timeout; cancelling and failing it",
            held.lane,
            job.id,
            held.timeout,
        )
        return _Failure(f"TimeoutError: the handler ran past the {held.timeout:g} s timeout")

    async def _invoke(self, job: AsyncJob) -> _Failure | None:
        """Await the handler and catch whatever it raises; give back its connection (a
        transaction it left open is rolled back, and fails the job)."""
        failure: _Failure | None = None
        try:
            result = self.handler(job)
            if not inspect.isawaitable(result):
                failure = _Failure(
                    "TypeError: the handler returned no awaitable: AsyncWorker runs async def "
                    "handlers (plain functions run with pgqueue.Worker)"
                )
            elif inspect.isawaitable(result := await result):
                if inspect.iscoroutine(result):
                    result.close()  # never awaited: close it, so Python does not warn later
                failure = _Failure(
                    "TypeError: the handler returned an awaitable instead of awaiting it"
                )
        except GiveUp as exc:
            failure = _Failure(describe(exc), give_up=True)
        except RetryAfter as exc:
            failure = _Failure(describe(exc), delay=retry_delay(exc))
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError too
            failure = _Failure(describe(exc))
        conn, job.conn, job.borrow = job.conn, None, None
        if conn is not None and self._pool is not None and await self._pool.put(conn):
            failure = failure or _Failure("the handler left a transaction open; it was rolled back")
        return failure

    # -- endings: complete, fail, release by fence -------------------------------------
    def _own_finish(self, held: _Held) -> bool:
        """Take the right to finish the job; False if it is no longer this worker's."""
        key = _key(held.job)
        if self._in_flight.get(key) is not held or key in self._finishing or self._abandoned:
            return False
        self._finishing.add(key)
        return True

    def _drop(self, held: _Held) -> None:
        """Forget a held job (ended, skipped or left to its lease) and free its lane."""
        key = _key(held.job)
        if self._in_flight.get(key) is held:
            del self._in_flight[key]
            self._lanes.give(held.slot)
        self._finishing.discard(key)

    def _forget(self, held: _Held, why: str) -> None:
        """Stop heartbeating a job whose bookkeeping failed: its lease runs out and the
        reaper returns it."""
        self._drop(held)
        held.job.mark_lost()
        log.warning("%s: left job %s to its lease after %s", held.lane, held.job.id, why)

    async def _finish(
        self, held: _Held, action: str, failure: _Failure | None = None, *, tried: bool = False
    ) -> None:
        """complete / fail / release by fence, retried across reconnects (the fence makes a
        retry safe). If a reply may have been lost (a retry, or ``tried``), the row is read
        back to learn whether the write took effect."""
        job = held.job
        error = failure.error if failure else ""
        outcome = "gave-up"
        for attempt in range(_FINISH_TRIES):
            try:
                queue = await self._writes.get()
                if action == "complete":
                    ok = await queue.complete(job)
                elif action == "fail":
                    assert failure is not None
                    ok = await queue.fail(
                        job,
                        error,
                        backoff=self._backoff_for(job),
                        delay=failure.delay,
                        give_up=failure.give_up,
                    )
                else:
                    ok = await queue.release(job)
                if not ok and (attempt > 0 or tried):
                    ok = await self._took_effect(queue, action, job, error)
                outcome = "ok" if ok else "refused"
                break
            except (psycopg.Error, ConnectError) as exc:
                await self._writes.drop()
                log.warning(
                    "%s: %s of job %s failed (%s)", held.lane, action, job.id, describe(exc)
                )
                await asyncio.sleep(0.05 * 2**attempt)
        self._settle([held], action, {_key(job): outcome}, error)

    @staticmethod
    async def _took_effect(queue: AsyncQueue, action: str, job: AsyncJob, error: str) -> bool:
        """After a retry, whether an earlier try committed although its reply was lost."""
        row = await queue.get(job.id)
        if row is None:
            return False
        if action == "complete":
            took = row.status == "done" and row.fence == job.fence
        elif action == "fail":
            took = row.fence > job.fence and row.last_error == _text(error, 10_000)
        else:
            took = row.fence == job.fence and row.attempts == job.attempts - 1
        if took:
            job.status = {"complete": "done", "release": "ready"}.get(
                action, "dead" if row.status == "dead" else "ready"
            )
        return took

    def _flush_soon(self) -> None:
        """Start the flusher unless it runs. It completes what is buffered in one fenced
        statement, then again what was buffered meanwhile, until nothing is: one statement
        in flight at a time, so under load each carries every completion that waited."""
        if self._buffer and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.create_task(
                self._flush_all(), name=f"pgqueue-{self.name}-flush"
            )

    async def _flushed(self) -> None:
        """Wait until every buffered completion went out (stopping)."""
        while self._buffer or (self._flusher is not None and not self._flusher.done()):
            self._flush_soon()
            assert self._flusher is not None
            await asyncio.wait([self._flusher])

    async def _flush_all(self) -> None:
        while self._buffer:
            try:
                await self._flush()
            except Exception as exc:  # not a lost connection (handled): leave them to lease
                log.error("%s: completing a batch: %s", self.name, describe(exc))

    async def _flush(self) -> None:
        """Complete every buffered job in one fenced statement."""
        helds = [held for held, _ in self._buffer]
        self._buffer = []
        try:
            queue = await self._writes.get()
            rejected = {_key(j) for j in await queue.complete_many([h.job for h in helds])}
        except (psycopg.Error, ConnectError):
            await self._writes.drop()
            for held in helds:  # one by one; the batch may have committed before the cut
                await self._finish(held, "complete", tried=True)
            return
        outcome = {_key(h.job): "refused" if _key(h.job) in rejected else "ok" for h in helds}
        self._settle(helds, "complete", outcome)

    def _settle(
        self, helds: list[_Held], action: str, outcome: dict[Key, str], error: str = ""
    ) -> None:
        """Forget finished jobs, count them, record how each ended and log what needs a
        person's eyes (failures, refusals, give-ups)."""
        for held in helds:
            self._drop(held)
        ends = [(held, outcome[_key(held.job)]) for held in helds]
        self._tally(action, [(held.job, end) for held, end in ends])
        self.events.record_many(
            (end_kind(action, end), h.lane, h.job.id, h.job.fence, error if end == "ok" else action)
            for h, end in ends
        )
        for held, end in ends:
            log_end(held.lane, held.job, action, end, error)
