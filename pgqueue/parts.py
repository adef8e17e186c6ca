"""The Worker's small parts: the bell that wakes idle lanes, a connection that reopens
itself, a lane, a held job, how a handler failed, and how an error is described."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from .db import first_line
from .errors import ConnectError, PgQueueError
from .job import Job
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


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``: what a job's ``last_error`` and logs say."""
    text = first_line(exc) if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_setup_error(exc: BaseException) -> bool:
    """An error of pgqueue's own that says a setting is wrong (prepared statements through
    PgBouncer, a dropped table): every retry would meet it again. Lost connections are not."""
    return isinstance(exc, PgQueueError) and not isinstance(exc, ConnectError)


class _TaskRules:
    """Each job's timeout and backoff: its task's when the handler is a ``Tasks`` registry
    and the task sets one, else the worker's (shared by Worker and AsyncWorker)."""

    tasks: Tasks | None
    timeout: float | None
    backoff: float

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
