"""A registry with one periodic task, for worker subprocesses in the tests:
``pgqueue worker tests.periodic_tasks:tasks``. Its job does nothing and completes."""

from __future__ import annotations

import pgqueue

tasks = pgqueue.Tasks()


@tasks.periodic(every=1, queue="ticks")
def every_second(job: pgqueue.Job) -> None:
    """Do nothing: the test reads which slots got a job from the tables."""
