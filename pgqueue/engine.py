"""The worker engine: one program under ``Worker`` and ``AsyncWorker``, on one event loop.

Tasks on the loop, each on a connection of the engine's own (never lent to a handler):
- the dispatcher claims a batch whenever a handler slot is free and no claimed job
  waits (or, under a backlog, ahead), for all lanes, at most ``concurrency`` running at
  once; a job whose lease ran out while it waited is skipped, not run. On the same
  connection, a task of its own reaps every ``reap_interval`` (SKIP LOCKED: it never waits
  for a row somebody holds), and another ticks the periodic tasks about once a second;
- each job runs its handler outside any transaction: an ``async def`` one as a task on
  this loop, a plain one on a lane thread (``lanes.PlainLanes``). Past its timeout the job
  is marked lost (its handler's late writes are refused here) and failed at once (the fence
  rises), a coroutine is cancelled and a hung thread retired. Then the job is failed, or
  its completion buffered: one fenced ``complete_many`` on the finisher's connection when
  its batch is over, or sooner once the oldest buffered job has waited ``flush_after``;
- the keeper heartbeats every held job at lease/3 on a connection of its own, marks jobs
  whose lease ran out on this clock as lost, and flushes completions that waited;
- the listener (optional): LISTEN pgqueue wakes the dispatcher; polling goes on anyway.

A stop gives back every claimed job not yet started at once, waits ``grace`` for running
handlers, then sends the last completions within ``FINAL_WRITES`` seconds and leaves the
rest to their leases (at-least-once). ``Worker`` runs this loop on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import inspect
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg import conninfo

from . import periodic, rules, tracing
from .async_job import AsyncJob
from .async_queue import AsyncQueue
from .claims import Batch, Claim, Key, key_of
from .db import async_connect, connect
from .endings import Endings
from .errors import ConnectError, PgQueueError
from .events import EventLog, NullEventLog
from .handlers import (
    LEFT_OPEN,
    ConnectionPool,
    Failure,
    LaneJob,
    Outcome,
    describe,
    failure_of,
    is_coroutine_function,
    outcome_of,
)
from .job import Job
from .keeper import Keeper
from .lanes import RELEASED, SKIPPED, PlainLanes
from .links import DISCONNECTS, Bell, Link
from .options import WorkerOptions
from .rules import Phase
from .tasks import Task

if TYPE_CHECKING:
    from .metrics import WorkerMetrics

log = logging.getLogger("pgqueue.worker")

FINAL_WRITES = 3.0  # seconds a stop gives its last writes after the grace (forced: 0.5)


class Seams(Protocol):
    """Where the course's ``FaultyWorker`` freezes or kills a worker (no-ops elsewhere)."""

    def _gate(self) -> None: ...

    def _after_claim(self, jobs: list[Any]) -> Any: ...


