"""``TaskBackend``: Django's ``django.tasks`` on pgqueue.

A task is a pgqueue job (``stored.py`` says what is kept where); ``manage.py
pgqueue_worker`` runs them with pgqueue's leases, heartbeats, reaper, fencing and retries.
With ``OPTIONS = {"IMMEDIATE": True}`` each task runs at enqueue instead, in the calling
thread, through the same claim, run and fenced completion statements (one attempt).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued
from django.utils import timezone

from pgqueue.errors import PgQueueError
from pgqueue.handlers import describe
from pgqueue.inputs import MAX_LEASE

from . import stored
from .options import BackendOptions
from .runner import Runner, worker_id
from .store import DjangoStore, OwnStore, Store, django_is_postgresql, task_dsn

IMMEDIATE_LEASE = 3600.0  # an immediate task's claim: nobody else can run it (its own queue)


class TaskBackend(BaseTaskBackend):
    """``TASKS = {"default": {"BACKEND": "pgqueue.contrib.django.TaskBackend",
    "QUEUES": [...], "OPTIONS": {...}}}``; OPTIONS: see ``BackendOptions``."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.settings = BackendOptions.of(alias, self.options)
        # IMMEDIATE runs a task at enqueue: like Django's own immediate backend, it cannot
        # defer one, so a run_after is refused (InvalidTask) rather than ignored.
        self.supports_defer = not self.settings.immediate
        self.worker_id = worker_id("immediate")
        self._store: Store | None = None
        self._own: OwnStore | None = None  # for sync calls in an async context

    # -- where the tasks are ---------------------------------------------------------------
    @property
    def store(self) -> Store:
        """Django's connection when the task database is Django's own, else one of ours;
        ours too in an async context, where Django refuses its connections to sync code
        (a sync ``get_result`` there blocks the loop for one read, as the ORM would)."""
        if self._store is None:
            if self.settings.dsn is None and django_is_postgresql():
                self._store = DjangoStore()
            else:
                self._store = OwnStore(task_dsn(self.settings.dsn))
        if isinstance(self._store, DjangoStore) and _in_event_loop():
            if self._own is None:
                self._own = OwnStore(task_dsn(self.settings.dsn), keep=False)
            return self._own
        return self._store

    @property
    def dsn(self) -> str:
        """The task database's DSN, for the worker's own connections."""
        return task_dsn(self.settings.dsn)

    # -- django.tasks ----------------------------------------------------------------------
    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        result = TaskResult(  # args and kwargs are checked (JSON) before anything is written
            task=task,
            id="",
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        o = self.settings
        with self.store.use() as queue:
            now = self.store.now(queue)
            data = stored.payload(task, result, now)
            if o.immediate:  # a queue of its own, so the claim below takes this job
                name = f"pgqueue.django.immediate.{secrets.token_hex(8)}"
                job_id = queue.enqueue(data, queue=name, max_attempts=1, priority=task.priority)
            else:
                run_at = task.run_after
                if run_at is not None and timezone.is_naive(run_at):
                    run_at = timezone.make_aware(run_at)
                job_id = queue.enqueue(
                    data,
                    queue=task.queue_name,
                    max_attempts=o.max_attempts,
                    priority=task.priority,
                    run_at=run_at,
                )
        object.__setattr__(result, "id", str(job_id))
        object.__setattr__(result, "enqueued_at", stored.as_django_time(now))
        task_enqueued.send(type(self), task_result=result)
        if o.immediate:
            return self._run_now(name, job_id)
        return result

    def get_result(self, result_id: Any) -> TaskResult:
        job_id = _job_id(result_id)
        with self.store.use() as queue:
            state = queue.get(job_id) if job_id is not None else None
            steps = queue.steps(job_id) if state is not None else []
        if state is None:
            raise TaskResultDoesNotExist(result_id)
        data = stored.fields(state.payload, state.id)
        try:
            task = stored.load_task(data)
        except Exception as exc:  # ImportError, InvalidTask: no task of ours has this id
            raise TaskResultMismatch(f"task {result_id}: {describe(exc)}") from exc
        return stored.task_result(task, state, steps)

    # -- IMMEDIATE -------------------------------------------------------------------------
    def _run_now(self, queue_name: str, job_id: int) -> TaskResult:
        lease = min(max(self.settings.lease, IMMEDIATE_LEASE), MAX_LEASE)
        with self.store.use() as queue:
            jobs = queue.claim(queue_name, lease=lease)
        if [job.id for job in jobs] != [job_id]:
            raise PgQueueError(f"task {job_id} was enqueued but could not be claimed")
        [job] = jobs
        try:
            value = Runner(self.worker_id, interrupts=True).run(job, self.store)
        except BaseException as exc:  # SystemExit too: the task FAILED
            with self.store.use() as queue:
                queue.fail(job, describe(exc), give_up=True)
            if isinstance(exc, KeyboardInterrupt):
                raise
        else:
            with self.store.use() as queue:
                queue.complete(job, value)
        return self.get_result(str(job_id))


def _in_event_loop() -> bool:
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _job_id(result_id: Any) -> int | None:
    text = str(result_id)
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) < 2**63:
        return None
    return int(text)
