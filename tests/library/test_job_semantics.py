"""Job semantics people expect, against a real PostgreSQL: priorities, unique keys (raced
with real threads), cancel by fence, several queues per worker, inspection, and the
schema upgrade of a table made by the first release."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from conftest import rows, wait_for
from pgqueue import BadInput, GiveUp, Job, Queue, RetryAfter, Tasks, Worker


# -- priority -------------------------------------------------------------------------
def test_priority_orders_claims_then_age_then_id(queue: Queue) -> None:
    low = queue.enqueue({}, queue="q", priority=-1)
    plain = queue.enqueue_many([{}, {}], queue="q")
    high = queue.enqueue_many([{}, {}], queue="q", priority=10)
    order = [j.id for j in queue.claim("q", limit=10)]
    assert order == [*high, *plain, low]
    with pytest.raises(BadInput, match="priority"):
        queue.enqueue({}, queue="q", priority=10**7)
    with pytest.raises(BadInput, match="priority"):
        queue.enqueue({}, queue="q", priority=1.5)  # type: ignore[arg-type]


def test_copy_path_keeps_the_priority(queue: Queue, dsn: str) -> None:
    ids = queue.enqueue_many([{}] * 2500, queue="q", priority=7)
    assert rows(dsn, "SELECT DISTINCT priority FROM jobs WHERE id = ANY(%s)", [ids]) == [(7,)]


# -- unique keys ------------------------------------------------------------------------
def test_a_key_is_held_while_ready_or_running_and_freed_after(queue: Queue, dsn: str) -> None:
    first = queue.enqueue({"n": 1}, queue="q", key="order-42")
    assert queue.enqueue({"n": 2}, queue="q", key="order-42") == first
    assert queue.enqueue({"n": 3}, queue="other", key="order-42") != first  # per queue
    [job] = queue.claim("q")
    assert queue.enqueue({"n": 4}, queue="q", key="order-42") == first  # running: still held
    queue.complete(job)
    second = queue.enqueue({"n": 5}, queue="q", key="order-42")  # done: the key is free
    assert second != first
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE queue = 'q'") == [(2,)]


def test_concurrent_enqueues_of_one_key_add_one_job(queue: Queue, dsn: str) -> None:
    results: list[int] = []
    barrier = threading.Barrier(8)
    lock = threading.Lock()

    def producer() -> None:
        with Queue(dsn) as q:
            barrier.wait()
            for _ in range(20):
                job_id = q.enqueue({}, queue="q", key="same")
                with lock:
                    results.append(job_id)

    threads = [threading.Thread(target=producer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 160 and len(set(results)) == 1
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(1,)]


def test_enqueue_many_with_keys_first_one_wins(queue: Queue, dsn: str) -> None:
    held = queue.enqueue({"old": True}, queue="q", key="a")
    ids = queue.enqueue_many(
        [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}, {"n": 5}],
        queue="q",
        keys=["a", "b", None, "b", None],
    )
    assert ids[0] == held and ids[1] == ids[3] and len(set(ids)) == 4
    assert rows(dsn, "SELECT payload->>'n' FROM jobs WHERE id = %s", [ids[1]]) == [("2",)]
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(4,)]
    with pytest.raises(BadInput, match="one key"):
        queue.enqueue_many([{}, {}], queue="q", keys=["x"])
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(4,)]


def test_retrying_a_dead_job_whose_key_is_taken_leaves_it_dead_and_says_so(
    queue: Queue,
) -> None:
    dead = queue.enqueue({}, queue="q", key="k", max_attempts=1)
    [job] = queue.claim("q")
    queue.fail(job, "boom")
    holder = queue.enqueue({}, queue="q", key="k")  # the key is free again: a new job takes it
    retried = queue.retry_dead("q")
    assert retried == [] and [tuple(s) for s in retried.skipped] == [(dead, "k", holder)]
    state = queue.get(dead)
    assert state is not None and state.status == "dead"


# -- cancel -----------------------------------------------------------------------------
def test_a_cancelled_ready_job_never_runs(queue: Queue) -> None:
    job_id = queue.enqueue({}, queue="q", key="k")
    assert queue.cancel(job_id)
    assert queue.claim("q") == []
    state = queue.get(job_id)
    assert state is not None and state.status == "cancelled" and state.finished_at is not None
    assert not queue.cancel(job_id)  # already cancelled
    assert queue.enqueue({}, queue="q", key="k") != job_id  # the key is free


def test_cancelling_a_running_job_is_done_by_its_fence(queue: Queue, dsn: str) -> None:
    queue.conn.execute(
        "CREATE TABLE receipts (id int PRIMARY KEY, body text, fence bigint, job_id bigint)"
    )
    queue.enqueue({}, queue="q")
    started = threading.Event()
    saw: dict[str, Any] = {}

    def handler(job: Job) -> None:
        started.set()
        wait_for(lambda: job.lost, timeout=10, what="the heartbeat to say lost")
        saw["lost"] = job.lost
        saw["write"] = job.fenced_write("receipts", {"id": 1}, {"body": "too late"})

    worker = Worker(handler, queue="q", dsn=dsn, lease=0.6, poll_interval=0.1)
    worker.start()
    try:
        assert started.wait(10)
        [(job_id,)] = rows(dsn, "SELECT id FROM jobs")
        assert queue.cancel(job_id)
        wait_for(lambda: "write" in saw, what="the handler to finish")
        assert saw == {"lost": True, "write": False}
        wait_for(lambda: worker.rejected == 1, what="the late complete to be refused")
    finally:
        worker.stop(grace=2)
    assert rows(dsn, "SELECT status FROM jobs") == [("cancelled",)]
    assert rows(dsn, "SELECT count(*) FROM receipts") == [(0,)]


# -- several queues ---------------------------------------------------------------------
def test_a_worker_on_several_queues_prefers_the_first_and_wakes_for_any(
    queue: Queue, dsn: str
) -> None:
    seen: list[str] = []
    worker = Worker(lambda job: seen.append(job.queue), queue=["a", "b"], dsn=dsn, poll_interval=30)
    worker.start()
    try:
        time.sleep(0.5)  # idle, polling every 30 s: only a notification can wake it
        queue.enqueue({}, queue="b")
        # well within the 30 s poll: only a notification can have woken it so soon
        wait_for(lambda: seen == ["b"], timeout=15, what="LISTEN to wake it for queue b")
    finally:
        worker.stop(grace=2)
    queue.enqueue_many([{}] * 3, queue="b")
    queue.enqueue_many([{}] * 3, queue="a")
    claimed = [j.queue for j in queue.claim(["a", "b"], limit=4)]
    assert claimed == ["a", "a", "a", "b"]
    with pytest.raises(BadInput):
        queue.claim([])
    with pytest.raises(BadInput):
        queue.claim(["a", "a"])


# -- inspection and upgrade ---------------------------------------------------------------
def test_get_shows_started_and_finished_times(queue: Queue) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    running = queue.get(job_id)
    assert running is not None and running.started_at is not None and running.finished_at is None
    queue.complete(job)
    done = queue.get(job_id)
    assert done is not None and done.status == "done" and done.finished_at >= done.started_at  # type: ignore[operator]


FIRST_RELEASE_SCHEMA = """
CREATE TABLE jobs (
  id bigserial PRIMARY KEY, queue text NOT NULL, payload jsonb NOT NULL,
  status text NOT NULL DEFAULT 'ready', run_at timestamptz NOT NULL DEFAULT now(),
  attempts int NOT NULL DEFAULT 0, max_attempts int NOT NULL DEFAULT 5,
  lease_until timestamptz, fence bigint NOT NULL DEFAULT 0, last_error text
);
CREATE INDEX jobs_ready_idx ON jobs (queue, run_at) WHERE status = 'ready';
CREATE INDEX jobs_lease_idx ON jobs (lease_until) WHERE status = 'running';
CREATE TABLE jobs_archive (LIKE jobs);
INSERT INTO jobs (queue, payload, status) VALUES ('q', '{"old": 1}', 'ready'),
                                                 ('q', '{"old": 2}', 'done');
