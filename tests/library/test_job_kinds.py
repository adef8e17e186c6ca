"""A job says which kind of worker may run it (DESIGN.md invariant 12): a job enqueued
through the Django backend is run only by ``manage.py pgqueue_worker``; any other worker
fails it at once with an error that says so, and never 'completes' it unrun (before, a
plain worker on the same queue completed Django tasks without running them, and
``get_result`` said SUCCESSFUL with no attempt that ran). No Django needed here: the job is
written as the backend writes it; tests/integrations/test_django.py runs the real backend."""

from __future__ import annotations

import asyncio

from conftest import rows
from pgqueue import AsyncJob, AsyncWorker, Job, Queue, Worker

DJANGO_JOB = {"django": {"task": "shop.tasks.add", "args": [1, 2], "kwargs": {}}}


def test_a_plain_worker_fails_a_django_task_and_runs_nothing(queue: Queue, dsn: str) -> None:
    django = queue.enqueue(DJANGO_JOB, queue="emails")
    plain = queue.enqueue({"task": "shop.tasks.add"}, queue="emails")  # a plain job's own keys
    ran: list[int] = []

    def handler(job: Job) -> None:
        ran.append(job.id)

    Worker(handler, queue="emails", dsn=dsn, burst=True, poll_interval=0.05).run()
    assert ran == [plain]
    [(status, attempts, error)] = rows(
        dsn, "SELECT status, attempts, last_error FROM jobs WHERE id = %s", [django]
    )
    assert (status, attempts) == ("dead", 1)
    assert "Django task shop.tasks.add" in error and "pgqueue_worker" in error
    assert "\n" not in error
    assert rows(dsn, "SELECT status FROM jobs WHERE id = %s", [plain]) == [("done",)]


def test_an_async_worker_fails_a_django_task_too(queue: Queue, dsn: str) -> None:
    django = queue.enqueue(DJANGO_JOB, queue="q")
    ran: list[int] = []

    async def handler(job: AsyncJob) -> None:
        ran.append(job.id)

    async def main() -> None:
        await AsyncWorker(handler, queue="q", dsn=dsn, burst=True, poll_interval=0.05).run()

    asyncio.run(main())
    assert ran == []
    assert rows(dsn, "SELECT status FROM jobs WHERE id = %s", [django]) == [("dead",)]
