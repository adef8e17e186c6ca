"""One attempt of a Django task on a claimed job: the handler ``pgqueue_worker`` runs, and
what an ``IMMEDIATE`` backend runs in the caller's thread.

It loads the task the job names (only a ``django.tasks.Task``: see ``stored.load_task``),
records the attempt (a durable step under the claim), sends ``task_started``, calls the
task (with a ``TaskContext`` whose ``attempt`` counts claims from 1), and returns its
return value for the worker's fenced completion to store. An exception is recorded as a
step (class path and traceback) and raised again, so the worker fails the job by its
rules (retry with backoff, dead at max_attempts); ``task_finished`` is sent once the task
has ended for good: successful, or failed on its last attempt. A return value that is not
JSON, or over ``pgqueue.MAX_RESULT_BYTES``, fails the task at once. A task that cannot be
imported, or a path naming anything but a task, fails the job at once and runs nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from traceback import format_exception
from typing import Any

from django.db import close_old_connections
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.base import TaskError
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from pgqueue.errors import BadInput, GiveUp, LeaseLost
from pgqueue.handlers import describe
from pgqueue.inputs import result_text
from pgqueue.job import Job
from pgqueue.queue import Queue
from pgqueue.steps import StepState

from . import stored
from .store import Store


def worker_id(name: str) -> str:
    """How a worker shows in ``TaskResult.worker_ids``: its name, host and process."""
    return f"{name}@{socket.gethostname()}:{os.getpid()}"


class Runner:
    """Run one attempt of the Django task a job names (see the module's docstring).
    ``interrupts``: a ``KeyboardInterrupt`` from the task propagates (``IMMEDIATE``); in a
    worker it fails the attempt like any exception, and the worker goes on."""

    # The kind of job this handler runs: a worker with any other handler fails a Django
    # task's job instead of 'completing' it unrun (rules.not_ours).
    runs = "django"

    def __init__(self, worker: str, *, interrupts: bool = False) -> None:
        self.worker_id = worker
        self.interrupts = interrupts

    def run(self, job: Job, store: Store) -> Any:
        with store.use() as queue:
            state = queue.get(job.id)
            # A first attempt has no steps yet: a claim given back unstarted wrote none.
            steps = queue.steps(job.id) if job.attempts > 1 else []
        if state is None:  # deleted under us (prune of a done job cannot: it is running)
            raise LeaseLost(f"job {job.id} is gone")
        name = f"{stored.ATTEMPT}{job.fence}"
        attempt = {"worker_id": self.worker_id, "started_at": stored._text(state.started_at)}
        with store.use():
            job.step(name, lambda: attempt)
        steps.append(StepState(name, job.fence, state.started_at, attempt))
        try:
            task = stored.load_task(stored.fields(job.payload, job.id))
        except Exception as exc:  # ImportError, InvalidTask, a malformed row: run nothing
            self._record(job, store, exc)
            raise GiveUp(f"job {job.id}: {describe(exc)}") from exc
        result = stored.task_result(task, state, steps)
        sender = type(task.get_backend())
        task_started.send(sender=sender, task_result=result)
        try:
            value = _call(task, result)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and self.interrupts:
                self._record(job, store, exc)
                raise
            final = isinstance(exc, GiveUp) or job.attempts >= job.max_attempts
            self._failed(job, store, result, exc, final)
            raise
        try:
            value = normalize_json(value)
            result_text(value)  # over MAX_RESULT_BYTES: BadInput, before anything is stored
        except (TypeError, ValueError, BadInput) as exc:
            self._failed(job, store, result, exc, final=True)
            raise GiveUp(f"task {task.module_path}: {describe(exc)}") from exc
        if not job.lost:  # (timed out, cancelled, taken over: the stored end is another)
            with store.use() as queue:
                _end(result, TaskResultStatus.SUCCESSFUL, store.now(queue))
            object.__setattr__(result, "_return_value", value)
            task_finished.send(sender=sender, task_result=result)
        return value

    def __call__(self, job: Job) -> Any:
        """The worker's handler: Django's connections are closed before and after each
        task when they are past CONN_MAX_AGE or broken, as Django's request cycle does."""
        close_old_connections()
        try:
            return self.run(job, _LaneStore(job))
        finally:
            close_old_connections()

    def _failed(
        self, job: Job, store: Store, result: TaskResult, exc: BaseException, final: bool
    ) -> None:
        """Record a failed attempt; if it was the last, the task FAILED: ``task_finished``
        (called inside the ``except``, so Django's log line carries the traceback)."""
        error = self._record(job, store, exc)
        if not final or job.lost:
            return
        if error is not None:
            result.errors.append(error)
        with store.use() as queue:
            _end(result, TaskResultStatus.FAILED, store.now(queue))
        task_finished.send(sender=type(result.task.get_backend()), task_result=result)

    def _record(self, job: Job, store: Store, exc: BaseException) -> TaskError | None:
        """Store the exception of this attempt as the step ``error F``; None if the claim
        is over (then nothing is stored, and the worker's fail is refused too)."""
        kind = type(exc)
        error = TaskError(
            exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
            traceback="".join(format_exception(exc)),
        )
        output = {"exception_class_path": error.exception_class_path, "traceback": error.traceback}
        try:
            with store.use():
                job.step(f"{stored.ERROR}{job.fence}", lambda: output)
        except LeaseLost:
            return None
        return error


class _LaneStore(Store):
    """A worker's lane: its own pgqueue connection, ``job.conn``."""

    def __init__(self, job: Job) -> None:
        self.job = job

    @contextmanager
    def use(self) -> Iterator[Queue]:
        assert self.job.conn is not None
        yield Queue(self.job.conn)


def _call(task: Task, result: TaskResult) -> Any:
    if task.takes_context:
        return task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
    return task.call(*result.args, **result.kwargs)


def _end(result: TaskResult, status: TaskResultStatus, now: Any) -> None:
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", stored.as_django_time(now))
