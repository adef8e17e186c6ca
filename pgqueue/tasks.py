"""``Tasks``: one worker runs many job types, each with its own queue, attempts and timeout.

>>> tasks = pgqueue.Tasks()
>>> @tasks.task(queue="emails", max_attempts=3, timeout=60, backoff=2.0)
... def send(job, to):
...     ...
>>> send.enqueue(to="a@example.com")                  # a job {"task": "send", "kwargs": {...}}
>>> send.configure(key="welcome-a", delay=60).enqueue(to="a@example.com")
>>> send.configure(group="tenant-42").enqueue(to="b@example.com")  # see Queue.limit

and ``pgqueue worker myapp:tasks`` (or ``Worker(tasks)``) runs every task's queue.
``@tasks.periodic(cron="*/5 * * * *")`` or ``@tasks.periodic(every=30)`` declares a task
whose jobs are made on a schedule by the workers of its queue (see ``periodic.py``). A task
function is called as ``fn(job, **kwargs)``: the job is there for ``job.fenced_write`` and
``job.raise_if_lost()``. Raise ``pgqueue.GiveUp`` to send the job dead at once, or
``pgqueue.RetryAfter(seconds)`` to retry it then (it counts as an attempt). A job naming
a task this worker does not know fails with a clear error, like any handler error, and
retries with backoff (a newer worker may know it); the worker goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import psycopg

from . import defaults
from .errors import BadInput
from .inputs import MAX_BACKOFF, MAX_LEASE, checked_group, checked_queue_name, checked_seconds
from .job import Job
from .periodic import Schedule
from .queue import Queue


@dataclass(frozen=True)
class _Options:
    key: str | None = None
    delay: float = 0.0
    run_at: datetime | None = None
    priority: int | None = None
    conn: psycopg.Connection | None = None
    group: str | None = None


@dataclass(frozen=True)
class Task:
    """One job type: its function and how its jobs are enqueued, retried and timed out."""

    name: str
    fn: Callable[..., Any]
    queue: str
    max_attempts: int
    timeout: float | None
    backoff: float | None
    priority: int
    registry: Tasks = field(repr=False, compare=False)
    options: _Options = field(default_factory=_Options, repr=False, compare=False)
    group: str | None = None  # its jobs' group, unless configure() gives another

    def __call__(self, job: Job, **kwargs: Any) -> Any:
        """Run the task's function directly (as a worker does)."""
        return self.fn(job, **kwargs)

    def configure(
        self,
        *,
        key: str | None = None,
        delay: float = 0.0,
        run_at: datetime | None = None,
        priority: int | None = None,
        conn: psycopg.Connection | None = None,
        group: str | None = None,
    ) -> Task:
        """This task with enqueue options: a unique ``key``, a ``delay`` or ``run_at``, a
        ``priority``, your own transaction's ``conn``, or a ``group`` (in place of the
        task's own) whose jobs run at most the queue's per-group limit at once."""
        options = _Options(key, delay, run_at, priority, conn, checked_group(group))
        return replace(self, options=options)

    def enqueue(self, **kwargs: Any) -> int:
        """Enqueue one job of this task with these keyword arguments (JSON values); its id."""
        o = self.options
        # In your transaction (configure(conn=...)) the registry opens no connection of its own.
        queue = self.registry.queue if o.conn is None else Queue(o.conn)
        return queue.enqueue(
            {"task": self.name, "kwargs": kwargs},
            queue=self.queue,
            max_attempts=self.max_attempts,
            priority=self.priority if o.priority is None else o.priority,
            key=o.key,
            delay=o.delay,
            run_at=o.run_at,
            group=self.group if o.group is None else o.group,
        )


