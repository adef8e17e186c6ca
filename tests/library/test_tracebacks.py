"""A handler's exception keeps its traceback where a user looks next (#33 item 4): the job's
row (``Queue.get(...).traceback``, ``pgqueue show``, the dashboard's job page) and, with
``-v``, the worker's log; the one-line log and ``last_error`` stay one line. Before, a
typo'd key gave ``KeyError: 'adress'`` with no file or line anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import rows
from pgqueue import Job, Queue, Worker
from pgqueue.params import MAX_TRACEBACK

ROOT = Path(__file__).resolve().parents[2]
PGQUEUE = str(Path(sys.executable).with_name("pgqueue"))


def typo(job: Job) -> None:
    address = job.payload["adress"]  # the typo of the issue
    print(address)


def test_the_traceback_is_kept_with_the_job_and_the_error_stays_one_line(
    queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({"address": "a@example.com"}, queue="q", max_attempts=1)
    Worker(typo, queue="q", dsn=dsn, burst=True, poll_interval=0.05).run()
    state = queue.get(job_id)
    assert state is not None and state.status == "dead"
    assert state.last_error == "KeyError: 'adress'"
    assert state.traceback is not None
    assert 'test_tracebacks.py", line' in state.traceback and "in typo" in state.traceback
    assert 'address = job.payload["adress"]' in state.traceback
    assert state.traceback.rstrip().endswith("KeyError: 'adress'")
    assert "engine.py" not in state.traceback  # from the handler's own frame on


def test_a_long_traceback_is_bounded_to_its_end(queue: Queue, dsn: str) -> None:
    def deep(job: Job, n: int = 0) -> None:
        if n < 400:
            deep(job, n + 1)
        raise ValueError("at the bottom")

    job_id = queue.enqueue({}, queue="q", max_attempts=1)
    Worker(deep, queue="q", dsn=dsn, burst=True, poll_interval=0.05).run()
    [(trace,)] = rows(dsn, "SELECT traceback FROM jobs WHERE id = %s", [job_id])
    assert len(trace) <= MAX_TRACEBACK and trace.rstrip().endswith("ValueError: at the bottom")


def test_a_reaped_job_keeps_no_traceback_of_an_attempt_that_raised_nothing(
    queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert queue.fail(job, "ValueError: first", backoff=0, traceback="Traceback ...\nValueError")
    [job] = queue.claim("q")
    rows(dsn, "UPDATE jobs SET lease_until = now() - interval '1 s' RETURNING id")
    assert [r.id for r in queue.reap()] == [job_id]
    state = queue.get(job_id)
    assert state is not None and state.traceback is None
    assert state.last_error is not None and state.last_error.startswith("lease ran out")


def test_pgqueue_show_prints_it_and_the_worker_logs_it_with_v(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "typo_tasks.py").write_text(
        "def send(job):\n    return job.payload['adress']\n", encoding="utf-8"
    )
    with Queue(dsn) as q:
        job_id = q.enqueue({"address": "x"}, queue="q", max_attempts=1)
    worker = subprocess.run(
        [PGQUEUE, "--dsn", dsn, "-v", "worker", "typo_tasks:send", "--queue", "q", "--burst"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode == 0, worker.stderr
    assert "KeyError: 'adress'" in worker.stderr
    assert 'typo_tasks.py", line 2, in send' in worker.stderr  # the traceback, with -v
    shown = subprocess.run(
        [PGQUEUE, "--dsn", dsn, "show", str(job_id)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "traceback" in shown.stdout and 'typo_tasks.py", line 2' in shown.stdout
    quiet = subprocess.run(
        [PGQUEUE, "--dsn", dsn, "worker", "typo_tasks:send", "--queue", "q", "--burst"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in quiet.stderr  # without -v: the one line only


def test_the_dashboards_job_page_shows_it(queue: Queue, dsn: str) -> None:
    from starlette.testclient import TestClient

    from pgqueue.contrib import dashboard

    job_id = queue.enqueue({"address": "a@example.com"}, queue="q", max_attempts=1)
    Worker(typo, queue="q", dsn=dsn, burst=True, poll_interval=0.05).run()
    with TestClient(dashboard.app(dsn, read_only=True)) as client:
        page = client.get(f"/jobs/{job_id}").text
        api = client.get(f"/api/jobs/{job_id}").json()
    assert "<h2>Traceback</h2>" in page and "in typo" in page
    assert api["traceback"].rstrip().endswith("KeyError: 'adress'")
