"""``Worker``: competing threads that claim, run, heartbeat and finish jobs by fence.

Threads, each with its own autocommit connection:
- N job threads: claim a batch (one short statement), run the handler outside any
  transaction, then complete or fail each job with its fence;
- one keeper: heartbeats every in-flight job at lease/3 and runs the reaper;
- one listener (optional): LISTEN pgqueue, and wake idle job threads when a job arrives.
Polling goes on regardless, so a missed notification costs at most one poll interval.
Lost connections are reopened with backoff (and LISTEN re-issued).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .db import connect, first_line, resolve_dsn
from .errors import BadInput, ConnectError, NotInstalled
from .events import EventLog
from .job import Job
from .queue import MAX_BACKOFF, Queue, _lease, _queue_name, _seconds

log = logging.getLogger("pgqueue.worker")

Handler = Callable[[Job], Any]
_DISCONNECTS = (psycopg.OperationalError, psycopg.InterfaceError, ConnectError)


class _Bell:
    """Wakes idle threads; the generation number closes the claim-then-wait race."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.generation = 0

    def ring(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.generation != seen, timeout)


class _Link:
    """One thread's connection, reopened with capped exponential backoff when it drops."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.queue: Queue | None = None

    def get(self) -> Queue:
        delay = 0.05
        while self.queue is None:
            try:
                self.queue = Queue(self.worker.dsn, application_name=self.worker.app_name)
            except ConnectError as exc:
                if self.worker.stopping:
                    raise
                log.warning("%s: %s; retrying in %.1fs", self.worker.name, exc, delay)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)
        return self.queue

    def drop(self) -> None:
        if self.queue is not None:
            with contextlib.suppress(Exception):  # already broken; nothing to release
                self.queue.close()
            self.queue = None


class Worker:
    """Run ``handler(job)`` for jobs of ``queue`` in ``concurrency`` threads.

    ``start()``/``stop()`` for notebooks, ``run()`` to block until SIGINT/SIGTERM
    (or, with ``burst=True``, until no runnable job is left).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        queue: str = "default",
        dsn: str | None = None,
        concurrency: int = 1,
        batch: int = 1,
        lease: float = 30.0,
        poll_interval: float = 2.0,
        listen: bool = True,
        reap_interval: float = 5.0,
        backoff: float = 1.0,
        complete_in_batches: bool = False,
        burst: bool = False,
        name: str = "worker",
        events: EventLog | None = None,
    ) -> None:
        for what, value, upper in (("concurrency", concurrency, None), ("batch", batch, 10_000)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"{what} must be a whole number >= 1, got {value!r}")
            if upper is not None and value > upper:
                raise BadInput(f"{what} must be a whole number from 1 to {upper}, got {value!r}")
        for what, value in (("poll_interval", poll_interval), ("reap_interval", reap_interval)):
            if not isinstance(value, int | float) or not 0 < value < 1e6:
                raise BadInput(f"{what} must be a positive number of seconds, got {value!r}")
        # What the job threads' claims and fails would refuse, refused here instead: a
        # BadInput raised in a job thread would end it (and the worker) with a traceback.
        _queue_name(queue)
        _lease(lease)
        _seconds("backoff", backoff, upper=MAX_BACKOFF)
        self.handler = handler
        self.queue = queue
        self.dsn = resolve_dsn(dsn)
        self.concurrency = concurrency
        self.batch = batch
        self.lease = float(lease)
        self.poll_interval = float(poll_interval)
        self.listen = listen
        self.reap_interval = float(reap_interval)
        self.backoff = backoff
        self.complete_in_batches = complete_in_batches
        self.burst = burst
        self.name = name
        self.events = events if events is not None else EventLog()
        self.app_name = f"pgqueue worker {name}"  # how its sessions show in pg_stat_activity
        self.done = 0  # jobs this worker completed (accepted by fence)
        self.rejected = 0  # late writes the database refused

        self._bell = _Bell()
        self._stop = threading.Event()
        self._crashed = threading.Event()
        self._abandoned = threading.Event()  # grace is over: stop heartbeating
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[Job, str]] = {}  # job id -> (job, lane)
        self._finishing: set[int] = set()  # ids whose complete/fail/release is under way
        self._paused_until = 0.0
        self._pause_on_claim: float | None = None
        self._crash_on_claim = False
        self._threads: list[threading.Thread] = []
        self._job_threads: list[threading.Thread] = []

    # -- control ---------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> Worker:
        """Start the threads and return at once."""
        if self._threads:
            raise RuntimeError(f"worker {self.name} was already started")
        # Fail fast, in the caller's thread, on a bad DSN or a missing table.
        with Queue(self.dsn) as probe:
            probe.check()
        self._job_threads = [
            threading.Thread(
                target=self._work,
                args=(self._lane(i),),
                daemon=True,
                name=f"pgqueue-{self._lane(i)}",
            )
            for i in range(self.concurrency)
        ]
        self._threads = [
            *self._job_threads,
            threading.Thread(target=self._keep, daemon=True, name=f"pgqueue-{self.name}-keeper"),
        ]
        if self.listen:
            self._threads.append(
                threading.Thread(target=self._hear, daemon=True, name=f"pgqueue-{self.name}-listen")
            )
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, grace: float = 10.0) -> None:
        """Stop claiming; let running handlers finish within ``grace`` seconds. Claimed jobs
        not yet started are released; handlers still running after that keep their lease
        until it expires (then the reaper hands the job to someone else)."""
        self._stop.set()
        self._bell.ring()
        deadline = time.monotonic() + grace
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._abandoned.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the job threads to end (with ``burst=True``: the queue ran dry)."""
        for thread in self._job_threads:
            thread.join(timeout)

    def run(self, grace: float = 10.0) -> None:
        """Block until SIGINT/SIGTERM (or a dry queue with ``burst``), then stop gracefully."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        self.start()
        while not self._stop.is_set() and any(t.is_alive() for t in self._job_threads):
            self._stop.wait(0.2)
        self.stop(grace)

    @property
    def in_flight(self) -> list[Job]:
        """Jobs claimed and not yet finished by this worker."""
        with self._lock:
            return [job for job, _ in self._in_flight.values()]

    # -- teaching hooks: replay the failure stories ---------------------------------
    def pause(self, seconds: float) -> None:
        """Freeze now, like a GC pause or VM migration: no heartbeats, no progress, and
        afterwards carry on as if no time had passed."""
        self._paused_until = time.monotonic() + seconds
        self.events.record("pause", self.name, detail=f"{seconds:g}")

    def pause_on_next_claim(self, seconds: float) -> None:
        """Freeze right after the next claim, before its handler runs."""
        self._pause_on_claim = seconds

    def crash(self) -> None:
        """Die now, like SIGKILL: stop heartbeating, write nothing more, drop connections."""
        self._crashed.set()
        self._stop.set()
        self._bell.ring()
        self.events.record("crash", self.name)

    def crash_on_next_claim(self) -> None:
        """Die right after the next claim, holding its jobs."""
        self._crash_on_claim = True

    # -- job threads -----------------------------------------------------------------
    def _lane(self, index: int) -> str:
        return self.name if self.concurrency == 1 else f"{self.name}.{index}"

    def _record(self, lane: str, kind: str, job: Job, detail: str = "") -> None:
        self.events.record(kind, lane, job.id, job.fence, detail)

    def _work(self, lane: str) -> None:
        link = _Link(self)
        delay = 0.05
        try:
            while not self._stop.is_set():
                self._sleep_while_paused()
                seen = self._bell.generation
                try:
                    jobs = link.get().claim(self.queue, limit=self.batch, lease=self.lease)
                    delay = 0.05
                except NotInstalled:
                    raise
                except _DISCONNECTS as exc:
                    link.drop()
                    if self._stop.is_set():
                        break
                    log.warning("%s: claim failed (%s); reconnecting", lane, first_line(exc))
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if not jobs:
                    if self.burst:
                        break
                    self._bell.wait(seen, self.poll_interval)
                    continue
                self._take(jobs, lane)
                if self._crash_on_claim:
                    self._crash_on_claim = False
                    self.crash()
                    break
                if self._pause_on_claim is not None:
                    self.pause(self._pause_on_claim)
                    self._pause_on_claim = None
                self._run_batch(link, jobs, lane)
        finally:
            link.drop()

    def _take(self, jobs: list[Job], lane: str) -> None:
        # Per batch, not per job: one lock, one recorder shared by the batch, one record call.
        with self._lock:
            for job in jobs:
                self._in_flight[job.id] = (job, lane)
        on_event = functools.partial(self._record, lane)
        for job in jobs:
            job.on_event = on_event
        self.events.record_many(("claim", lane, j.id, j.fence, str(j.attempts)) for j in jobs)

    def _run_batch(self, link: _Link, jobs: list[Job], lane: str) -> None:
        succeeded: list[Job] = []
        for job in jobs:
            if self._crashed.is_set():
                return  # a crashed worker writes nothing; its leases run out
            if self._stop.is_set():
                self._finish(link, job, lane, "release")
                continue
            self._sleep_while_paused()
            if job.lost:  # taken over before its turn came: running it would run it twice
                with self._lock:
                    self._in_flight.pop(job.id, None)
                self._record(lane, "skipped", job, "lease lost before it started")
                continue
            job.conn = link.get().conn
            try:
                self.handler(job)
                error = None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            self._sleep_while_paused()  # a pause during the handler ends here
            if self._crashed.is_set():
                return
            if error is not None:
                self._finish(link, job, lane, "fail", error)
            elif self.complete_in_batches:
                succeeded.append(job)
            else:
                self._finish(link, job, lane, "complete")
        if succeeded:
            self._finish_many(link, succeeded, lane)

    def _finish(self, link: _Link, job: Job, lane: str, action: str, error: str = "") -> None:
        """complete / fail / release by fence, retried across reconnects (the fence makes
        a retry safe: it can only take effect while we still own the job)."""
        with self._lock:
            self._finishing.add(job.id)
        for attempt in range(6):
            try:
                queue = link.get()
                if action == "complete":
                    ok = queue.complete(job)
                elif action == "fail":
                    ok = queue.fail(job, error, backoff=self.backoff)
                else:
                    ok = queue.release(job)
                break
            except _DISCONNECTS as exc:
                link.drop()
                log.warning("%s: %s of job %s failed (%s)", lane, action, job.id, first_line(exc))
                time.sleep(0.05 * 2**attempt)
        else:
            ok = False  # give up: the lease expires and the reaper returns the job
        self._settle([job], lane, action, refused=set() if ok else {job.id}, error=error)

    def _finish_many(self, link: _Link, jobs: list[Job], lane: str) -> None:
        with self._lock:
            self._finishing.update(job.id for job in jobs)
        try:
            rejected = {j.id for j in link.get().complete_many(jobs)}
        except _DISCONNECTS:
            link.drop()
            for job in jobs:
                self._finish(link, job, lane, "complete")
            return
        self._settle(jobs, lane, "complete", refused=rejected)

    def _settle(
        self, jobs: list[Job], lane: str, action: str, refused: set[int], error: str = ""
    ) -> None:
        """Forget finished ``jobs`` (the ids in ``refused`` were late), count them and record
        how each ended: one lock and one record call for the batch."""
        with self._lock:
            for job in jobs:
                self._in_flight.pop(job.id, None)
                self._finishing.discard(job.id)
            self.rejected += len(refused)
            if action == "complete":
                self.done += len(jobs) - len(refused)
        self.events.record_many(
            (f"{action}-rejected", lane, j.id, j.fence, "")
            if j.id in refused
            else (action, lane, j.id, j.fence, error)
            for j in jobs
        )
        for job in jobs:
            if job.id in refused:
                log.warning(
                    "%s: late %s of job %s refused: fence %s is stale",
                    lane,
                    action,
                    job.id,
                    job.fence,
                )

    def _sleep_while_paused(self) -> None:
        while (left := self._paused_until - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    # -- keeper: heartbeats and the reaper --------------------------------------------
    def _keep(self) -> None:
        link = _Link(self)
        beat_every = self.lease / 3
        next_beat = time.monotonic() + beat_every
        next_reap = time.monotonic() + self.reap_interval * random.uniform(0.5, 1.0)
        try:
            while not (self._crashed.is_set() or self._abandoned.is_set()):
                if self._stop.is_set() and not self.in_flight:
                    break
                now = time.monotonic()
                if now < self._paused_until:  # a frozen process sends no heartbeats
                    time.sleep(0.02)
                    continue
                try:
                    if now >= next_beat:
                        self._heartbeat(link.get())
                        next_beat = now + beat_every
                    if now >= next_reap and not self._stop.is_set():
                        self._reap(link.get())
                        next_reap = now + self.reap_interval
                except _DISCONNECTS as exc:
                    link.drop()
                    log.warning("%s: keeper lost its connection (%s)", self.name, first_line(exc))
                    time.sleep(0.1)
                    continue
                wait = max(0.005, min(next_beat, next_reap) - time.monotonic())
                if self._stop.is_set():
                    time.sleep(min(wait, 0.05))  # stopping: keep beating for the grace period
                else:
                    self._stop.wait(wait)
        finally:
            link.drop()

    def _heartbeat(self, queue: Queue) -> None:
        with self._lock:
            held = [(job, lane) for job, lane in self._in_flight.values() if not job.lost]
        if not held:
            return
        lost = {job.id for job in queue.heartbeat_many([j for j, _ in held], lease=self.lease)}
        with self._lock:
            # A job finished meanwhile is not lost: its complete/fail event tells how it ended.
            ended = {i for i in lost if i in self._finishing or i not in self._in_flight}
        for job, lane in held:
            if job.id in ended:
                continue
            if job.id in lost:
                self._record(lane, "lease-lost", job)
                log.warning("%s: lost the lease on job %s (fence %s)", lane, job.id, job.fence)
            else:
                self._record(lane, "heartbeat", job)

    def _reap(self, queue: Queue) -> None:
        reaped = queue.reap()
        for row in reaped:
            self.events.record("reap", self.name, row.id, row.fence, row.status)
        if any(row.queue == self.queue and row.status == "ready" for row in reaped):
            self._bell.ring()

    # -- listener: LISTEN/NOTIFY as a wake-up hint ------------------------------------
    def _hear(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                with connect(self.dsn, application_name=self.app_name) as conn:
                    conn.execute("LISTEN pgqueue")
                    delay = 0.05
                    self._bell.ring()  # we may have missed hints while (re)connecting
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if note.payload == self.queue:
                                self._bell.ring()
            except _DISCONNECTS as exc:
                if self._stop.is_set():
                    return
                log.warning("%s: listener reconnecting (%s)", self.name, first_line(exc))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
