"""``AsyncWorker``: coroutine handlers on one event loop, with the threaded Worker's promises.

Tasks on one loop, each statement on a connection of its own task's:
- a dispatcher claims a batch (one short statement) whenever a handler slot is free and no
  claimed job waits, and starts a task per job, at most ``concurrency`` at once. The jobs
  of a batch beyond the free slots wait their turn, and one whose lease ran out
  meanwhile is skipped, not run;
- each job's task runs the handler in a task of its own (outside any transaction), so a
  ``timeout`` can cancel it and fail the job at once (the fence rises: whatever the
  handler writes while it unwinds is refused), then fails the job or buffers its
  completion: one fenced ``complete_many`` when its batch is over, or sooner once the
  oldest buffered job has waited ``flush_after``;
- a keeper heartbeats every held job at lease/3, runs the reaper, marks jobs whose lease
  ran out on this worker's clock as lost, and flushes completions that waited too long;
- a listener (optional): LISTEN pgqueue wakes the dispatcher; polling goes on anyway.

Connections: the dispatcher's claims, the finishing writes and the keeper each use one;
handlers get one only when they ask (``await job.connection()``, ``job.fenced_write``),
from a pool of at most ``connections``, and keep it until they return. Five hundred
handlers awaiting I/O need no connection, and a server's max_connections bounds only
those that write at once. A handler that blocks the loop (``time.sleep``, long CPU work)
freezes the whole worker, heartbeats included, like a SIGSTOP: its leases run out and
the fence refuses its late writes. Await, or move such work to ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import inspect
import logging
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from .async_job import AsyncJob, ConnectionPool
from .async_queue import AsyncQueue, async_connect
from .db import describe_dsn, pgbouncer_mode, resolve_dsn
from .errors import BadInput, ConnectError, GiveUp, RetryAfter
from .events import EventLog, NullEventLog
from .queue import MAX_BACKOFF, MAX_LEASE, _lease, _seconds, _text, queue_names
from .tasks import Tasks
from .worker import _Failure, describe

log = logging.getLogger("pgqueue.worker")

AsyncHandler = Callable[[AsyncJob], Awaitable[Any]]
Key = tuple[int, int]  # (job id, fence): one claim of one job
_DISCONNECTS = (psycopg.OperationalError, psycopg.InterfaceError, ConnectError)
_FINISH_TRIES = 6


def is_async_handler(handler: object) -> bool:
    """Whether ``handler`` is for the AsyncWorker: a coroutine function (or an object whose
    ``__call__`` is one), or a ``Tasks`` registry whose every task is."""
    if isinstance(handler, Tasks):
        return bool(handler.tasks) and all(
            _coroutine_function(t.fn) for t in handler.tasks.values()
        )
    return _coroutine_function(handler)


def _coroutine_function(fn: object) -> bool:
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _key(job: AsyncJob) -> Key:
    return (job.id, job.fence)


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


class AsyncWorker:
    """Run ``await handler(job)`` for jobs of ``queue``, ``concurrency`` at once, on this
    event loop: the threaded ``Worker``'s arguments, counters and guarantees.

    ``await run()`` until SIGINT/SIGTERM (or, with ``burst=True``, until no runnable job is
    left); ``await start()`` and ``await stop()`` for notebooks and applications with a loop
    of their own. Whatever a handler raises (``BaseException`` too) fails its job; with
    ``timeout`` a handler running longer is cancelled and its job failed. Given a
    ``pgqueue.Tasks`` registry of ``async def`` tasks, it runs every task's queue with each
    task's own timeout and backoff. ``connections``: at most that many connections lent
    to handlers at once (default ``min(concurrency, 10)``).
    """

    def __init__(
        self,
        handler: AsyncHandler | Tasks,
        *,
        queue: str | Sequence[str] | None = None,
        dsn: str | None = None,
        concurrency: int = 1,
        batch: int = 1,
        lease: float = 30.0,
        poll_interval: float = 2.0,
        listen: bool = True,
        listen_dsn: str | None = None,
        pgbouncer: bool | None = None,
        reap_interval: float = 5.0,
        backoff: float = 1.0,
        timeout: float | None = None,
        complete_in_batches: bool = True,
        flush_after: float = 0.05,
        connections: int | None = None,
        burst: bool = False,
        name: str = "worker",
        events: EventLog | None = None,
        record_events: bool = True,
    ) -> None:
        for what, value, upper in (
            ("concurrency", concurrency, 100_000),
            ("batch", batch, 10_000),
            ("connections", 1 if connections is None else connections, 10_000),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
                raise BadInput(f"{what} must be a whole number from 1 to {upper}, got {value!r}")
        for what, value in (("poll_interval", poll_interval), ("reap_interval", reap_interval)):
            if not isinstance(value, int | float) or not 0 < value < 1e6:
                raise BadInput(f"{what} must be a positive number of seconds, got {value!r}")
        if timeout is not None and not _seconds("timeout", timeout, upper=MAX_LEASE) > 0:
            raise BadInput("timeout must be more than 0 seconds (or None for no timeout)")
        self.tasks = handler if isinstance(handler, Tasks) else None
        if self.tasks is None and not _coroutine_function(handler):
            raise BadInput(
                f"handler must be an async def function for AsyncWorker, got {handler!r}: "
                "run plain functions with pgqueue.Worker"
            )
        if queue is None:
            queue = (self.tasks.queues or ["default"]) if self.tasks else "default"
        self.queues = queue_names(queue)
        _lease(lease)
        _seconds("backoff", backoff, upper=MAX_BACKOFF)
        self.handler = handler
        self.queue = self.queues[0] if len(self.queues) == 1 else self.queues
        self.dsn = resolve_dsn(dsn)
        self.pgbouncer = pgbouncer_mode(pgbouncer)
        self.listen_dsn = listen_dsn
        self.concurrency = concurrency
        self.batch = batch
        self.lease = float(lease)
        self.poll_interval = float(poll_interval)
        self.listen = listen
        self.reap_interval = float(reap_interval)
        self.backoff = backoff
        self.timeout = None if timeout is None else float(timeout)
        self.complete_in_batches = complete_in_batches
        self.flush_after = _seconds("flush_after", flush_after, upper=60.0)
        self.connections = min(concurrency, 10) if connections is None else connections
        self.burst = burst
        self.name = name
        self.events = events if events is not None else EventLog()
        if not record_events:
            self.events = NullEventLog()
        self.app_name = f"pgqueue worker {name}"  # how its sessions show in pg_stat_activity
        self.done = 0  # jobs this worker completed (accepted by fence)
        self.failed = 0  # failed attempts recorded (the job retries or goes dead)
        self.dead = 0  # of those, jobs that went dead
        self.timed_out = 0  # handlers failed for running past ``timeout``
        self.rejected = 0  # late writes the database refused (someone else holds the job)
        self.gave_up = 0  # writes given up after retries (the lease runs out; reaper returns)

        self._bell = _Bell()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()  # a second signal: do not wait for the grace period
        self._abandoned = False  # grace is over: write nothing more
        self._lanes = _Lanes(name, single=concurrency == 1 and batch == 1)
        self._in_flight: dict[Key, _Held] = {}
        self._finishing: set[Key] = set()  # claims whose complete/fail/release is under way
        self._waiting: deque[_Held] = deque()  # claimed, not started
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._orphans: set[asyncio.Task[Any]] = set()  # handlers cancelled at their timeout
        # Finished jobs whose completion waits to go out in one statement, with the time
        # each was added: flushed when their batch is over, or by the keeper once the
        # oldest has waited flush_after (so a fast job is not held behind a slow sibling).
        self._buffer: list[tuple[_Held, float]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._claims = _Link(self)
        self._writes = _Link(self)
        self._pool: ConnectionPool | None = None
        self._tasks: list[asyncio.Task[None]] = []  # dispatcher, keeper, listener
        self._closed = False
        self._stopping: asyncio.Future[None] | None = None

    # -- control ---------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def in_flight(self) -> list[AsyncJob]:
        """Jobs claimed and not yet finished by this worker."""
        return [held.job for held in self._in_flight.values()]

    async def start(self) -> AsyncWorker:
        """Check the database (a bad DSN or a missing table fails here), start the tasks on
        the running loop and return."""
        if self._tasks:
            raise RuntimeError(f"worker {self.name} was already started")
        if self.tasks is not None and (plain := self._plain_tasks()):
            raise BadInput(
                f"tasks {', '.join(plain)} are plain functions: AsyncWorker runs async def "
                "tasks (run plain ones with pgqueue.Worker)"
            )
        async with AsyncQueue(self.dsn, pgbouncer=self.pgbouncer) as probe:
            await probe.check()
        log.info(
            "%s: %s; queues %s; %d handlers at once, batch %d, lease %gs (asyncio)",
            self.name,
            describe_dsn(self.dsn),
            ", ".join(self.queues),
            self.concurrency,
            self.batch,
            self.lease,
        )
        self._pool = ConnectionPool(self.connections, self._connect)
        self._tasks.append(asyncio.create_task(self._dispatch(), name=f"pgqueue-{self.name}"))
        self._tasks.append(asyncio.create_task(self._keep(), name=f"pgqueue-{self.name}-keeper"))
        if self.listen and self.pgbouncer and not self.listen_dsn:
            log.warning(
                "%s: behind PgBouncer LISTEN needs a direct connection (listen_dsn, "
                "--listen-dsn); polling every %gs instead",
                self.name,
                self.poll_interval,
            )
        elif self.listen:
            self._tasks.append(
                asyncio.create_task(self._hear(), name=f"pgqueue-{self.name}-listen")
            )
        return self

    async def _connect(self) -> psycopg.AsyncConnection:
        return await async_connect(
            self.dsn, application_name=self.app_name, pgbouncer=self.pgbouncer
        )

    def _plain_tasks(self) -> list[str]:
        assert self.tasks is not None
        return [t.name for t in self.tasks.tasks.values() if not _coroutine_function(t.fn)]

    async def join(self, timeout: float | None = None) -> None:
        """Wait for the dispatcher and its handlers to end (with ``burst=True``: the queue
        ran dry), at most ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._working():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            await asyncio.wait(self._tasks[:1] + list(self._running.values()), timeout=left)

    def _working(self) -> bool:
        return bool(self._tasks) and (not self._tasks[0].done() or bool(self._running))

    async def stop(self, grace: float = 10.0) -> None:
        """Stop claiming; let running handlers finish within ``grace`` seconds and complete
        their jobs. Claimed jobs not yet started are released; handlers still running after
        that are cancelled and their jobs left to their leases (the reaper returns them).
        A second caller waits for the first one's stop."""
        if not self._tasks:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shut_down(grace))
        await asyncio.shield(self._stopping)

    async def _shut_down(self, grace: float) -> None:
        self._stop.set()
        self._bell.ring()
        deadline = time.monotonic() + grace
        while self._working() and not self._force.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(
                self._tasks[:1] + list(self._running.values()), timeout=min(left, 0.1)
            )
        await self._flushed()
        self._abandoned = True
        self._closed = True
        doomed = [*self._tasks, *self._running.values()]
        if self._flusher is not None:
            doomed.append(self._flusher)
        for task in doomed:
            task.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
        await self._claims.drop()
        await self._writes.drop()

    async def run(self, grace: float = 10.0) -> None:
        """Work until SIGINT/SIGTERM (or a dry queue with ``burst``), then stop gracefully; a
        second signal stops at once. On the main thread the signals are this worker's for
        the run (``loop.add_signal_handler``); the previous handlers are restored after."""
        loop = asyncio.get_running_loop()
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                before = signal.getsignal(sig)
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(sig, self._on_signal)
                    previous[sig] = before
        try:
            await self.start()
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait([stopped, self._tasks[0]], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not self._stop.is_set():  # burst: the dispatcher found the queue dry
                await self.join()
            await self.stop(grace)
        finally:
            if not self._closed:  # cancelled: stop now; unfinished jobs' leases run out
                self._force.set()
                await asyncio.shield(self.stop(0.0))
            for sig, before in previous.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, before if before is not None else signal.SIG_DFL)

    def _on_signal(self) -> None:
        if self._stop.is_set():
            self._force.set()
            log.warning("%s: second signal: stopping now, without waiting for handlers", self.name)
        else:
            log.warning("%s: stopping after the running handlers (again to force)", self.name)
        self._stop.set()
        self._bell.ring()

    # -- seam: a no-op here; tests use it to stop between a claim and its handlers ----------
    async def _after_claim(self, jobs: list[AsyncJob]) -> None:
        """Called with each claimed batch, before any of it runs."""

    # -- the dispatcher: claims, and a task per job ------------------------------------
    def _record(self, lane: str, kind: str, job: AsyncJob, detail: str = "") -> None:
        self.events.record(kind, lane, job.id, job.fence, detail)

    async def _dispatch(self) -> None:
        """Claim and start jobs until stopped (or a dry queue in burst mode); an error is
        logged and the dispatcher carries on after a backoff. Then release what waits."""
        delay = 0.05
        while not self._stop.is_set():
            try:
                if not await self._dispatch_once():
                    break
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._claims.drop()
                if self._stop.is_set():
                    break
                level = logging.WARNING if isinstance(exc, _DISCONNECTS) else logging.ERROR
                log.log(level, "%s: %s; carrying on in %.1fs", self.name, describe(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        while self._waiting:  # claimed, never started: give them back, attempts too
            held = self._waiting.popleft()
            if self._own_finish(held):
                await self._finish(held, "release")

    async def _dispatch_once(self) -> bool:
        """Start waiting jobs, or claim a batch when a slot is free; False when a burst
        worker found the queue dry with nothing running."""
        seen = self._bell.generation
        self._start_waiting()
        if self._waiting or len(self._running) >= self.concurrency:
            await self._bell.wait(seen, self.poll_interval)  # a handler ends, or a stop
            return True
        queue = await self._claims.get()
        jobs = await queue.claim(self.queues, limit=self.batch, lease=self.lease)
        if not jobs:
            if self.burst and not self._running:
                return False
            await self._bell.wait(seen, self.poll_interval)
            return True
        self._take(jobs)
        await self._after_claim(jobs)
        self._start_waiting()
        return True

    def _take(self, jobs: list[AsyncJob]) -> None:
        batch = _Batch(len(jobs))
        rows = []
        for job in jobs:
            slot, lane = self._lanes.take()
            held = _Held(job, slot, lane, batch)
            self._in_flight[_key(job)] = held
            self._waiting.append(held)
            job.conn = None  # the claim's connection is the dispatcher's; handlers borrow
            job.on_event = functools.partial(self._record, lane)
            rows.append(("claim", lane, job.id, job.fence, str(job.attempts)))
        self.events.record_many(rows)

    def _start_waiting(self) -> None:
        while self._waiting and len(self._running) < self.concurrency:
            if self._stop.is_set():
                return
            held = self._waiting.popleft()
            task = asyncio.create_task(self._run_job(held), name=f"pgqueue-{held.lane}")
            self._running[_key(held.job)] = task

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
            failure = _Failure(describe(exc), delay=exc.seconds)
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError too
            failure = _Failure(describe(exc))
        conn, job.conn, job.borrow = job.conn, None, None
        if conn is not None and self._pool is not None and await self._pool.put(conn):
            failure = failure or _Failure("the handler left a transaction open; it was rolled back")
        return failure

    def _timeout_for(self, job: AsyncJob) -> float | None:
        task = self._task_of(job)
        return task.timeout if task and task.timeout is not None else self.timeout

    def _backoff_for(self, job: AsyncJob) -> float:
        task = self._task_of(job)
        return task.backoff if task and task.backoff is not None else self.backoff

    def _task_of(self, job: AsyncJob) -> Any:
        if self.tasks is None:
            return None
        try:
            return self.tasks.for_job(job)
        except LookupError:
            return None

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
        ok = [held.job for held, end in ends if end == "ok"]
        self.rejected += sum(end == "refused" for _, end in ends)
        self.gave_up += sum(end == "gave-up" for _, end in ends)
        if action == "complete":
            self.done += len(ok)
        elif action == "fail":
            self.failed += len(ok)
            self.dead += sum(job.status == "dead" for job in ok)
        kinds = {"ok": action, "refused": f"{action}-rejected", "gave-up": "gave-up"}
        self.events.record_many(
            (kinds[end], h.lane, h.job.id, h.job.fence, error if end == "ok" else action)
            for h, end in ends
        )
        for held, end in ends:
            self._log_end(held, action, end, error)

    def _log_end(self, held: _Held, action: str, end: str, error: str) -> None:
        job = held.job
        if end == "refused":
            log.warning(
                "%s: late %s of job %s refused: fence %s is stale (another holder has it)",
                held.lane,
                action,
                job.id,
                job.fence,
            )
        elif end == "gave-up":
            log.warning(
                "%s: gave up on the %s of job %s after %d tries; its lease will run out "
                "and the reaper will return it",
                held.lane,
                action,
                job.id,
                _FINISH_TRIES,
            )
        elif action == "fail":
            then = "now dead" if job.status == "dead" else f"retry in {job.retry_in or 0.0:.1f}s"
            log.warning(
                "%s: job %s (%s) failed, attempt %d of %d: %s; %s",
                held.lane,
                job.id,
                job.queue,
                job.attempts,
                job.max_attempts,
                error.splitlines()[0] if error else "",
                then,
            )

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
