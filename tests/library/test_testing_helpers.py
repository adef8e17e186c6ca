"""``pgqueue.testing``, the helpers for users' own tests: the fixtures (a throwaway database
with the table), ``drain`` (the enqueued jobs run inline through the real statements, never
sleeping) and ``assert_enqueued`` (a readable failure). These tests use the fixtures as a
user's tests would; tests/conftest.py points them at the session's test server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest

from pgqueue import GiveUp, Job, Queue, RetryAfter, Tasks
from pgqueue.errors import BadInput
from pgqueue.testing import Databases, assert_enqueued, drain

ROOT = Path(__file__).resolve().parents[2]


def no_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any sleep fail the test: drain must never wait for a retry."""

    def refuse(seconds: float) -> None:
        raise AssertionError(f"drain slept {seconds} s")

    monkeypatch.setattr(time, "sleep", refuse)


# -- the fixtures -----------------------------------------------------------------------------
def test_a_test_gets_a_fresh_database_with_the_table(
    pgqueue_queue: Queue, pgqueue_dsn: str
) -> None:
    assert pgqueue_queue.stats(exact=True) == []  # nothing from another test
    job_id = pgqueue_queue.enqueue({"to": "a@example.com"}, queue="emails")
    assert pgqueue_queue.get(job_id) is not None
    with psycopg.connect(pgqueue_dsn) as conn:
        [(name,)] = conn.execute("SELECT current_database()").fetchall()
    assert name.startswith("pgqueue_test_")


def test_each_database_is_its_own_and_goes_away(pgqueue_databases: Databases) -> None:
    first, second = pgqueue_databases.create(), pgqueue_databases.create()
    assert first != second
    with Queue(first) as q:
        q.enqueue({}, queue="only-in-first")
    with Queue(second) as q:
        assert q.stats(exact=True) == []
    pgqueue_databases.drop(first)
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        psycopg.connect(first).close()
    pgqueue_databases.drop(second)


@pytest.mark.slow  # starts an embedded server of its own
def test_a_user_s_pytest_run_gets_the_fixtures_on_a_throwaway_embedded_server(
    tmp_path: Path,
) -> None:
    """As a user runs it: a test file of their own, no conftest, no PGQUEUE_DSN. (``-p``
    loads the plugin where the package was installed before its entry point existed.)"""
    (tmp_path / "test_mine.py").write_text(
        textwrap.dedent(
            """
            from pgqueue.testing import assert_enqueued, drain

            def signup(queue, email):
                queue.enqueue({"to": email, "template": "welcome"}, queue="emails")

            def test_signup_sends_a_welcome(pgqueue_queue):
                signup(pgqueue_queue, "a@example.com")
                assert_enqueued(pgqueue_queue, queue="emails", payload={"to": "a@example.com"})
                sent = []
                done = drain(pgqueue_queue, lambda job: sent.append(job.payload), queues="emails")
                assert done.counts["done"] == 1 and sent[0]["template"] == "welcome"

            def test_the_next_test_starts_empty(pgqueue_queue):
                assert pgqueue_queue.stats(exact=True) == []
            """
        )
    )
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PGQUEUE_") and k != "DATABASE_URL"
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "pgqueue.testing", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout


def test_the_plugin_is_registered_through_the_pytest11_entry_point() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[project\.entry-points\.pytest11\]\n((?:.+\n)+)", text, re.M)
    assert section and '"pgqueue.testing" = "pgqueue.testing"' in section.group(1)