class Tasks:
    """A registry of tasks; a Worker given one runs every task's queue."""

    def __init__(self, dsn: str | None = None) -> None:
        self.dsn = dsn
        self.tasks: dict[str, Task] = {}
        self.schedules: dict[str, Schedule] = {}  # by name: the periodic ones
        self._queue: Queue | None = None
        self._lock = threading.Lock()

    @property
    def queue(self) -> Queue:
        """The Queue that ``Task.enqueue`` writes with (opened on first use)."""
        with self._lock:
            if self._queue is None:
                self._queue = Queue(self.dsn)
            return self._queue

    @property
    def queues(self) -> list[str]:
        """Every queue a task of this registry uses, in the order they were declared."""
        return list(dict.fromkeys(t.queue for t in self.tasks.values()))

    def task(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        queue: str = "default",
        max_attempts: int = defaults.MAX_ATTEMPTS,
        timeout: float | None = None,
        backoff: float | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> Any:
        """Register ``fn`` as a task (a decorator, with or without options). ``timeout`` and
        ``backoff`` (seconds; retry after ``backoff * 2**attempts``) override the worker's;
        its jobs are in ``group`` (limited by ``Queue.limit``) unless ``configure`` says."""

        def register(fn: Callable[..., Any]) -> Task:
            task_name = name or getattr(fn, "__name__", "")
            if not task_name or task_name in self.tasks:
                raise BadInput(f"a task needs a unique name; {task_name!r} is taken or empty")
            if (
                isinstance(max_attempts, bool)
                or not isinstance(max_attempts, int)
                or max_attempts < 1
            ):
                raise BadInput(f"max_attempts must be a whole number >= 1, got {max_attempts!r}")
            if timeout is not None and not checked_seconds("timeout", timeout, upper=MAX_LEASE) > 0:
                raise BadInput("timeout must be more than 0 seconds (or None)")
            if backoff is not None:
                checked_seconds("backoff", backoff, upper=MAX_BACKOFF)
            task = Task(
                task_name,
                fn,
                checked_queue_name(queue),
                max_attempts,
                timeout,
                backoff,
                priority,
                self,
                group=checked_group(group),
            )
            self.tasks[task_name] = task
            return task

        return register if fn is None else register(fn)

    def periodic(
        self,
        *,
        cron: str | None = None,
        every: float | None = None,
        name: str | None = None,
        catch_up: str = "latest",
        queue: str | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,
        backoff: float | None = None,
        priority: int | None = None,
    ) -> Callable[[Callable[..., Any]], Task]:
        """Register a function as a task whose jobs the workers of its queue make on a
        schedule: ``cron`` (five fields, UTC) or ``every`` (seconds, >= 1), one job per
        slot however many workers tick. ``name`` names the schedule and the task (default:
        the function's name). ``catch_up`` after every worker was down: "latest" (one job
        for the newest missed slot), "all" (each missed slot, the newest 100 at most) or
        "none". The other options are the task's (``task``); over a task already
        registered (stacked decorators: a task with several schedules) give none of them.
        It is a task like any other: ``.enqueue()`` adds a job by hand."""
        options = {"queue": queue, "max_attempts": max_attempts, "timeout": timeout}
        options |= {"backoff": backoff, "priority": priority}

        def register(fn: Callable[..., Any]) -> Task:
            given = {k: v for k, v in options.items() if v is not None}
            if isinstance(fn, Task) and (fn.registry is not self or given):
                raise BadInput(
                    f"@periodic over task {fn.name!r} takes no task options ({given}) and "
                    "only a task of this registry: give the options to @tasks.task"
                )
            task = fn if isinstance(fn, Task) else self.task(fn, name=name, **given)
            try:
                schedule_name = name or task.name
                if schedule_name in self.schedules:
                    raise BadInput(
                        f"two schedules are named {schedule_name!r}: give one another name="
                    )
                schedule = Schedule.of(
                    schedule_name,
                    task.name,
                    task.queue,
                    cron=cron,
                    every=every,
                    catch_up=catch_up,
                    max_attempts=task.max_attempts,
                    priority=task.priority,
                )
            except BadInput:
                if task is not fn:  # a bad schedule leaves nothing registered
                    del self.tasks[task.name]
                raise
            self.schedules[schedule.name] = schedule
            return task

        return register

    def __call__(self, job: Job) -> Any:
        """Run the task a job names (the Worker's handler)."""
        return self.for_job(job)(job, **job.payload.get("kwargs", {}))

    def for_job(self, job: Job) -> Task:
        """The task a job names; ``LookupError`` (one line) if this registry has none."""
        name = job.payload.get("task")
        task = self.tasks.get(name) if isinstance(name, str) else None
        if task is None:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise LookupError(f"no task named {name!r} in this worker (it knows: {known})")
        return task

    def close(self) -> None:
        """Close the Queue used for enqueueing, if one was opened."""
        with self._lock:
            if self._queue is not None:
                self._queue.close()
                self._queue = None