"""


def test_install_upgrades_a_table_of_the_first_release_in_place(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE_SCHEMA)
    with Queue(empty_dsn) as q:
        q.install()
        q.install()  # idempotent
        indexdef = rows(
            empty_dsn, "SELECT indexdef FROM pg_indexes WHERE indexname = 'jobs_ready_idx'"
        )[0][0]
        assert "(queue, priority DESC, run_at, id)" in indexdef
        [job] = q.claim("q")
        assert job.payload == {"old": 1}
        q.complete(job)
        assert q.prune(0, archive=True) == 2  # the archive gained the new columns too
        assert q.enqueue({}, queue="q", key="k", priority=2) > 0
        checks = rows(
            empty_dsn, "SELECT conname FROM pg_constraint WHERE conrelid = 'jobs'::regclass"
        )
        assert ("jobs_status_check",) in checks


# -- the task registry --------------------------------------------------------------------
def test_one_worker_runs_many_tasks_each_with_its_own_rules(queue: Queue, dsn: str) -> None:
    tasks = Tasks(dsn)
    sent: list[str] = []
    calls: dict[str, int] = {}

    @tasks.task(queue="emails", max_attempts=3)
    def send(job: Job, to: str) -> None:
        sent.append(to)

    @tasks.task(queue="reports", max_attempts=5, backoff=0)
    def flaky(job: Job, n: int) -> None:
        calls["flaky"] = calls.get("flaky", 0) + 1
        if job.attempts < 2:
            raise RetryAfter(0.2)

    @tasks.task(queue="reports")
    def hopeless(job: Job) -> None:
        raise GiveUp("the account is closed")

    @tasks.task(queue="reports", timeout=0.3, max_attempts=1)
    def slow(job: Job) -> None:
        time.sleep(3)

    a = send.enqueue(to="a@example.com")
    send.configure(key="welcome-b").enqueue(to="b@example.com")
    assert send.configure(key="welcome-b").enqueue(to="b@example.com") != a
    flaky_id = flaky.enqueue(n=1)
    hopeless_id = hopeless.enqueue()
    slow_id = slow.enqueue()
    unknown = queue.enqueue({"task": "nope", "kwargs": {}}, queue="emails", max_attempts=1)
    assert tasks.queues == ["emails", "reports"]

    worker = Worker(tasks, dsn=dsn, concurrency=2, poll_interval=0.1, backoff=0)
    assert worker.queues == ["emails", "reports"]
    worker.start()
    try:
        wait_for(
            lambda: (
                dict(rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY status"))
                == {"done": 3, "dead": 3}
            ),
            what="every job to end",
        )
    finally:
        worker.stop(grace=1)
        tasks.close()
    assert sorted(sent) == ["a@example.com", "b@example.com"]
    assert rows(dsn, "SELECT max_attempts FROM jobs WHERE id = %s", [a]) == [(3,)]
    assert calls["flaky"] == 2 and queue.get(flaky_id).status == "done"  # type: ignore[union-attr]
    gave_up = queue.get(hopeless_id)
    assert gave_up is not None and gave_up.status == "dead" and gave_up.attempts == 1
    assert gave_up.last_error == "GiveUp: the account is closed"
    assert queue.get(slow_id).last_error.startswith("TimeoutError")  # type: ignore[union-attr]
    lost = queue.get(unknown)
    assert lost is not None and "no task named 'nope'" in (lost.last_error or "")


def test_task_names_are_unique(dsn: str) -> None:
    tasks = Tasks(dsn)

    @tasks.task
    def once(job: Job) -> None: ...

    with pytest.raises(BadInput, match="unique name"):
        tasks.task(name="once")(lambda job: None)


def test_a_task_enqueued_in_your_transaction_opens_no_connection_of_its_own(dsn: str) -> None:
    tasks = Tasks("host=/nonexistent dbname=nowhere")  # never reached: the enqueue uses conn
    send = tasks.task(name="send")(lambda job, to: None)
    with psycopg.connect(dsn) as conn:
        job_id = send.configure(conn=conn, key="k").enqueue(to="a@example.com")
        conn.rollback()
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE id = %s", [job_id]) == [(0,)]
    with psycopg.connect(dsn) as conn:
        send.configure(conn=conn).enqueue(to="b@example.com")
    assert rows(dsn, "SELECT payload->'kwargs'->>'to' FROM jobs") == [("b@example.com",)]


def test_the_database_refuses_a_status_it_does_not_know(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q")
    with pytest.raises(psycopg.errors.CheckViolation), psycopg.connect(dsn) as conn:
        conn.execute("UPDATE jobs SET status = 'paused' WHERE id = %s", [job_id])
    assert queue.get(job_id).status == "ready"  # type: ignore[union-attr]