class Engine:
    """Claims, runs, keeps and finishes jobs for one worker (see the module's docstring)."""

    def __init__(
        self, handler: Any, options: WorkerOptions, events: EventLog | None, seams: Seams
    ) -> None:
        self.handler = handler
        self.options = options
        # The record the notebooks draw; a couple of microseconds a job, so production
        # runs that never read it switch it off.
        self.events = events if events is not None else EventLog()
        if not options.record_events:
            self.events = NullEventLog()
        self.seams = seams
        self.session_dsn = _limited(options)
        self.phase = Phase.NEW
        self._asked: bool | None = None  # a stop asked for before start() ended (True: force)
        self.error: BaseException | None = None  # why the engine stopped itself, if it did
        self.timed_out = 0  # handlers failed for running past their timeout
        # Every job's ending (complete, fail, release by fence, the completion buffer, the
        # counts of how jobs ended): endings.py.
        self.ends = Endings(self)
        self.keeper = Keeper(self)  # heartbeats, local deadlines, timeouts: keeper.py

        self.claims: dict[Key, Claim] = {}  # claimed, not finished
        self._waiting: deque[Claim] = deque()  # claimed, not started
        self._busy = 0  # lanes running a job now
        self._deep = False  # the last claim came back full: a backlog, so claim ahead
        self._running: dict[Claim, asyncio.Task[None]] = {}  # async jobs, a task each
        self._free_slots: list[int] = []
        self._next_slot = 1
        self._bell = Bell()  # wakes the dispatcher: a lane is free, a stop, a notification
        self._plain_handler = not is_coroutine_function(handler)
        # Which kind of job the handler runs: "django" for the Django backend's runner
        # (its class says so); None for a plain handler or a Tasks registry.
        self._runs: str | None = getattr(handler, "runs", None)
        tasks = options.tasks
        # Plain handlers run on lane threads of their own (lanes.py); async ones as tasks
        # of this loop. A Tasks registry may need both.
        self._plain: PlainLanes | None = None
        if tasks is not None or self._plain_handler:
            self._plain = PlainLanes(
                options.name,
                options.concurrency,
                start=self._start,
                run=self._run_plain,
                wake=self._plain_woke,
                connect=self._connect_plain,
                pgbouncer=options.pgbouncer,
                room=self._room,
            )
        self._recording = not isinstance(self.events, NullEventLog)
        self._lane_names = [
            options.name if options.concurrency == 1 else f"{options.name}.{n}"
            for n in range(1, options.concurrency + 1)
        ]
        self._claims_link = Link(self)
        self._pool: ConnectionPool | None = None
        self._tasks: list[asyncio.Task[None]] = []  # dispatcher, keeper, listener
        self._stopping: asyncio.Future[None] | None = None
        self._force: asyncio.Event | None = None
        self._final_until = float("inf")  # no write is tried past this (monotonic)
        self._loop: asyncio.AbstractEventLoop | None = None
        # The periodic tasks of this worker's queues, ticked about once a second.
        self._schedules = periodic.schedules_for(options.tasks, options.queues)
        # Prometheus metrics (metrics_port), counted where outcomes are; spans per job
        # (OpenTelemetry, when a tracer provider is configured at start).
        self.metrics: WorkerMetrics | None = None
        if options.metrics_port is not None:
            from .metrics import WorkerMetrics

            self.metrics = WorkerMetrics(options)
        self._span = tracing.no_span

    # -- the counts of how jobs ended (kept by the endings) --------------------------
    @property
    def done(self) -> int:
        """Jobs completed (accepted by fence)."""
        return self.ends.done

    @property
    def failed(self) -> int:
        """Failed attempts recorded (the job retries or goes dead)."""
        return self.ends.failed

    @property
    def dead(self) -> int:
        """Of those, jobs that went dead."""
        return self.ends.dead

    @property
    def rejected(self) -> int:
        """Late writes the database refused (someone else holds the job)."""
        return self.ends.rejected

    @property
    def gave_up(self) -> int:
        """Writes given up after retries, or whose lost reply could not be told."""
        return self.ends.gave_up

    # -- control ---------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self.phase >= Phase.STOPPING

    @property
    def working(self) -> bool:
        """Whether the dispatcher or a handler still runs (a burst run ends when not)."""
        if any(not t.done() for t in self._tasks[:1]) or self._running or self.ends.tasks:
            return True
        plain = self._plain  # a job running on a lane, waiting for one, or its outcome unfiled
        return plain is not None and bool(plain.busy or plain.waiting or plain.done)

    async def start(self, banner: str) -> None:
        """Check the database (a bad DSN or a missing table fails here), then start the
        dispatcher, keeper and listener on the running loop."""
        if self.phase != Phase.NEW:
            raise RuntimeError(f"worker {self.options.name} was already started")
        o = self.options
        async with AsyncQueue(o.dsn, pgbouncer=o.pgbouncer) as probe:
            await probe.check()
            await probe.check_claims()
            paused = [name for name in await probe.paused() if name in o.queues]
        if self.metrics is not None:
            self.metrics.serve()  # a port in use: one line, and nothing has started
        self._span = tracing.job_spans()
        self._loop = asyncio.get_running_loop()
        self._force = asyncio.Event()
        self.phase = Phase.WORKING
        log.info("%s", banner)
        for name in paused:  # said once: the claim itself skips it until resumed
            log.warning(
                "%s: queue %s is paused: no job of it is claimed until `pgqueue resume %s`",
                o.name,
                name,
                name,
            )
        self._pool = ConnectionPool(o.connections, self._connect_async, o.pgbouncer)
        self._tasks.append(asyncio.create_task(self._dispatch(), name=f"pgqueue-{o.name}"))
        self._tasks.append(asyncio.create_task(self.keeper.run(), name=f"pgqueue-{o.name}-keeper"))
        self._tasks.append(asyncio.create_task(self._reaping(), name=f"pgqueue-{o.name}-reaper"))
        if self._schedules:
            self._tasks.append(asyncio.create_task(self._ticking(), name=f"pgqueue-{o.name}-tick"))
        if o.listen and o.pgbouncer and not o.listen_dsn:
            log.warning(
                "%s: behind PgBouncer LISTEN needs a direct connection (listen_dsn, "
                "--listen-dsn); polling every %gs instead",
                o.name,
                o.poll_interval,
            )
        elif o.listen:
            self._tasks.append(asyncio.create_task(self._hear(), name=f"pgqueue-{o.name}-listen"))
        if self._asked is not None:  # a stop was asked for while this was starting
            self.request_stop(self._asked)

    def request_stop(self, force: bool = False) -> None:
        """Stop claiming (on the loop's thread); ``force``: do not wait for the grace. Asked
        while the engine is still starting, the stop is remembered and begins as soon as
        ``start()`` has started everything (a SIGTERM during start-up is not lost)."""
        if self.phase == Phase.NEW:
            self._asked = bool(force or self._asked)
            return
        if force and self._force is not None:
            self._force.set()
        if self.phase == Phase.WORKING:
            self.phase = Phase.STOPPING
        if self._plain is not None:
            self._plain.close()  # busy lanes finish their job; none takes another
        self._bell.ring()

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the engine's loop, from any thread."""
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                self._loop.call_soon_threadsafe(fn, *args)

    def halt(self) -> None:
        """Stop at once and write nothing more, like a killed process: the leases run out
        and the reaper returns the jobs. Callable from any thread."""
        self.phase = Phase.HALTED
        self.call_soon(self._bell.ring)

    async def join(self, timeout: float | None = None) -> None:
        """Wait for the dispatcher and its handlers to end, at most ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.working and self.phase < Phase.CLOSED:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            await self._until_changed(0.5 if left is None else min(left, 0.5))

    async def serve(self) -> None:
        """Wait for a stop request, or (burst) for the queue to run dry."""
        while self.phase == Phase.WORKING and self.working:
            await self._bell.wait(self._bell.generation, 0.2)

    async def stop(self, grace: float = 10.0) -> None:
        """Stop claiming; give back the claimed jobs not yet started; let running handlers
        finish within ``grace`` seconds and complete their jobs; then close. A second
        caller waits for the first one's stop."""
        if not self._tasks:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shut_down(grace))
        await asyncio.shield(self._stopping)

    async def _shut_down(self, grace: float) -> None:
        assert self._force is not None
        self.request_stop()
        deadline = time.monotonic() + grace
        while self.working and not self._force.is_set() and self.phase < Phase.LEAVING:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self._until_changed(min(left, 0.1))
        if self._plain is not None and self.phase < Phase.LEAVING:
            self._plain_done()  # outcomes that came in since the loop last looked count
        if self.phase < Phase.LEAVING:
            self.phase = Phase.LEAVING
            bound = 0.5 if self._force.is_set() else FINAL_WRITES
            self._final_until = time.monotonic() + bound
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ends.flushed(), bound)
            if self.ends.tasks:
                left = max(0.0, self._final_until - time.monotonic())
                await asyncio.wait(list(self.ends.tasks), timeout=left)
        if self.phase < Phase.CLOSED:
            self.phase = Phase.CLOSED
        doomed = [*self._tasks, *self.ends.tasks]
        if self.ends.flusher is not None:
            doomed.append(self.ends.flusher)
        handlers = list(self._running.values())  # past the grace: cancelled, left to leases
        for task in doomed + handlers:
            task.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        if handlers:  # a handler that ignores its cancellation is not waited for
            await asyncio.wait(handlers, timeout=0.5)
        if self._plain is not None:
            self._plain.close()
        if self._pool is not None:
            await self._pool.close()
        await self._claims_link.drop()
        await self.ends.link.drop()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)

    async def _until_changed(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the dispatcher or an async job to end."""
        waits = [t for t in self._tasks[:1] if not t.done()] + list(self._running.values())
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        else:  # plain jobs only: their lanes report to the loop, not to a task
            await asyncio.sleep(min(timeout, 0.02))

    def _stop_for(self, exc: BaseException) -> None:
        """Stop the whole worker on an error no retry can mend (a setting is wrong); the
        façade's ``run()`` raises it once the worker has stopped."""
        if self.error is None:
            self.error = exc
            log.error("%s: %s; stopping the worker", self.options.name, describe(exc))
        self.request_stop()

    async def _broken_setup(self, exc: BaseException) -> bool:
        """After an error of pgqueue's own (a dropped table, prepared statements through
        PgBouncer): probe again on a fresh connection, and give up only if that fails too.
        A lost connection is never a setup error."""
        if not isinstance(exc, PgQueueError) or isinstance(exc, ConnectError):
            return False
        o = self.options
        try:
            async with AsyncQueue(o.dsn, application_name=o.app_name, pgbouncer=o.pgbouncer) as q:
                for _ in range(3):  # a clash of prepared statements may need a few
                    await q.check()
        except PgQueueError as again:
            if isinstance(again, ConnectError):
                return False
            self._stop_for(again)
            return True
        except psycopg.Error:
            return False
        return False

    # -- the dispatcher: claims, and a task per job ------------------------------------
    def _record(self, lane: str, kind: str, job: Job, detail: str = "") -> None:
        self.events.record(kind, lane, job.id, job.fence, detail)

    async def _dispatch(self) -> None:
        """Claim and start jobs until stopped (or a dry queue in burst mode); an error is
        logged and the dispatcher carries on after a backoff. Then give back what waits."""
        backoff = rules.Backoff()
        while self.phase == Phase.WORKING:
            try:
                if not await self._dispatch_once():
                    break
                backoff.succeeded()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._claims_link.drop()
                if self.phase != Phase.WORKING or await self._broken_setup(exc):
                    break
                level = logging.WARNING if isinstance(exc, DISCONNECTS) else logging.ERROR
                name = self.options.name
                wait = backoff.failed()
                log.log(level, "%s: %s; carrying on in %.1fs", name, describe(exc), wait)
                await asyncio.sleep(wait)
        if self._plain is not None:
            self._waiting.extend(self._plain.drain())
        while self._waiting and self.phase < Phase.LEAVING:
            claim = self._waiting.popleft()  # claimed, never started: give back, attempt too
            if self.ends.own(claim):
                await self.ends.finish(claim, "release")

    async def _dispatch_once(self) -> bool:
        """Claim a batch when a lane is free and no claimed job waits (or, under a backlog,
        while fewer jobs wait than there are lanes: claiming ahead, so no lane idles for a
        claim's round trip); False when a burst run found the queue dry."""
        o = self.options
        seen = self._bell.generation
        if not self._wants_jobs():
            await self._bell.wait(seen, o.poll_interval)  # a lane is free, or a stop
            return True
        self.seams._gate()
        queue = await self._claims_link.get()
        limit, held = self._claim_size(), len(self.claims)
        jobs = await queue.claim(list(o.queues), limit=limit, lease=o.lease)
        self._deep = len(jobs) == limit
        if not jobs:
            # Dry only if nothing was held while the claim ran either: a fail or release
            # that committed meanwhile may have made a job runnable after its snapshot.
            # And only once the reaper found nothing of ours to return: a crashed worker's
            # job whose lease ran out is runnable too, and the reaper's own round may not
            # come before a short burst run ends.
            if o.burst:
                holding = bool(held or self.claims)
                reaped = 0 if holding else await self._reap()
                if rules.burst_dry(held_while_claiming=holding, reaped_back=reaped):
                    return False
            await self._bell.wait(seen, o.poll_interval)
            return True
        claimed = self._take(jobs)
        after = self.seams._after_claim(claimed)
        if inspect.isawaitable(after):
            await after
        self._start_async()
        return True

    def _wants_jobs(self) -> bool:
        return rules.wants_jobs(
            self._claim_size(),
            waiting=self._waiting_now(),
            busy=self._busy_now(),
            lanes=self.options.concurrency,
            deep=self._deep,
        )

    def _claim_size(self) -> int:
        """How many jobs the next claim asks for (``rules.claim_size``)."""
        plain = self._plain is not None
        return rules.claim_size(
            self._room_to_hold(), self.options.batch, deep=self._deep, plain=plain
        )

    def _room_to_hold(self) -> int:
        """How many more jobs this worker may claim (``rules.room_to_hold``)."""
        o = self.options
        return rules.room_to_hold(
            o.batch,
            o.concurrency,
            plain=self._plain is not None,
            held=len(self.claims),
            finishing=len(self.ends.finishing),
        )

    def _waiting_now(self) -> int:
        return len(self._waiting) + (len(self._plain.waiting) if self._plain else 0)

    def _busy_now(self) -> int:
        return self._busy + (self._plain.busy if self._plain else 0)

    def _room(self) -> bool:
        """Whether a lane may start another job: at most ``concurrency`` run at once."""
        return self._busy_now() < self.options.concurrency

    def _take_slot(self) -> bool:
        """Count one more async job running, if a slot is free: under the plain lanes' lock
        when there are plain lanes (a mixed registry), as a lane thread takes its slot, so
        the loop and a lane thread never both take the last one."""
        with self._plain.lock if self._plain is not None else contextlib.nullcontext():
            if not self._room():
                return False
            self._busy += 1
            return True

    def _take(self, jobs: list[AsyncJob]) -> list[Job]:
        if self.metrics is not None:
            self.metrics.claimed(jobs)
        batch = Batch(len(jobs))
        new: list[Claim] = []
        lanes = self._lane_names
        for claimed in jobs:
            plain = self._is_plain(claimed)
            job: Job = _plain_job(claimed) if plain else claimed
            if not plain:
                claimed.conn = None  # the claim's connection is the engine's: handlers borrow
                claimed.borrow = self._borrow
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            claim = Claim(job, slot, lanes[(slot - 1) % len(lanes)], batch, plain)
            self.claims[(job.id, job.fence)] = claim
            new.append(claim)
        plain_claims = [claim for claim in new if claim.plain]
        if plain_claims:
            assert self._plain is not None
            self._plain.add(plain_claims)
        if len(plain_claims) < len(new):
            self._waiting.extend(claim for claim in new if not claim.plain)
        if self._recording:  # the record the notebooks draw (off: not even its rows built)
            for claim in new:
                claim.job.on_event = functools.partial(self._record_job, claim.lane)
            self.events.record_many(
                ("claim", c.lane, c.job.id, c.job.fence, str(c.job.attempts)) for c in new
            )
        return [claim.job for claim in new]

    def _record_job(self, lane: str, kind: str, job: Job) -> None:
        self.events.record(kind, lane, job.id, job.fence)

    def _is_plain(self, job: Job) -> bool:
        """Whether the job's handler is a plain function (run on a lane thread)."""
        if self.options.tasks is None:
            return self._plain_handler
        task = self._task_of(job)
        return not is_coroutine_function(task.fn if task is not None else self.handler)

    # -- async jobs: a task each, at most ``concurrency`` running (plain jobs included) --
    def _start_async(self) -> None:
        """Start claimed async jobs while a slot is free."""
        while self._waiting and self.phase == Phase.WORKING and self._take_slot():
            claim = self._waiting.popleft()
            task = asyncio.create_task(self._run_job(claim), name=f"pgqueue-{claim.lane}")
            self._running[claim] = task
            task.add_done_callback(functools.partial(self._async_ended, claim))

    def _async_ended(self, claim: Claim, task: asyncio.Task[None]) -> None:
        del self._running[claim]
        if not claim.timed_out:  # (a job failed at its timeout gave its slot back then)
            self._give_back_slot()
            self._slot_freed()

    def _give_back_slot(self) -> None:
        """An async job no longer holds its slot (it ended, or was failed at its timeout)."""
        self._busy -= 1
        if self._plain is not None:
            self._plain.ring()  # lane threads waiting for a slot (a mixed registry shares them)

    async def _run_job(self, claim: Claim) -> None:
        try:
            outcome = self._start(claim)
            if outcome is None:
                outcome = await self._call_async(claim.job)
                claim.ended = time.monotonic()
                self.seams._gate()  # a freeze during the handler ends here
            if not claim.timed_out:
                self._ended(claim, outcome)
        except Exception as exc:  # the bookkeeping failed: leave the job to its lease
            self._forget(claim, describe(exc))

    # -- one job: may it start, and its ending, plain or async ---------------------------
    def _start(self, claim: Claim) -> Failure | None:
        """Whether the job may start now (None: it has started), else why not: the worker
        is stopping (it goes back), or it was lost (taken over, or its lease ran out here)
        before its turn, and running it then could run it twice. On a lane thread for a
        plain job: it reads the engine's state, and the loop files what it says."""
        self.seams._gate()
        key = key_of(claim.job)
        current = self.claims.get(key) is claim and key not in self.ends.finishing
        verdict = rules.may_start(
            working=self.phase == Phase.WORKING, current=current, lost=claim.job.lost
        )
        if verdict != "start":
            return RELEASED if verdict == "release" else SKIPPED
        wrong = rules.not_ours(claim.job.payload, self._runs)
        if wrong is not None:  # another kind of worker's job: never run, never completed
            return Failure(wrong, give_up=True)
        claim.timeout = self._timeout_for(claim.job)
        claim.started = time.monotonic()
        return None

    def _timed_out(self, claim: Claim) -> Failure:
        self.timed_out += 1
        if self.metrics is not None:
            self.metrics.timed_out(claim.job)
        log.warning(
            "%s: job %s ran past the %gs timeout; failing it",
            claim.lane,
            claim.job.id,
            claim.timeout,
        )
        return Failure(f"TimeoutError: the handler ran past the {claim.timeout:g} s timeout")

    # -- plain jobs: begun and run on a lane thread, ended on the loop -------------------
    def _run_plain(self, claim: Claim, connection: Callable[[], psycopg.Connection]) -> Outcome:
        outcome = self._call_plain(claim.job, claim.lane, connection)
        claim.ended = time.monotonic()
        self.seams._gate()  # a freeze during the handler ends here
        return outcome

    def _plain_woke(self) -> None:
        """On a lane thread: outcomes are waiting for the loop."""
        self.call_soon(self._plain_done)

    def _plain_done(self) -> None:
        """File the outcomes of plain jobs, as many as came in since the last wake-up."""
        assert self._plain is not None
        for claim, outcome in self._plain.take_done():
            self._ended(claim, outcome)
        self._slot_freed()

    def _slot_freed(self) -> None:
        """A plain job ended (or its lane was retired): an async job waiting for the slot
        may start (a mixed registry shares them), and the dispatcher may claim."""
        self._start_async()
        if self._wants_jobs():
            self._bell.ring()

    def _ended(self, claim: Claim, outcome: Outcome) -> None:
        """File how a job ended, plain or async: not started (given back, or lost before
        its turn), failed, or done (its completion buffered, or sent now)."""
        key = key_of(claim.job)
        if outcome is SKIPPED:
            if self.claims.get(key) is claim and key not in self.ends.finishing:
                self._drop(claim)
                self._record(claim.lane, "skipped", claim.job, "lease lost before it started")
        elif outcome is RELEASED:
            if self.ends.own(claim):
                self.ends.spawn(claim, "release")
            return
        elif self.ends.own(claim):
            if isinstance(outcome, Failure):
                self.ends.spawn(claim, "fail", outcome)
            else:
                claim.result = outcome.result if outcome is not None else None
                if self.options.complete_in_batches:
                    self.ends.buffer.append((claim, time.monotonic()))
                else:
                    self.ends.spawn(claim, "complete")
        self._count_down(claim)

    def _count_down(self, claim: Claim) -> None:
        claim.batch.left -= 1
        if claim.batch.left == 0:
            self.ends.flush_soon()  # the batch is over: its completions go now, together

    def _call_plain(
        self, job: Job, lane: str, connection: Callable[[], psycopg.Connection]
    ) -> Outcome:
        """On a lane thread: the plain handler, with the lane's connection as ``job.conn``
        (opened if it asks), and its return value encoded as JSON here, off the loop. The
        thread takes the lane's name meanwhile (logs, py-spy)."""
        threading.current_thread().name = f"pgqueue-{lane}"
        assert isinstance(job, LaneJob)
        job._open = connection
        try:
            with self._span(job):
                result = self.handler(job)
        except BaseException as exc:  # SystemExit, KeyboardInterrupt too
            return failure_of(exc)
        finally:  # the connection is the lane's again: a job kept past its handler has none
            job._open = job._lane_conn = None
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited: close it, so Python does not warn later
            return Failure(
                "TypeError: a plain handler returned an awaitable: make it async def "
                "(the worker awaits those) or return a value"
            )
        return outcome_of(result)

    async def _call_async(self, job: Job) -> Outcome:
        """Await the handler and catch whatever it raises, and encode what it returned as
        JSON in its task; give back its connection (reset; a transaction it left open is
        rolled back, and fails the job)."""
        assert isinstance(job, AsyncJob)
        failure: Outcome = None
        try:
            with self._span(job):
                result = self.handler(job)
                if not inspect.isawaitable(result):
                    failure = Failure(
                        "TypeError: the handler returned no awaitable: AsyncWorker runs async "
                        "def handlers (plain functions run with pgqueue.Worker)"
                    )
                elif inspect.isawaitable(result := await result):
                    if inspect.iscoroutine(result):
                        result.close()
                    failure = Failure(
                        "TypeError: the handler returned an awaitable instead of awaiting it"
                    )
                else:
                    failure = outcome_of(result)
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError too
            failure = failure_of(exc)
        conn, job.lent, job.conn, job.borrow = job.lent, None, None, None
        pool = self._pool
        if conn is not None and pool and await pool.put(conn):
            failure = failure if isinstance(failure, Failure) else LEFT_OPEN
        return failure

    async def _borrow(self) -> psycopg.AsyncConnection:
        assert self._pool is not None
        return await self._pool.get()

    def _connect_plain(self) -> psycopg.Connection:
        o = self.options
        return connect(o.dsn, application_name=o.app_name, pgbouncer=o.pgbouncer)

    async def _connect_async(self) -> psycopg.AsyncConnection:
        o = self.options
        return await async_connect(o.dsn, application_name=o.app_name, pgbouncer=o.pgbouncer)

    # -- each job's rules: its task's, else the worker's -----------------------------------
    def _task_of(self, job: Job) -> Task | None:
        tasks = self.options.tasks
        if tasks is None:
            return None
        try:
            return tasks.for_job(job)
        except LookupError:
            return None

    def _timeout_for(self, job: Job) -> float | None:
        if self.options.tasks is None:
            return self.options.timeout
        task = self._task_of(job)
        return rules.task_or_worker(task and task.timeout, self.options.timeout)

    def _backoff_for(self, job: Job) -> float:
        task = self._task_of(job)
        backoff = rules.task_or_worker(task and task.backoff, self.options.backoff)
        assert backoff is not None
        return backoff

    # -- endings: complete, fail, release by fence -------------------------------------

    def _drop(self, claim: Claim) -> None:
        """Forget a claim (ended, skipped or left to its lease) and free its slot."""
        key = key_of(claim.job)
        if self.claims.get(key) is claim:
            del self.claims[key]
            heapq.heappush(self._free_slots, claim.slot)
        self.ends.finishing.discard(key)

    def _forget(self, claim: Claim, why: str) -> None:
        """Stop heartbeating a job whose bookkeeping failed: its lease runs out and the
        reaper returns it."""
        self._drop(claim)
        claim.job.mark_lost()
        log.warning("%s: left job %s to its lease after %s", claim.lane, claim.job.id, why)

    # -- the keeper: heartbeats, local deadlines, late flushes --------------------------

    async def _reaping(self) -> None:
        """Run the reaper every ``reap_interval`` (the first at a random point of the
        first interval, so workers started together spread out). Its statement skips
        locked rows, so it never waits for anyone."""
        await asyncio.sleep(self.options.reap_interval * random.uniform(0.5, 1.0))
        await self._every(self.options.reap_interval, "reaper", self._reap)

    async def _ticking(self) -> None:
        """Tick the periodic tasks about once a second (every worker does: the database's
        unique key on (schedule, slot) keeps one job per slot); a job made rings the
        dispatcher."""

        async def tick() -> None:
            if await periodic.tick(await self._claims_link.get(), self._schedules):
                self._bell.ring()

        await self._every(periodic.TICK, "periodic tick", tick)

    async def _every(self, seconds: float, what: str, step: Any) -> None:
        """Run ``step()`` every ``seconds`` on the claims' connection until the worker
        stops; an error is logged and the next round comes as usual."""
        while self.phase == Phase.WORKING:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._claims_link.drop()
                if self.phase != Phase.WORKING or await self._broken_setup(exc):
                    return
                level = logging.WARNING if isinstance(exc, DISCONNECTS) else logging.ERROR
                log.log(level, "%s: %s: %s", self.options.name, what, describe(exc))
            await asyncio.sleep(seconds)

    async def _reap(self) -> int:
        """Return the jobs whose lease ran out (any queue's: the reaper serves them all);
        how many of this worker's queues are runnable again."""
        queue = await self._claims_link.get()
        reaped = await queue.reap()
        name = self.options.name
        self.events.record_many(("reap", name, r.id, r.fence, r.status) for r in reaped)
        for row in reaped:
            back = "back to ready" if row.status == "ready" else "dead (no attempts left)"
            log.info("%s: reaped job %s (%s), its lease ran out: %s", name, row.id, row.queue, back)
        ours = sum(row.queue in self.options.queues and row.status == "ready" for row in reaped)
        if ours:
            self._bell.ring()
        return ours

    # -- listener: LISTEN/NOTIFY as a wake-up hint ------------------------------------
    async def _hear(self) -> None:
        o = self.options
        backoff = rules.Backoff()
        while self.phase == Phase.WORKING:
            try:
                dsn = o.listen_dsn or o.dsn
                async with await async_connect(dsn, application_name=o.app_name) as conn:
                    await conn.execute("LISTEN pgqueue")
                    backoff.succeeded()
                    self._bell.ring()  # we may have missed hints while (re)connecting
                    while self.phase == Phase.WORKING:
                        async for note in conn.notifies(timeout=1.0):
                            if note.payload in o.queues:
                                self._bell.ring()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.phase != Phase.WORKING:
                    return
                log.warning("%s: listener reconnecting (%s)", o.name, describe(exc))
                await asyncio.sleep(backoff.failed())


def _limited(o: WorkerOptions) -> str:
    """The DSN of the engine's own sessions: no statement of theirs waits for a lock
    longer than a heartbeat interval or runs past two thirds of the lease, so nothing
    holds a worker's bookkeeping until its leases run out. (Behind PgBouncer startup
    options are refused; there the statements themselves never wait: SKIP LOCKED.)"""
    if o.pgbouncer:
        return o.dsn
    lock_ms = max(200, int(o.lease * 1000 / 3))
    statement_ms = max(1000, int(o.lease * 2000 / 3))
    limits = f"-c lock_timeout={lock_ms} -c statement_timeout={statement_ms}"
    try:
        given = str(conninfo.conninfo_to_dict(o.dsn).get("options", ""))
        return conninfo.make_conninfo(o.dsn, options=f"{given} {limits}".strip())
    except psycopg.ProgrammingError:
        return o.dsn  # malformed: connecting says how


def _plain_job(claimed: AsyncJob) -> Job:
    """The claim as a plain handler sees it: a ``Job`` whose ``conn`` is its lane's."""
    return LaneJob(
        claimed.id,
        claimed.queue,
        claimed.payload,
        claimed.fence,
        claimed.attempts,
        claimed.max_attempts,
        claimed.lease_until,
        claimed.waited,
        deadline=claimed.deadline,
    )
