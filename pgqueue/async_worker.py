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

This module holds the AsyncWorker's options, its control (start, stop, run, signals) and
its dispatcher; ``async_finishing.py`` each job's task and how jobs are finished by fence,
``async_keeper.py`` the keeper and listener tasks and the small pieces the tasks share.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg

from .async_finishing import _Finishing
from .async_job import AsyncJob, ConnectionPool
from .async_keeper import _Batch, _Bell, _Held, _Keeping, _Lanes, _Link
from .async_queue import AsyncQueue, async_connect
from .db import describe_dsn
from .errors import BadInput
from .events import EventLog
from .parts import _DISCONNECTS, Key, _key, _TaskRules, describe, log
from .tasks import Tasks

AsyncHandler = Callable[[AsyncJob], Awaitable[Any]]


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


class AsyncWorker(_TaskRules, _Finishing, _Keeping):
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
        if not isinstance(handler, Tasks) and not _coroutine_function(handler):
            raise BadInput(
                f"handler must be an async def function for AsyncWorker, got {handler!r}: "
                "run plain functions with pgqueue.Worker"
            )
        self._take_options(
            handler,
            queue=queue,
            dsn=dsn,
            concurrency=concurrency,
            batch=batch,
            lease=lease,
            poll_interval=poll_interval,
            listen=listen,
            listen_dsn=listen_dsn,
            pgbouncer=pgbouncer,
            reap_interval=reap_interval,
            backoff=backoff,
            timeout=timeout,
            complete_in_batches=complete_in_batches,
            flush_after=flush_after,
            burst=burst,
            name=name,
            events=events,
            record_events=record_events,
        )
        self.connections = min(concurrency, 10) if connections is None else connections

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
