"""The Worker's small parts: the bell that wakes idle lanes, a connection that reopens
itself, a lane, a held job, how a handler failed, and how an error is described."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from .db import first_line, pgbouncer_mode, resolve_dsn
from .errors import BadInput, ConnectError, PgQueueError
from .events import EventLog, NullEventLog
from .job import Job
from .params import MAX_BACKOFF, MAX_LEASE, _lease, _seconds, queue_names
from .queue import Queue
from .tasks import Task, Tasks

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("pgqueue.worker")

_DISCONNECTS = (psycopg.OperationalError, psycopg.InterfaceError, ConnectError)
_FINISH_TRIES = 6


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
                self.queue = Queue(
                    self.worker.dsn,
                    application_name=self.worker.app_name,
                    pgbouncer=self.worker.pgbouncer,
                )
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


@dataclass(eq=False)
class _Lane:
    """One slot of the worker's concurrency. When its handler times out, a new lane
    (same slot, next generation) takes its place and the old thread is retired."""

    slot: str
    generation: int = 1
    thread: threading.Thread | None = None
    retired: bool = False

    @property
    def name(self) -> str:
        return self.slot if self.generation == 1 else f"{self.slot}/{self.generation}"


Key = tuple[int, int]  # (job id, fence): one claim of one job


def _key(job: Job) -> Key:
    """What a worker files a claim under. Not the id alone: a job failed with no backoff
    can be claimed again by another lane of the same worker before the first claim's
    bookkeeping is over, and the two claims must not be taken for one."""
    return (job.id, job.fence)


@dataclass(eq=False)
class _Held:
    """A claimed job this worker has not finished: its lane, and when its handler began."""

    job: Job
    lane: _Lane
    started: float | None = None  # time.monotonic() when the handler began
    timeout: float | None = None  # this job's (its task's, else the worker's)
    expiry_seen: bool = False  # the keeper has reported its lease running out here


@dataclass(frozen=True)
class _Failure:
    """How a handler failed: the error text for ``last_error``, and what it asked for."""

    error: str
    delay: float | None = None  # RetryAfter
    give_up: bool = False  # GiveUp


def end_kind(action: str, end: str) -> str:
    """The event a finished job records: its action, the action refused, or a give-up."""
    return {"ok": action, "refused": f"{action}-rejected", "gave-up": "gave-up"}[end]


def log_end(lane: str, job: Job, action: str, end: str, error: str) -> None:
    """Log what needs a person's eyes: a refused write, a give-up, a failed attempt."""
    if end == "refused":
        log.warning(
            "%s: late %s of job %s refused: fence %s is stale (another holder has it)",
            lane,
            action,
            job.id,
            job.fence,
        )
    elif end == "gave-up":
        log.warning(
            "%s: gave up on the %s of job %s after %d tries; its lease will run out "
            "and the reaper will return it",
            lane,
            action,
            job.id,
            _FINISH_TRIES,
        )
    elif action == "fail":
        then = "now dead" if job.status == "dead" else f"retry in {job.retry_in or 0.0:.1f}s"
        log.warning(
            "%s: job %s (%s) failed, attempt %d of %d: %s; %s",
            lane,
            job.id,
            job.queue,
            job.attempts,
            job.max_attempts,
            error.splitlines()[0] if error else "",
            then,
        )


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``: what a job's ``last_error`` and logs say. Never
    raises: an exception whose ``__str__`` itself fails is still named."""
    try:
        text = first_line(exc) if str(exc).strip() else ""
    except BaseException:  # a user's __str__ can raise anything
        text = "(its message could not be read: its __str__ raised)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_setup_error(exc: BaseException) -> bool:
    """An error of pgqueue's own that says a setting is wrong (prepared statements through
    PgBouncer, a dropped table): every retry would meet it again. Lost connections are not."""
    return isinstance(exc, PgQueueError) and not isinstance(exc, ConnectError)


class _TaskRules:
    """The options Worker and AsyncWorker share, checked and kept in one place, and each
    job's timeout and backoff: its task's when the handler is a ``Tasks`` registry and the
    task sets one, else the worker's."""

    tasks: Tasks | None
    timeout: float | None
    backoff: float

    def _take_options(
        self,
        handler: Any,
        *,
        queue: str | Sequence[str] | None,
        dsn: str | None,
        concurrency: int,
        batch: int,
        lease: float,
        poll_interval: float,
        listen: bool,
        listen_dsn: str | None,
        pgbouncer: bool | None,
        reap_interval: float,
        backoff: float,
        timeout: float | None,
        complete_in_batches: bool,
        flush_after: float,
        burst: bool,
        name: str,
        events: EventLog | None,
        record_events: bool,
    ) -> None:
        """Check the shared options (one-line ``BadInput``) and keep them; what the claims
        and fails would refuse later is refused here."""
        for what, value in (("poll_interval", poll_interval), ("reap_interval", reap_interval)):
            if not isinstance(value, int | float) or not 0 < value < 1e6:
                raise BadInput(f"{what} must be a positive number of seconds, got {value!r}")
        if timeout is not None and not _seconds("timeout", timeout, upper=MAX_LEASE) > 0:
            raise BadInput("timeout must be more than 0 seconds (or None for no timeout)")
        self.tasks = handler if isinstance(handler, Tasks) else None
        if queue is None:
            queue = (self.tasks.queues or ["default"]) if self.tasks else "default"
        self.queues = queue_names(queue)
        _lease(lease)
        _seconds("backoff", backoff, upper=MAX_BACKOFF)
        self.handler = handler
        self.queue = self.queues[0] if len(self.queues) == 1 else self.queues
        self.dsn = resolve_dsn(dsn)
        # Behind PgBouncer in transaction mode a LISTEN would be lost with its server
        # connection: listen only on a direct one (listen_dsn), else poll.
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
        self.burst = burst
        self.name = name
        # The record the notebooks draw; a couple of microseconds a job, so production
        # runs that never read it switch it off.
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

    def _tally(self, action: str, ends: Sequence[tuple[Job, str]]) -> None:
        """Count finished jobs by how each ended ('ok', 'refused', 'gave-up'); the threaded
        Worker calls it under its lock."""
        self.rejected += sum(end == "refused" for _, end in ends)
        self.gave_up += sum(end == "gave-up" for _, end in ends)
        ok = [job for job, end in ends if end == "ok"]
        if action == "complete":
            self.done += len(ok)
        elif action == "fail":
            self.failed += len(ok)
            self.dead += sum(job.status == "dead" for job in ok)

    def _timeout_for(self, job: Job) -> float | None:
        task = self._task_of(job)
        return task.timeout if task and task.timeout is not None else self.timeout

    def _backoff_for(self, job: Job) -> float:
        task = self._task_of(job)
        return task.backoff if task and task.backoff is not None else self.backoff

    def _task_of(self, job: Job) -> Task | None:
        if self.tasks is None:
            return None
        try:
            return self.tasks.for_job(job)
        except LookupError:
            return None
