"""The test project's tasks (tests/integrations/test_django.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django.db import connection
from django.tasks import TaskContext, task

from pgqueue import MAX_RESULT_BYTES

from .models import Mark


@task()
def add(a: int, b: int) -> int:
    return a + b


@task()
async def add_async(a: int, b: int) -> int:
    return a + b


@task(queue_name="other")
def mark(name: str) -> int:
    return Mark.objects.create(name=name, pid=os.getpid()).pk


@task()
def backend_pid() -> int:
    """The PostgreSQL backend of this task's Django connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


@task(takes_context=True)
def attempt(context: TaskContext) -> int:
    return context.attempt


@task(takes_context=True)
def flaky(context: TaskContext) -> int:
    if context.attempt == 1:
        raise ValueError("first attempt fails")
    return context.attempt


@task()
def always_fails() -> None:
    raise ValueError("never works")


@task()
def returns_set() -> Any:
    return {1, 2}


@task()
def too_big() -> str:
    return "x" * (MAX_RESULT_BYTES + 1)


@task()
def exits() -> None:
    raise SystemExit("bye")


@task()
def interrupts() -> None:
    raise KeyboardInterrupt("stop")


@task(backend="short", queue_name="slow")
def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


@task(takes_context=True)
def hang_first(context: TaskContext, marker: str) -> int:
    """Write ``marker.N`` for attempt N; the first attempt then hangs (to be SIGKILLed)."""
    Path(f"{marker}.{context.attempt}").write_text(str(os.getpid()))
    if context.attempt == 1:
        time.sleep(120)
    return context.attempt


@task()
def outlives_its_lease() -> str:
    """A task that runs past its lease: it ends the lease of every running job and runs
    the reaper, as a reaper would once the lease ran out, then returns."""
    from pgqueue import statements

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE status = 'running'"
        )
        cursor.execute(statements.query("reap"))
    return "late"


@task()
def rendezvous(n: int) -> int:
    """Wait (at most 20 s) until ``n`` jobs have started (are running or done; one that saw
    the others running may have finished since); return this process's id."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM jobs WHERE status IN ('running', 'done')")
            if cursor.fetchone()[0] >= n:
                return os.getpid()
        time.sleep(0.05)
    raise TimeoutError(f"{n} tasks never ran at once")


def plain(*args: Any) -> str:
    """Not a task: a row naming it must not run it."""
    Path(os.environ["PGQUEUE_DJANGO_PWNED"]).write_text("plain ran")
    return "ran"
