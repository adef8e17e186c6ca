"""``Worker``: competing threads that claim, run, heartbeat and finish jobs by fence.

Threads, each with its own autocommit connection:
- N lanes (job threads): claim a batch (one short statement), run the handler outside any
  transaction, then complete or fail each job with its fence;
- one keeper: heartbeats every in-flight job at lease/3, runs the reaper, marks jobs whose
  lease ran out on this worker's own clock as lost, and fails handlers past ``timeout``
  (replacing their lane, so the worker keeps its concurrency);
- one listener (optional): LISTEN pgqueue, and wake idle lanes when a job arrives.
Polling goes on regardless, so a missed notification costs at most one poll interval.
Lost connections are reopened with backoff (and LISTEN re-issued).

Handlers are user code: whatever one does (raise ``SystemExit``, leave a transaction
open, hang), its job ends failed, retried or dead by the rules, and its lane goes on.

This module holds the Worker's options, its control (start, stop, run, signals) and its
lanes; ``keeper.py`` the keeper and listener threads, ``finishing.py`` how jobs are
finished by fence, ``parts.py`` the small pieces they share.
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .db import describe_dsn
from .errors import BadInput, GiveUp, RetryAfter, retry_delay
from .events import EventLog
from .finishing import _Finishing
from .job import Job
from .keeper import _Keeping
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
    _TaskRules,
    describe,
    log,
)
from .queue import Queue

Handler = Callable[[Job], Any]


__all__ = ["Handler", "Worker", "_Failure", "describe"]


class Worker(_TaskRules, _Finishing, _Keeping):
    """Run ``handler(job)`` for jobs of ``queue`` in ``concurrency`` threads.

    ``start()``/``stop()`` for notebooks, ``run()`` to block until SIGINT/SIGTERM
    (or, with ``burst=True``, until no runnable job is left). With ``timeout``, a handler
    running longer is failed (the job retries with backoff, or goes dead) and its lane
    replaced; the stale handler can no longer complete the job or write with its fence.
    ``queue`` may list several queues: a preference order (see ``Queue.claim``). Finished
    jobs are completed in one fenced statement a batch (``complete_in_batches``), or
    sooner once the oldest has waited ``flush_after`` seconds; a crash in that window
    re-runs those jobs (at-least-once). Given a
    ``pgqueue.Tasks`` registry as handler, the worker runs every task's queue (unless
    ``queue`` says otherwise) with each task's own timeout and backoff.
    """

    def __init__(
        self,
        handler: Handler,
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
        burst: bool = False,
        name: str = "worker",
        events: EventLog | None = None,
        record_events: bool = True,
    ) -> None:
        for what, value, upper in (("concurrency", concurrency, None), ("batch", batch, 10_000)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"{what} must be a whole number >= 1, got {value!r}")
            if upper is not None and value > upper:
                raise BadInput(f"{what} must be a whole number from 1 to {upper}, got {value!r}")
        if not callable(handler):
            raise BadInput(f"handler must be callable, got {handler!r}")
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
        self.error: BaseException | None = None  # why the worker stopped itself, if it did

        self._bell = _Bell()
        self._stop = threading.Event()
        self._force = threading.Event()  # a second signal: do not wait for the grace period
        self._halted = threading.Event()  # write nothing more, like a killed process
        self._abandoned = threading.Event()  # grace is over: stop heartbeating
        self._lock = threading.Lock()
        # Claims by (job id, fence): a job failed with no backoff may be claimed again by
        # another lane before this claim's bookkeeping is over.
        self._in_flight: dict[Key, _Held] = {}
        self._finishing: set[Key] = set()  # claims whose complete/fail/release is under way
        # Finished jobs whose completion waits to go out in one statement, with the time
        # each was added: flushed at the end of a lane's batch or by the keeper once the
        # oldest has waited flush_after (so a fast job is not held behind a slow sibling).
        self._buffer: list[tuple[Job, float]] = []
        self._lanes: list[_Lane] = []
        self._threads: list[threading.Thread] = []

    # -- control ---------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> Worker:
        """Start the threads and return at once."""
        if self._threads:
            raise RuntimeError(f"worker {self.name} was already started")
        # Fail fast, in the caller's thread, on a bad DSN or a missing table.
        with Queue(self.dsn, pgbouncer=self.pgbouncer) as probe:
            probe.check()
        log.info(
            "%s: %s; queues %s; %d lanes, batch %d, lease %gs",
            self.name,
            describe_dsn(self.dsn),
            ", ".join(self.queues),
            self.concurrency,
            self.batch,
            self.lease,
        )
        slots = [
            self.name if self.concurrency == 1 else f"{self.name}.{i}"
            for i in range(1, 1 + self.concurrency)
        ]
        for slot in slots:
            self._spawn(_Lane(slot))
        self._threads.append(self._thread(self._keep, "keeper"))
        if self.listen and self.pgbouncer and not self.listen_dsn:
            log.warning(
                "%s: behind PgBouncer LISTEN needs a direct connection (listen_dsn, "
                "--listen-dsn); polling every %gs instead",
                self.name,
                self.poll_interval,
            )
        elif self.listen:
            # Not in _threads: it writes nothing, so stop() need not wait out its poll of
            # the notification socket (that wait was most of a burst run's exit time).
            self._thread(self._hear, "listen")
        return self

    def _thread(self, target: Callable[[], None], what: str) -> threading.Thread:
        thread = threading.Thread(target=target, daemon=True, name=f"pgqueue-{self.name}-{what}")
        thread.start()
        return thread

    def _spawn(self, lane: _Lane) -> None:
        with self._lock:
            self._lanes.append(lane)
        self._start_lane(lane)

    def _start_lane(self, lane: _Lane) -> None:
        """Start the thread of a lane already in ``_lanes``."""
        thread = threading.Thread(
            target=self._work, args=(lane,), daemon=True, name=f"pgqueue-{lane.name}"
        )
        thread.start()
        # Set only once started: a lane with a thread that is not alive has ended.
        lane.thread = thread
        self._threads.append(thread)

    def stop(self, grace: float = 10.0) -> None:
        """Stop claiming; let running handlers finish within ``grace`` seconds. Claimed jobs
        not yet started are released; handlers still running after that keep their lease
        until it expires (then the reaper hands the job to someone else)."""
        self._stop.set()
        self._bell.ring()
        deadline = time.monotonic() + grace
        with self._lock:  # a retired lane's hung handler was already failed: not waited for
            retired = {lane.thread for lane in self._lanes if lane.retired}
        for thread in [t for t in list(self._threads) if t not in retired]:
            while thread.is_alive() and not self._force.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                thread.join(min(left, 0.1))
        self._abandoned.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the lanes to end (with ``burst=True``: the queue ran dry)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._working():
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _working(self) -> bool:
        """Whether any current lane still runs (a retired lane's hung handler does not count)."""
        with self._lock:
            lanes = [lane for lane in self._lanes if not lane.retired]
        # A lane registered but not started yet (a timed-out lane's successor) counts.
        return any(lane.thread is None or lane.thread.is_alive() for lane in lanes)

    def run(self, grace: float = 10.0) -> None:
        """Block until SIGINT/SIGTERM (or a dry queue with ``burst``), then stop gracefully;
        a second signal stops at once. The previous signal handlers are restored after."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            while not self._stop.is_set() and self._working():
                self._stop.wait(0.2)
            self.stop(grace)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.error is not None:
            raise self.error

    def _give_up(self, exc: BaseException) -> None:
        """Stop the whole worker on an error that retrying cannot mend (a setting is
        wrong); ``run()`` raises it once the worker has stopped."""
        if self.error is None:
            self.error = exc
            log.error("%s: %s; stopping the worker", self.name, describe(exc))
        self._stop.set()
        self._bell.ring()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.is_set():
            self._force.set()
            log.warning("%s: second signal: stopping now, without waiting for handlers", self.name)
        else:
            log.warning("%s: stopping after the running handlers (again to force)", self.name)
        self._stop.set()
        self._bell.ring()

    @property
    def in_flight(self) -> list[Job]:
        """Jobs claimed and not yet finished by this worker."""
        with self._lock:
            return [held.job for held in self._in_flight.values()]

    # -- seams: no-ops here; the course's FaultyWorker (pgqueue.course.faults) freezes
    # or kills the worker at these points to replay the failure stories ------------------
    def _gate(self) -> None:
        """A point where every thread of the worker may be held (a frozen process)."""

    def _after_claim(self, jobs: list[Job]) -> None:
        """Called with each claimed batch, before any of it runs."""

    def _halt(self) -> None:
        """Stop at once and write nothing more: the leases run out, the reaper returns the jobs."""
        self._halted.set()
        self._stop.set()
        self._bell.ring()

    # -- lanes -------------------------------------------------------------------------
    def _record(self, lane: str, kind: str, job: Job, detail: str = "") -> None:
        self.events.record(kind, lane, job.id, job.fence, detail)

    def _work(self, lane: _Lane) -> None:
        """A lane's loop. Nothing ends it but a stop, a dry queue in burst mode, or its
        retirement: an error is logged and the lane carries on after a backoff."""
        link = _Link(self)
        delay = 0.05
        try:
            while not (self._stop.is_set() or lane.retired):
                try:
                    if not self._cycle(link, lane):
                        return
                    delay = 0.05
                except BaseException as exc:  # a lane must not die silently
                    link.drop()
                    self._forget_lane(lane, "a lane error")
                    if self._stop.is_set() or lane.retired:
                        return
                    if _is_setup_error(exc):
                        self._give_up(exc)
                        return
                    level = logging.WARNING if isinstance(exc, _DISCONNECTS) else logging.ERROR
                    log.log(level, "%s: %s; carrying on in %.1fs", lane.name, describe(exc), delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
        finally:
            link.drop()

    def _cycle(self, link: _Link, lane: _Lane) -> bool:
        """Claim one batch and run it; False when a burst worker found the queue dry."""
        self._gate()
        seen = self._bell.generation
        jobs = link.get().claim(self.queues, limit=self.batch, lease=self.lease)
        if not jobs:
            if self.burst:
                return False
            self._bell.wait(seen, self.poll_interval)
            return True
        self._take(jobs, lane)
        self._after_claim(jobs)
        self._run_batch(link, jobs, lane)
        return True

    def _take(self, jobs: list[Job], lane: _Lane) -> None:
        # Per batch, not per job: one lock, one recorder shared by the batch, one record call.
        with self._lock:
            for job in jobs:
                self._in_flight[_key(job)] = _Held(job, lane)
        on_event = functools.partial(self._record, lane.name)
        for job in jobs:
            job.on_event = on_event
        self.events.record_many(("claim", lane.name, j.id, j.fence, str(j.attempts)) for j in jobs)

    def _run_batch(self, link: _Link, jobs: list[Job], lane: _Lane) -> None:
        for job in jobs:
            if self._halted.is_set():
                return  # a halted worker writes nothing; its leases run out
            if self._stop.is_set() or lane.retired:
                if self._own_finish(job):
                    self._finish(link, job, lane, "release")
                continue
            self._gate()
            if not self._begin(job, lane):
                continue
            failure = self._call(link, job)
            self._gate()  # a freeze during the handler ends here
            if self._halted.is_set():
                return
            if not self._own_finish(job):
                continue  # timed out: the keeper failed it and replaced this lane
            if failure is not None:
                self._finish(link, job, lane, "fail", failure)
            elif self.complete_in_batches:
                with self._lock:
                    self._buffer.append((job, time.monotonic()))
            else:
                self._finish(link, job, lane, "complete")
        self._flush(link)  # the batch is over: its completions go now, in one statement

    def _own_finish(self, job: Job) -> bool:
        """Take the right to finish ``job`` (the lane and the keeper's timeout must not
        both finish it); False if someone already did."""
        key = _key(job)
        with self._lock:
            if key not in self._in_flight or key in self._finishing:
                return False
            self._finishing.add(key)
            return True

    def _begin(self, job: Job, lane: _Lane) -> bool:
        """Mark the job started, unless it was lost (taken over, or its lease ran out here)
        before its turn: running it then could run it twice."""
        key = _key(job)
        with self._lock:
            held = self._in_flight.get(key)
            if held is None or key in self._finishing:
                return False
            if not job.lost:
                held.started = time.monotonic()
                held.timeout = self._timeout_for(job)
                return True
            del self._in_flight[key]
        self._record(lane.name, "skipped", job, "lease lost before it started")
        return False

    def _call(self, link: _Link, job: Job) -> _Failure | None:
        """Run the handler; return None on success, else how it failed. Whatever the
        handler left on its connection is rolled back first."""
        queue = link.get()
        job.conn = queue.conn
        failure: _Failure | None = None
        try:
            result = self.handler(job)
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()  # never awaited: close it, so Python does not warn later
                failure = _Failure(
                    "TypeError: the handler returned an awaitable, which a threaded Worker "
                    "cannot run: use an async handler with the async worker"
                )
        except GiveUp as exc:
            failure = _Failure(describe(exc), give_up=True)
        except RetryAfter as exc:
            failure = _Failure(describe(exc), delay=retry_delay(exc))
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError too
            failure = _Failure(describe(exc))
        conn = queue.conn
        try:
            if conn.closed:
                link.drop()
            elif conn.info.transaction_status != TransactionStatus.IDLE:
                conn.rollback()
                if failure is None:
                    failure = _Failure("the handler left a transaction open; it was rolled back")
        except psycopg.Error:
            link.drop()  # in no state to reuse: the next statement opens a new connection
        return failure
