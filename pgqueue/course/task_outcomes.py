"""A task registry run until its jobs settle, and what became of each job, for the lesson
on job semantics: the worker, the wait and the table stay out of the notebook's cells, the
tasks and the asserts on their outcomes stay in them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..events import EventLog
from ..queue import Queue
from ..tasks import Tasks
from ..worker import Worker

if TYPE_CHECKING:
    import pandas as pd

UNSETTLED = ("ready", "running")  # a job in one of these may still change


def run_until_settled(
    tasks: Tasks,
    dsn: str,
    jobs: Mapping[str, int],
    *,
    events: EventLog,
    timeout: float = 20.0,
) -> None:
    """Run one worker over every queue of ``tasks`` until none of ``jobs`` is ready or
    running (a retry waits as ``ready``), then stop it. Raises ``TimeoutError`` after
    ``timeout`` seconds."""
    worker = Worker(tasks, dsn=dsn, poll_interval=0.05, listen=False, events=events).start()
    deadline = time.monotonic() + timeout
    try:
        with Queue(dsn) as q:
            while any(_status(q, i) in UNSETTLED for i in jobs.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the tasks did not settle within {timeout:g} s")
                time.sleep(0.05)
    finally:
        worker.stop(grace=1)


def _status(q: Queue, job_id: int) -> str | None:
    state = q.get(job_id)
    return None if state is None else state.status


def outcomes(dsn: str, jobs: Mapping[str, int]) -> pd.DataFrame:
    """One row per task name: its job's status, attempts and last error, as stored."""
    import pandas as pd

    with Queue(dsn) as q:
        states = {name: q.get(i) for name, i in jobs.items()}
    rows = [
        {"task": n, "status": s.status, "attempts": s.attempts, "last_error": s.last_error}
        for n, s in states.items()
        if s is not None
    ]
    return pd.DataFrame(rows).set_index("task")