# -- drain --------------------------------------------------------------------------------------
def test_drain_runs_the_jobs_through_the_real_statements(
    pgqueue_queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = pgqueue_queue.enqueue_many([{"n": i} for i in range(3)], queue="sums")
    other = pgqueue_queue.enqueue({"n": 9}, queue="elsewhere")
    no_sleeping(monkeypatch)
    done = drain(pgqueue_queue, lambda job: {"twice": job.payload["n"] * 2}, queues="sums")
    assert done.done == ids and done.failed == [] and done.pending == []
    assert done.results == {ids[i]: {"twice": 2 * i} for i in range(3)}
    for i, job_id in enumerate(ids):
        state = pgqueue_queue.get(job_id)
        assert state is not None
        assert (state.status, state.attempts, state.fence, state.result) == (
            "done",
            1,
            1,
            {"twice": 2 * i},
        )
    assert pgqueue_queue.get(other).status == "ready"  # type: ignore[union-attr]


def test_a_failing_job_retried_later_is_pending_and_not_waited_for(
    pgqueue_queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = pgqueue_queue.enqueue({}, queue="q", max_attempts=3)
    no_sleeping(monkeypatch)

    def flaky(job: Job) -> None:
        raise ConnectionError("smtp down")

    done = drain(pgqueue_queue, flaky, queues="q")  # backoff 1 s * 2^1: later, not now
    assert (done.failed, done.pending, done.dead, done.done) == ([job_id], [job_id], [], [])
    assert done.errors == {job_id: "ConnectionError: smtp down"}
    state = pgqueue_queue.get(job_id)
    assert state is not None and (state.status, state.attempts) == ("ready", 1)
    assert "1 failed" in str(done) and "smtp down" in str(done)


def test_with_no_backoff_a_failing_job_runs_to_dead_and_give_up_and_retry_after_work(
    pgqueue_queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    always = pgqueue_queue.enqueue({"how": "raise"}, queue="q", max_attempts=3)
    gives_up = pgqueue_queue.enqueue({"how": "give up"}, queue="q", max_attempts=3)
    later = pgqueue_queue.enqueue({"how": "retry after"}, queue="q", max_attempts=3)
    no_sleeping(monkeypatch)

    def handler(job: Job) -> None:
        how = job.payload["how"]
        if how == "give up":
            raise GiveUp("no such customer")
        if how == "retry after":
            raise RetryAfter(600)
        raise ValueError(f"bad input, attempt {job.attempts}")

    done = drain(pgqueue_queue, handler, queues="q", backoff=0)
    assert done.failed.count(always) == 3 and sorted(done.dead) == sorted([always, gives_up])
    assert done.errors[always] == "ValueError: bad input, attempt 3"
    assert done.errors[gives_up] == "GiveUp: no such customer"
    assert done.pending == [later]  # asked for 600 s: not waited for
    assert done.counts == {"done": 0, "failed": 5, "dead": 2, "pending": 1, "lost": 0}


def test_drain_runs_a_tasks_registry_with_each_task_s_backoff(
    pgqueue_queue: Queue, pgqueue_dsn: str
) -> None:
    tasks = Tasks(pgqueue_dsn)
    sent: list[str] = []

    @tasks.task(queue="emails")
    def send(job: Job, to: str) -> None:
        sent.append(to)

    @tasks.task(queue="reports", backoff=0, max_attempts=2)
    def report(job: Job) -> None:
        raise RuntimeError("no data")

    first = send.enqueue(to="a@example.com")
    broken = report.enqueue()
    tasks.close()
    unknown = pgqueue_queue.enqueue({"task": "gone", "kwargs": {}}, queue="emails")
    done = drain(pgqueue_queue, tasks)  # the registry's queues: emails, reports
    assert sent == ["a@example.com"] and done.done == [first]
    assert done.dead == [broken]  # backoff 0: retried at once, dead at its 2 attempts
    assert done.pending == [unknown]  # a worker that knows it may run it later
    assert done.errors[unknown].startswith("LookupError: no task named 'gone'")


def test_a_job_taken_away_while_its_handler_runs_is_reported_lost(
    pgqueue_queue: Queue, pgqueue_dsn: str
) -> None:
    job_id = pgqueue_queue.enqueue({}, queue="q")

    def cancelled_meanwhile(job: Job) -> None:
        with Queue(pgqueue_dsn) as other:
            assert other.cancel(job.id)  # its fence rises: this holder's completion is refused

    done = drain(pgqueue_queue, cancelled_meanwhile, queues="q")
    assert (done.lost, done.done) == ([job_id], [])
    assert pgqueue_queue.get(job_id).status == "cancelled"  # type: ignore[union-attr]


def test_a_handler_that_leaves_a_transaction_open_fails_its_job(pgqueue_queue: Queue) -> None:
    job_id = pgqueue_queue.enqueue({}, queue="q", max_attempts=1)

    def leaves_open(job: Job) -> None:
        assert job.conn is not None
        job.conn.execute("BEGIN")

    done = drain(pgqueue_queue, leaves_open, queues="q")
    assert done.dead == [job_id] and "left a transaction open" in done.errors[job_id]


def test_drain_stops_a_handler_that_enqueues_for_ever(pgqueue_queue: Queue) -> None:
    pgqueue_queue.enqueue({}, queue="q")

    def again(job: Job) -> None:
        pgqueue_queue.enqueue({}, queue="q")

    with pytest.raises(RuntimeError, match="drain ran 5 handlers and the queues are not dry"):
        drain(pgqueue_queue, again, queues="q", max_runs=5)


def test_drain_says_how_to_run_an_async_handler(pgqueue_queue: Queue) -> None:
    async def handler(job: object) -> None: ...

    with pytest.raises(BadInput, match="AsyncWorker"):
        drain(pgqueue_queue, handler)  # type: ignore[arg-type]


# -- assert_enqueued ----------------------------------------------------------------------------
def test_assert_enqueued_matches_a_payload_subset_and_returns_the_jobs(
    pgqueue_queue: Queue,
) -> None:
    job_id = pgqueue_queue.enqueue(
        {"task": "send", "kwargs": {"to": "a@example.com", "lang": "fr"}}, queue="emails"
    )
    pgqueue_queue.enqueue({"task": "send", "kwargs": {"to": "b@example.com"}}, queue="emails")
    [job] = assert_enqueued(
        pgqueue_queue, queue="emails", payload={"kwargs": {"to": "a@example.com"}}
    )
    assert job.id == job_id and job.status == "ready"
    assert len(assert_enqueued(pgqueue_queue, queue="emails", count=2)) == 2
    assert assert_enqueued(pgqueue_queue, payload={"task": "send"}, status="ready", count=2)


def test_assert_enqueued_fails_saying_what_it_looked_for_and_what_is_there(
    pgqueue_queue: Queue,
) -> None:
    pgqueue_queue.enqueue({"to": "b@example.com"}, queue="emails")
    with pytest.raises(AssertionError) as failed:
        assert_enqueued(pgqueue_queue, queue="emails", payload={"to": "a@example.com"})
    message = str(failed.value)
    assert message.startswith(
        "expected a job on queue 'emails' with a payload containing "
        '{"to": "a@example.com"}: 0 matches; '
        "the 1 job(s) on 'emails':"
    ), message
    assert 'ready: {"to": "b@example.com"}' in message
    with pytest.raises(AssertionError, match=r"expected 2 job\(s\) on any queue: 1 match;"):
        assert_enqueued(pgqueue_queue, count=2)
    with pytest.raises(AssertionError, match="no job is on 'sms'"):
        assert_enqueued(pgqueue_queue, queue="sms")


def test_importing_the_helpers_imports_no_pytest() -> None:
    code = "import sys, pgqueue.testing; print('pytest' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert loaded.stdout.strip() == "False", loaded.stderr
