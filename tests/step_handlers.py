"""A three-step handler for worker subprocesses (tests/library/test_steps.py):
``pgqueue worker tests.step_handlers:three_steps``.

Each step's function logs its run to ``step_runs`` (``STEP_RUNS``) with the attempt that
ran it, so a test counts how often each step really ran. After step 2 is stored, on the
first attempt only, the handler creates the file named by the payload's ``after_two`` and
hangs, so the test knows when to SIGKILL the worker: between step 2 and step 3.
"""

from __future__ import annotations

import time
from pathlib import Path

from pgqueue import Job

STEP_RUNS = "CREATE TABLE step_runs (job_id bigint, step text, attempt int)"


def three_steps(job: Job) -> None:
    def run(step: str) -> dict[str, object]:
        assert job.conn is not None
        job.conn.execute("INSERT INTO step_runs VALUES (%s, %s, %s)", [job.id, step, job.attempts])
        return {"step": step, "attempt": job.attempts}

    job.step("one", lambda: run("one"))
    job.step("two", lambda: run("two"))
    if job.attempts == 1:
        Path(job.payload["after_two"]).touch()
        time.sleep(600)  # killed here
    job.step("three", lambda: run("three"))
