"""``Queue`` against a real PostgreSQL: every statement of queries.sql and the invariants
of DESIGN.md (fence = attempts, one holder per job, nothing lost, fenced side writes,
time from the database), plus the one-line errors for bad input that write nothing."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg.types.json import Jsonb

from conftest import rows
from pgqueue import (
    BadInput,
    ConnectError,
    Job,
    LeaseLost,
    NotInstalled,
    Queue,
    Reaped,
    fenced_write,
    statements,
)
from pgqueue.params import COPY_FROM

# Every statement of queries.sql; a new one must get a test here before it is listed.
TESTED_QUERIES = {
    "check",
    "enqueue",
    "enqueue_many",
    "enqueue_reserve",
    "enqueue_copy",
    "claim",
    "heartbeat",
    "heartbeat_many",
    "complete",
    "complete_many",
    "fail",
    "release",
    "reap",
    "holds",
    "hold_for_commit_wait",  # these two: tests/library/test_transaction.py
    "hold_for_commit",
    "retry_dead",
    "retry_dead_ids",
    "get",
    "cancel",
    "cancel_many",
    "enqueue_keyed",
    "key_holders",
    "stats",
    "stats_exact",
    "stats_rows",
    "id_span",
    "prune",
    "prune_archive",
    "notify_off",
    # periodic jobs, in tests/library/test_periodic.py
    "schedule_clock",
    "schedule_add",
    "schedule_tick",
    "schedules",
    # tests/library/test_limits.py
    "claim_limited",
    "set_limit",
    "remove_limit",
    "limits",
    # pausing a queue, in tests/library/test_pause.py
    "check_claim",
    "pause",
    "resume",
    "paused",
    # durable steps, in tests/library/test_steps.py
    "step_get",
    "step_put",
    "step_put_held",
    "steps",
    # results, in tests/library/test_results.py
    "complete_result",
    "complete_many_results",
    "result",
    "listen_done",
    "unlisten_done",
    "wait_for",
    "wait_done",
}
FENCED = {
    "heartbeat",
    "heartbeat_many",
    "complete",
    "complete_many",
    "complete_result",
    "complete_many_results",
    "fail",
    "release",
}


def job_row(dsn: str, job_id: int) -> dict:
    """The whole row of one job, as a dict, read on a fresh connection."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute("SELECT * FROM jobs WHERE id = %s", [job_id])
        names = [c.name for c in cur.description or []]
        row = cur.fetchone()
    assert row is not None, f"job {job_id} is gone"
    return dict(zip(names, row, strict=True))


def execute(dsn: str, query: str, params: object = None) -> int:
    """Run one statement on its own connection; return its row count."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).rowcount  # type: ignore[arg-type]


def count_jobs(dsn: str) -> int:
    """How many jobs the table holds, seen from a fresh connection."""
    return rows(dsn, "SELECT count(*) FROM jobs")[0][0]


def expire(dsn: str, *ids: int) -> None:
    """Make leases run out now, without waiting (the reaper compares with DB now())."""
    execute(
        dsn,
        "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = ANY(%s)",
        [list(ids)],
    )


def make_runnable(dsn: str, *ids: int) -> None:
    """Skip a job's backoff so it can be claimed again at once."""
    execute(dsn, "UPDATE jobs SET run_at = now() WHERE id = ANY(%s)", [list(ids)])


def assert_fence_covers_attempts(dsn: str) -> None:
    """Invariant 1: every claim raised fence and attempts together, and nothing lowered
    the fence (a release gives the attempt back, not the fence): fence >= attempts."""
    bad = rows(dsn, "SELECT id, fence, attempts FROM jobs WHERE fence < attempts")
    assert bad == [], f"fence must never be below attempts: {bad}"


# -- the SQL file ---------------------------------------------------------------------
def test_every_statement_of_queries_sql_is_tested() -> None:
    assert set(statements.queries()) == TESTED_QUERIES


@pytest.mark.parametrize("name", sorted(FENCED))
def test_every_write_after_a_claim_checks_fence_and_status(name: str) -> None:
    text = statements.query(name)
    assert "fence" in text.split("WHERE", 1)[1]
    assert "status = 'running'" in text.split("WHERE", 1)[1]


# -- enqueue --------------------------------------------------------------------------
def test_enqueue_stores_a_ready_job(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({"to": "a@example.com", "n": [1, 2]}, queue="emails", max_attempts=3)
    row = job_row(dsn, job_id)
    assert row["queue"] == "emails"
    assert row["payload"] == {"to": "a@example.com", "n": [1, 2]}
    assert (row["status"], row["attempts"], row["fence"], row["max_attempts"]) == (
        "ready",
        0,
        0,
        3,
    )
    assert row["lease_until"] is None and row["last_error"] is None


def test_enqueue_with_delay_is_not_claimable_until_db_time_passes(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q", delay=60)
    [(wait,)] = rows(dsn, "SELECT extract(epoch FROM run_at - now()) FROM jobs")
    assert 55 < float(wait) <= 60
    assert queue.claim("q") == []
    make_runnable(dsn, job_id)
    assert [j.id for j in queue.claim("q")] == [job_id]


def test_enqueue_at_run_at(queue: Queue, dsn: str) -> None:
    when = datetime(2001, 2, 3, 4, 5, 6, tzinfo=timezone.utc)
    job_id = queue.enqueue({}, queue="q", run_at=when)
    assert job_row(dsn, job_id)["run_at"] == when
    assert [j.id for j in queue.claim("q")] == [job_id]


def test_enqueue_rolls_back_with_the_callers_transaction(queue: Queue, dsn: str) -> None:
    with psycopg.connect(dsn) as app:
        app.execute("CREATE TABLE orders (id int)")
        app.execute("INSERT INTO orders VALUES (1)")
        queue.enqueue({"order": 1}, queue="q", conn=app)
        assert count_jobs(dsn) == 0  # not visible before commit
        app.rollback()
    assert count_jobs(dsn) == 0
    assert queue.claim("q") == []


def test_enqueue_commits_with_the_callers_transaction(queue: Queue, dsn: str) -> None:
    with psycopg.connect(dsn) as app:
        with app.transaction():
            app.execute("CREATE TABLE orders (id int)")
            app.execute("INSERT INTO orders VALUES (1)")
            job_id = queue.enqueue({"order": 1}, queue="q", conn=app)
            ids = queue.enqueue_many([{"order": 2}, {"order": 3}], queue="q", conn=app)
        assert rows(dsn, "SELECT count(*) FROM orders") == [(1,)]
    assert sorted(r[0] for r in rows(dsn, "SELECT id FROM jobs")) == sorted([job_id, *ids])


def test_enqueue_many_is_one_statement_in_order(queue: Queue, dsn: str) -> None:
    payloads = [{"n": i} for i in range(50)]
    ids = queue.enqueue_many(payloads, queue="bulk")
    assert len(ids) == 50 and ids == sorted(ids)
    stored = rows(dsn, "SELECT id, payload FROM jobs ORDER BY id")
    assert [(i, p) for i, p in stored] == list(zip(ids, payloads, strict=True))
    # One statement in autocommit is one transaction: every row has the same xmin.
    assert rows(dsn, "SELECT count(DISTINCT xmin::text) FROM jobs") == [(1,)]
    assert queue.enqueue_many([], queue="bulk") == []


def test_enqueue_many_with_one_bad_payload_writes_none(queue: Queue, dsn: str) -> None:
    with pytest.raises(BadInput, match="#2"):
        queue.enqueue_many([{"n": 0}, {"n": 1}, {"n": float("nan")}, {"n": 3}], queue="q")
    assert count_jobs(dsn) == 0


def test_enqueue_many_is_all_or_none_in_the_database(queue: Queue, dsn: str) -> None:
    # A payload Python accepts but the database refuses, in the middle of the batch.
    execute(dsn, "ALTER TABLE jobs ADD CONSTRAINT must_be_ok CHECK (payload ? 'ok')")
    with pytest.raises(psycopg.errors.CheckViolation):
        queue.enqueue_many([{"ok": 1}, {"ok": 2}, {"bad": 3}, {"ok": 4}], queue="q")
    assert count_jobs(dsn) == 0


def test_large_enqueue_many_copies_the_jobs_in_with_ids_in_order(queue: Queue, dsn: str) -> None:
    # enqueue_reserve then enqueue_copy: one COPY statement, so one transaction (one xmin).
    payloads = [{"n": i} for i in range(COPY_FROM)]
    ids = queue.enqueue_many(payloads, queue="bulk", max_attempts=3)
    assert len(ids) == COPY_FROM and ids == sorted(ids)
    stored = rows(dsn, "SELECT id, payload FROM jobs ORDER BY id")
    assert [(i, p) for i, p in stored] == list(zip(ids, payloads, strict=True))
    columns = "SELECT DISTINCT queue, status, attempts, fence, max_attempts FROM jobs"
    assert rows(dsn, columns) == [("bulk", "ready", 0, 0, 3)]
    assert rows(dsn, "SELECT count(DISTINCT xmin::text) FROM jobs") == [(1,)]
    # The sequence moved past the reserved ids: the next job gets a new one.
    assert queue.enqueue({}, queue="bulk") > ids[-1]


def test_large_enqueue_many_honours_delay_and_run_at(queue: Queue, dsn: str) -> None:
    later = queue.enqueue_many([{}] * COPY_FROM, queue="q", delay=60)
    [(wait,)] = rows(dsn, "SELECT DISTINCT extract(epoch FROM run_at - now()) FROM jobs")
    assert 55 < float(wait) <= 60
    assert queue.claim("q") == []
    when = datetime(2001, 2, 3, 4, 5, 6, tzinfo=timezone.utc)
    ids = queue.enqueue_many([{}] * COPY_FROM, queue="q", run_at=when)
    assert rows(dsn, "SELECT DISTINCT run_at FROM jobs WHERE id = ANY(%s)", [ids]) == [(when,)]
    assert len(queue.claim("q", limit=10_000)) == COPY_FROM
    assert set(later).isdisjoint(ids)


def test_large_enqueue_many_is_all_or_none(queue: Queue, dsn: str) -> None:
    payloads = [{"ok": i} for i in range(COPY_FROM)]
    with pytest.raises(BadInput, match=f"#{COPY_FROM}"):
        queue.enqueue_many([*payloads, {"n": float("nan")}], queue="q")
    execute(dsn, "ALTER TABLE jobs ADD CONSTRAINT must_be_ok CHECK (payload ? 'ok')")
    with pytest.raises(psycopg.errors.CheckViolation):
        queue.enqueue_many([*payloads, {"bad": 1}, *payloads], queue="q")
    assert count_jobs(dsn) == 0
    # In the caller's transaction it commits or rolls back with the caller's data.
    with psycopg.connect(dsn) as app:
        queue.enqueue_many(payloads, queue="q", conn=app)
        app.rollback()
        with app.transaction():
            ids = queue.enqueue_many(payloads, queue="q", conn=app)
    assert sorted(r[0] for r in rows(dsn, "SELECT id FROM jobs")) == ids


def _notifications(listener: psycopg.Connection) -> list[str]:
    """The payloads of the notifications that arrive within half a second."""
    return [n.payload for n in listener.notifies(timeout=0.5)]


def test_enqueue_notifies_once_per_queue_per_transaction(queue: Queue, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN pgqueue")
        queue.enqueue_many([{"n": i} for i in range(40)], queue="a")
        assert _notifications(listener) == ["a"]
        queue.enqueue_many([{"n": i} for i in range(COPY_FROM)], queue="a")  # by COPY
        assert _notifications(listener) == ["a"]

        queue.enqueue({}, queue="b")
        assert _notifications(listener) == ["b"]

        with psycopg.connect(dsn) as app, app.transaction():
            for i in range(5):
                queue.enqueue({"n": i}, queue="a", conn=app)
            queue.enqueue_many([{}, {}], queue="b", conn=app)
            queue.enqueue_many([{}, {}], queue="a", conn=app)
        assert sorted(_notifications(listener)) == ["a", "b"]

        with psycopg.connect(dsn) as app:
            queue.enqueue({}, queue="a", conn=app)
            app.rollback()
        assert _notifications(listener) == []


# -- claim ----------------------------------------------------------------------------
def test_claim_takes_ready_jobs_of_its_queue_in_run_at_order(queue: Queue, dsn: str) -> None:
    first = queue.enqueue({"n": 1}, queue="q", run_at=datetime(2000, 1, 1, tzinfo=timezone.utc))
    later = queue.enqueue_many([{"n": 2}, {"n": 3}], queue="q")
    queue.enqueue({"other": True}, queue="other")
    queue.enqueue({"future": True}, queue="q", delay=3600)
    jobs = queue.claim("q", limit=2, lease=10)
    assert len(jobs) == 2
    assert jobs[0].id == first and jobs[1].id in later  # oldest run_at first
    for job in jobs:
        assert isinstance(job, Job)
        assert (job.queue, job.fence, job.attempts, job.max_attempts) == ("q", 1, 1, 5)
        assert job.payload == job_row(dsn, job.id)["payload"]
        assert job_row(dsn, job.id)["status"] == "running"
    assert len(queue.claim("q", limit=10)) == 1  # the future one and the other queue stay
    assert queue.claim("q", limit=10) == []


def test_lease_until_is_database_now_plus_lease(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q", lease=120)
    [(left,)] = rows(dsn, "SELECT extract(epoch FROM lease_until - now()) FROM jobs")
    assert 115 < float(left) <= 120
    assert job.lease_until == job_row(dsn, job.id)["lease_until"]


def test_ten_threads_never_claim_the_same_job(dsn: str) -> None:
    total = 300
    with Queue(dsn) as q:
        q.enqueue_many([{"n": i} for i in range(total)], queue="race")
    claimed: list[list[int]] = [[] for _ in range(10)]
    start = threading.Barrier(10)
    errors: list[BaseException] = []

    def claimer(slot: int) -> None:
        try:
            with Queue(dsn) as mine:
                start.wait()
                while jobs := mine.claim("race", limit=3, lease=60):
                    claimed[slot].extend(j.id for j in jobs)
        except BaseException as exc:  # surfaced below: a thread's assert is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    every = [i for ids in claimed for i in ids]
    assert len(every) == len(set(every)) == total
    assert sum(1 for ids in claimed if ids) >= 2  # they really competed
    assert rows(dsn, "SELECT DISTINCT status, fence FROM jobs") == [("running", 1)]


def test_claim_uses_the_partial_ready_index(queue: Queue, dsn: str) -> None:
    execute(
        dsn,
        "INSERT INTO jobs (queue, payload, status, attempts, fence) "
        "SELECT 'q', '{}', 'done', 1, 1 FROM generate_series(1, 20000)",
    )
    queue.enqueue_many([{}] * 5, queue="q")
    execute(dsn, "ANALYZE jobs")
    with psycopg.connect(dsn) as conn:
        plan = conn.execute(
            "EXPLAIN " + statements.query("claim"), {"queue": "q", "limit": 10, "lease": 30.0}
        ).fetchall()
        conn.rollback()
    text = "\n".join(r[0] for r in plan)
    assert "jobs_ready_idx" in text, text


# -- heartbeat, complete, fail, release ------------------------------------------------
def test_heartbeat_extends_the_lease_from_database_now(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q", lease=5)
    assert queue.heartbeat(job, lease=300)
    [(left,)] = rows(dsn, "SELECT extract(epoch FROM lease_until - now()) FROM jobs")
    assert 295 < float(left) <= 300
    assert not job.lost


def test_complete_marks_done(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert queue.complete(job)
    row = job_row(dsn, job.id)
    assert (row["status"], row["lease_until"], row["fence"]) == ("done", None, 1)
    assert not queue.complete(job)  # a second completion changes nothing
    assert job.lost


def test_stale_fence_changes_nothing_and_the_caller_is_told(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({"report": 7}, queue="q")
    [old] = queue.claim("q", lease=30)
    expire(dsn, job_id)
    assert queue.reap() == [Reaped(job_id, "q", "ready", 1)]
    [new] = queue.claim("q", lease=30)
    assert (old.fence, new.fence) == (1, 2)
    before = job_row(dsn, job_id)

    assert queue.heartbeat(old, lease=999) is False
    assert queue.complete(old) is False
    assert queue.fail(old, "late failure") is False
    assert queue.release(old) is False
    assert queue.heartbeat_many([old], lease=999) == [old]
    assert queue.complete_many([old]) == [old]
    assert job_row(dsn, job_id) == before
    assert old.lost
    with pytest.raises(LeaseLost, match="stale"):
        old.raise_if_lost()

    assert not new.lost
    assert queue.heartbeat(new) and queue.complete(new)
    assert job_row(dsn, job_id)["status"] == "done"
    assert_fence_covers_attempts(dsn)


def test_heartbeat_many_returns_only_the_lost(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{}, {}, {}], queue="q")
    jobs = queue.claim("q", limit=3, lease=5)
    expire(dsn, jobs[1].id)
    queue.reap()
    lost = queue.heartbeat_many(jobs, lease=200)
    assert [j.id for j in lost] == [jobs[1].id]
    assert [j.lost for j in jobs] == [False, True, False]
    kept = rows(dsn, "SELECT count(*) FROM jobs WHERE lease_until > now() + interval '150 s'")
    assert kept == [(2,)]


def test_many_statements_tell_two_claims_of_one_job_apart(queue: Queue) -> None:
    """A worker may hold a stale claim (filing its fail) and a new claim of the same job at
    once: the replies of heartbeat_many and complete_many are matched by (id, fence)."""
    job_id = queue.enqueue({}, queue="q")
    [old] = queue.claim("q", lease=30)
    assert queue.fail(old, "ValueError: first attempt", backoff=0)
    [new] = queue.claim("q", lease=30)
    assert (old.id, new.id, old.fence, new.fence) == (job_id, job_id, 1, 3)
    assert queue.heartbeat_many([old, new], lease=60) == [old]
    assert not new.lost
    assert queue.complete_many([old, new]) == [old]
    assert new.status == "done"


def test_complete_many_is_fenced_per_job(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{"n": i} for i in range(4)], queue="q")
    jobs = queue.claim("q", limit=4)
    expire(dsn, jobs[0].id)
    queue.reap()
    [retaken] = queue.claim("q")
    rejected = queue.complete_many(jobs)
    assert [j.id for j in rejected] == [jobs[0].id]
    assert rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY 1 ORDER BY 1") == [
        ("done", 3),
        ("running", 1),
    ]
    assert queue.complete_many([retaken]) == []
    assert queue.complete_many([]) == []


def test_fail_backs_off_exponentially_then_goes_dead(queue: Queue, dsn: str) -> None:
    backoff = 0.5
    job_id = queue.enqueue({}, queue="q", max_attempts=5)
    for attempt in range(1, 5):
        [job] = queue.claim("q")
        assert job.attempts == attempt
        assert queue.fail(job, f"error {attempt}", backoff=backoff)
        row = job_row(dsn, job_id)
        [(wait,)] = rows(dsn, "SELECT extract(epoch FROM run_at - now()) FROM jobs")
        assert row["status"] == "ready" and row["last_error"] == f"error {attempt}"
        assert math.isclose(float(wait), backoff * 2**attempt, abs_tol=0.5), (attempt, wait)
        assert queue.claim("q") == []  # not before its backoff
        make_runnable(dsn, job_id)
    [job] = queue.claim("q")
    assert job.attempts == 5
    assert queue.fail(job, "last straw")
    assert (job.status, job.retry_in, job.lost) == ("dead", None, True)
    row = job_row(dsn, job_id)
    # five claims and five fails each raised the fence: no late write of any attempt counts
    assert (row["status"], row["last_error"], row["fence"]) == ("dead", "last straw", 10)
    make_runnable(dsn, job_id)
    assert queue.claim("q") == []


def test_release_hands_the_job_back_without_using_an_attempt(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q", max_attempts=2)
    [job] = queue.claim("q")
    assert queue.release(job)
    row = job_row(dsn, job_id)
    assert (row["status"], row["lease_until"]) == ("ready", None)
    # the attempt is given back (max_attempts untouched, so backoff does not grow with
    # every deploy); the fence is not
    assert (row["attempts"], row["max_attempts"], row["fence"]) == (0, 2, 1)
    [again] = queue.claim("q")
    assert (again.fence, again.attempts) == (2, 1)
    assert not queue.release(job)  # the old claim cannot release the new one
    assert_fence_covers_attempts(dsn)


# -- reaper ---------------------------------------------------------------------------
def test_reaper_returns_expired_jobs_and_leaves_live_ones(queue: Queue, dsn: str) -> None:
    import time

    short, long = queue.enqueue({}, queue="q"), queue.enqueue({}, queue="q")
    # A second of lease: the first reap below must come before it runs out (0.2 s could
    # pass in the three round trips before it on a loaded machine).
    [a] = queue.claim("q", lease=1.0)
    [b] = queue.claim("q", lease=60)
    assert {a.id, b.id} == {short, long}
    assert queue.reap() == []  # nothing has expired yet
    deadline = time.monotonic() + 30
    while not (reaped := queue.reap()) and time.monotonic() < deadline:
        time.sleep(0.05)  # until a's lease runs out; the first reap to find one returns it
    assert reaped == [Reaped(a.id, "q", "ready", 1)]
    row = job_row(dsn, a.id)
    assert (row["status"], row["lease_until"]) == ("ready", None)
    assert job_row(dsn, b.id)["status"] == "running"
    assert queue.reap() == []
    [again] = queue.claim("q")
    assert (again.id, again.fence, again.attempts) == (a.id, 2, 2)


def test_reaper_makes_jobs_dead_at_max_attempts(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q", max_attempts=2)
    for expected in ("ready", "dead"):
        [job] = queue.claim("q")
        expire(dsn, job_id)
        assert queue.reap() == [Reaped(job_id, "q", expected, job.fence)]
        # The reaper says why, so a job that went dead this way is not a mystery.
        assert job_row(dsn, job_id)["last_error"] == (
            f"lease ran out on attempt {job.attempts} of 2: its worker stopped heartbeating "
            "(crashed, hung or cut off)"
        )
    assert job_row(dsn, job_id)["attempts"] == 2
    assert (state := queue.get(job_id)) is not None and "attempt 2 of 2" in (state.last_error or "")
    assert queue.claim("q") == []
    assert_fence_covers_attempts(dsn)


def test_concurrent_reapers_move_each_job_once(dsn: str) -> None:
    with Queue(dsn) as q:
        q.enqueue_many([{}] * 100, queue="q")
        q.claim("q", limit=100)
    execute(dsn, "UPDATE jobs SET lease_until = now() - interval '1 s'")
    results: list[list[Reaped]] = []
    start = threading.Barrier(4)

    def reaper() -> None:
        with Queue(dsn) as mine:
            start.wait()
            results.append(mine.reap())

    threads = [threading.Thread(target=reaper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    moved = [r.id for rs in results for r in rs]
    assert len(moved) == len(set(moved)) == 100


def test_fence_only_rises_through_a_whole_life(queue: Queue, dsn: str) -> None:
    """A model of each row beside the real one: claim raises fence and attempts, fail
    raises the fence, release gives the attempt back; the fence never falls."""
    ids = queue.enqueue_many([{"n": i} for i in range(6)], queue="q", max_attempts=3)
    model = {i: [0, 0] for i in ids}  # id -> [fence, attempts]
    for _ in range(4):
        jobs = queue.claim("q", limit=6)
        for n, job in enumerate(jobs):
            model[job.id][0] += 1
            model[job.id][1] += 1
            if n % 3 == 0:
                queue.fail(job, "x", backoff=0)
                model[job.id][0] += 1
            elif n % 3 == 1:
                expire(dsn, job.id)
            else:
                queue.release(job)
                model[job.id][1] -= 1
        queue.reap()
        assert_fence_covers_attempts(dsn)
        assert {i: [f, a] for i, f, a in rows(dsn, "SELECT id, fence, attempts FROM jobs")} == model
    execute(dsn, "UPDATE jobs SET status = 'dead' WHERE status = 'ready'")
    assert len(queue.retry_dead("q", extra=2)) == len(ids)
    for job in queue.claim("q", limit=6):
        assert job.fence == model[job.id][0] + 1 and job.attempts == model[job.id][1] + 1
        queue.complete(job)
    assert_fence_covers_attempts(dsn)


# -- retry_dead, stats, prune ----------------------------------------------------------
def test_retry_dead_gives_more_attempts_and_keeps_counting(queue: Queue, dsn: str) -> None:
    a, b = queue.enqueue_many([{"n": 1}, {"n": 2}], queue="q", max_attempts=1)
    for job in queue.claim("q", limit=2):
        queue.fail(job, "boom", backoff=0)
    assert rows(dsn, "SELECT DISTINCT status FROM jobs") == [("dead",)]
    assert queue.retry_dead("q", ids=[b]) == [b]
    assert queue.retry_dead("other") == []
    row = job_row(dsn, b)
    assert (row["status"], row["max_attempts"], row["last_error"]) == ("ready", 2, None)
    assert job_row(dsn, a)["status"] == "dead"
    [job] = queue.claim("q")
    assert (job.id, job.fence, job.attempts) == (b, 3, 2)  # claim, fail, claim
    assert queue.retry_dead("q", extra=3) == [a]
    assert job_row(dsn, a)["max_attempts"] == 4
    assert_fence_covers_attempts(dsn)
    with pytest.raises(BadInput):
        queue.retry_dead("q", extra=0)


def test_retry_dead_by_ids_looks_jobs_up_by_id_and_an_empty_list_retries_none(
    queue: Queue, dsn: str
) -> None:
    a, b = queue.enqueue_many([{"n": 1}, {"n": 2}], queue="q", max_attempts=1)
    c = queue.enqueue({}, queue="other", max_attempts=1)
    for name in ("q", "other"):
        for job in queue.claim(name, limit=2):
            queue.fail(job, "boom", backoff=0)
    assert queue.retry_dead("q", ids=[]) == []  # once: every dead job of the queue
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'dead'") == [(3,)]
    assert queue.retry_dead("q", ids=[c]) == []  # c is of another queue: left alone
    assert queue.retry_dead(ids=[c, a]) == [a, c]  # by id alone: any queue
    assert queue.retry_dead(ids=[a, 10**9]) == []  # not dead / no such job: nothing
    assert job_row(dsn, b)["status"] == "dead"


def test_get_reads_one_job_as_it_is_now(queue: Queue) -> None:
    job_id = queue.enqueue({"x": 1}, queue="q", priority=3)
    state = queue.get(job_id)
    assert state is not None
    assert (state.id, state.queue, state.status, state.payload, state.priority) == (
        job_id,
        "q",
        "ready",
        {"x": 1},
        3,
    )
    [job] = queue.claim("q")
    queue.fail(job, "boom", backoff=0)
    state = queue.get(job_id)
    assert state is not None
    assert (state.status, state.attempts, state.fence, state.last_error) == ("ready", 1, 2, "boom")
    assert queue.get(10**9) is None
    with pytest.raises(BadInput):
        queue.get(0)


def test_stats_counts_by_queue_and_status_with_oldest_ready(queue: Queue, dsn: str) -> None:
    assert [r for r in queue.stats() if not r["estimated"]] == []
    ids = queue.enqueue_many([{}] * 3, queue="a")
    queue.enqueue({}, queue="b", delay=3600)
    execute(dsn, "UPDATE jobs SET run_at = now() - interval '100 s' WHERE id = %s", [ids[0]])
    [job] = queue.claim("a")
    assert job.id == ids[0]
    execute(dsn, "UPDATE jobs SET run_at = now() - interval '40 s' WHERE id = %s", [ids[1]])
    poison = queue.enqueue({}, queue="b", max_attempts=1)
    done = queue.enqueue({}, queue="c")
    for claimed in queue.claim("b") + queue.claim("c"):
        if claimed.id == poison:
            queue.fail(claimed, 'UndefinedTable: relation "sent" does not exist')
        else:
            queue.complete(claimed)
    assert done
    rows_ = queue.stats()
    stats = {(r["queue"], r["status"]): r for r in rows_ if not r["estimated"]}
    assert {k: r["jobs"] for k, r in stats.items()} == {
        ("a", "ready"): 2,
        ("a", "running"): 1,
        ("b", "dead"): 1,
        ("b", "ready"): 1,
    }
    assert math.isclose(stats["a", "ready"]["oldest_ready_seconds"], 40, abs_tol=2)
    assert stats["b", "ready"]["oldest_ready_seconds"] is None  # not runnable yet
    assert stats["a", "running"]["oldest_ready_seconds"] is None
    assert stats["b", "dead"]["latest_error"].startswith("UndefinedTable")
    [estimate] = [r for r in rows_ if r["estimated"]]
    assert estimate["status"] == "finished"  # done jobs are estimated, not counted
    execute(dsn, "VACUUM ANALYZE jobs")
    [estimate] = [r for r in queue.stats() if r["estimated"]]
    assert estimate["jobs"] == 1  # the one done job of queue c, from pg_class.reltuples
    exact = {(r["queue"], r["status"]): r["jobs"] for r in queue.stats(exact=True)}
    assert exact[("c", "done")] == 1 and exact[("b", "dead")] == 1


def test_stats_reads_only_the_partial_indexes(queue: Queue) -> None:
    from pgqueue import statements

    queue.conn.execute("SET enable_seqscan = off")  # a tiny table: ask what it can use
    plan = "\n".join(r[0] for r in queue.conn.execute("EXPLAIN " + statements.query("stats")))
    assert "Seq Scan" not in plan, plan
    for index in ("jobs_ready_idx", "jobs_lease_idx", "jobs_dead_idx"):
        assert index in plan, plan


def test_prune_ages_jobs_by_when_they_finished_in_short_batches(queue: Queue, dsn: str) -> None:
    ids = queue.enqueue_many([{"n": i} for i in range(10)], queue="q")
    jobs = queue.claim("q", limit=8)
    for job in jobs[:6]:
        queue.complete(job)
    queue.cancel(ids[6])  # running, cancelled: finished too
    queue.fail(jobs[7], "boom", give_up=True)  # dead: kept for a person
    # queued two days ago, finished a moment ago: not old
    execute(dsn, "UPDATE jobs SET run_at = now() - interval '2 days' WHERE id = %s", [ids[0]])
    # finished an hour ago
    execute(
        dsn,
        "UPDATE jobs SET finished_at = now() - interval '1 hour' WHERE id = ANY(%s)",
        [ids[1:3]],
    )
    assert queue.prune(timedelta(minutes=30)) == 2
    seen: list[tuple[int, int]] = []
    assert queue.prune(0, batch=3, progress=lambda done, total: seen.append((done, total))) == 5
    assert seen[-1] == (10, 10) and len(seen) == 3  # the 8 jobs left, 3 a batch
    assert rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY 1 ORDER BY 1") == [
        ("dead", 1),
        ("ready", 2),
    ]
    assert rows(dsn, "SELECT count(*) FROM jobs_archive") == [(0,)]
    assert queue.prune(0) == 0


def test_prune_archive_moves_done_jobs_intact(queue: Queue, dsn: str) -> None:
    ids = queue.enqueue_many([{"n": 1}, {"n": 2}], queue="q")
    done = queue.claim("q")[0]
    queue.complete(done)
    before = job_row(dsn, done.id)
    assert queue.prune(0, archive=True) == 1
    assert rows(dsn, "SELECT id FROM jobs") == [(ids[1],)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute("SELECT * FROM jobs_archive")
        names = [c.name for c in cur.description or []]
        archived = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    assert archived == [before]


# -- install --------------------------------------------------------------------------
def test_install_is_idempotent(empty_dsn: str) -> None:
    with Queue(empty_dsn) as q:
        q.install()
        job_id = q.enqueue({"kept": True}, queue="q")
        q.install()
        assert [j.id for j in q.claim("q")] == [job_id]
    indexes = {
        r[0] for r in rows(empty_dsn, "SELECT indexname FROM pg_indexes WHERE tablename = 'jobs'")
    }
    assert {"jobs_ready_idx", "jobs_lease_idx"} <= indexes
    triggers = rows(
        empty_dsn, "SELECT count(*) FROM pg_trigger WHERE tgname = 'jobs_notify_insert'"
    )
    assert triggers == [(1,)]


def test_concurrent_installs_are_safe(empty_dsn: str) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def install() -> None:
        try:
            with Queue(empty_dsn) as q:
                start.wait()
                q.install()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    with Queue(empty_dsn) as q:
        q.enqueue({}, queue="q")
        assert len(q.claim("q")) == 1


# -- fenced writes to other tables ------------------------------------------------------
@pytest.fixture
def reports(dsn: str) -> Iterator[psycopg.Connection]:
    """A side table with fence and job columns, and a connection to write to it."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(
        "CREATE TABLE reports (id int PRIMARY KEY, body text, job_id bigint, fence bigint NOT NULL)"
    )
    yield conn
    conn.close()


def report(conn: psycopg.Connection, report_id: int = 1) -> tuple | None:
    """The (body, fence) stored for one report, or None."""
    return conn.execute("SELECT body, fence FROM reports WHERE id = %s", [report_id]).fetchone()


def test_fenced_upsert_accepts_only_a_newer_fence(reports: psycopg.Connection) -> None:
    assert fenced_write(reports, "reports", {"id": 1}, {"body": "one"}, 1)
    assert fenced_write(reports, "reports", {"id": 1}, {"body": "three"}, 3)
    assert not fenced_write(reports, "reports", {"id": 1}, {"body": "two"}, 2)
    assert not fenced_write(reports, "reports", {"id": 1}, {"body": "three again"}, 3)
    assert report(reports) == ("three", 3)


def test_fenced_update_accepts_only_a_newer_fence(reports: psycopg.Connection) -> None:
    assert not fenced_write(reports, "reports", {"id": 1}, {"body": "x"}, 5, upsert=False)
    assert report(reports) is None  # update mode never inserts
    reports.execute("INSERT INTO reports (id, body, fence) VALUES (1, 'seed', 1)")
    assert fenced_write(reports, "reports", {"id": 1}, {"body": "two"}, 2, upsert=False)
    assert not fenced_write(reports, "reports", {"id": 1}, {"body": "one"}, 1, upsert=False)
    assert not fenced_write(reports, "reports", {"id": 1}, {"body": "two b"}, 2, upsert=False)
    assert report(reports) == ("two", 2)


def test_job_fenced_write_after_takeover(
    queue: Queue, dsn: str, reports: psycopg.Connection
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [a] = queue.claim("q")
    expire(dsn, job_id)
    queue.reap()
    [b] = queue.claim("q")
    assert b.fenced_write("reports", {"id": 1}, {"body": "by B"})
    assert not a.fenced_write("reports", {"id": 1}, {"body": "by A, late"})
    assert a.lost and not b.lost
    assert report(reports) == ("by B", 2)
    for upsert in (True, False):
        assert not a.fenced_write("reports", {"id": 1}, {"body": "late"}, upsert=upsert)
    assert report(reports) == ("by B", 2)
    orphan = Job(1, "q", {}, 1, 1, 5, None)
    with pytest.raises(LeaseLost):
        orphan.fenced_write("reports", {"id": 1}, {"body": "no connection"})


def test_fenced_write_quotes_identifiers(reports: psycopg.Connection) -> None:
    reports.execute(
        'CREATE SCHEMA side; CREATE TABLE side."odd ""name""" (k text PRIMARY KEY, '
        '"my col" text, fence bigint)'
    )
    table = 'side.odd "name"'
    assert fenced_write(reports, table, {"k": "a'; DROP TABLE reports; --"}, {"my col": "v"}, 1)
    assert reports.execute('SELECT k, "my col", fence FROM side."odd ""name"""').fetchall() == [
        ("a'; DROP TABLE reports; --", "v", 1)
    ]
    assert report(reports) is None  # reports still exists (and is empty)


@pytest.mark.parametrize(
    ("key", "values"), [({}, {"body": "x"}), ({"id": 1}, {}), ({"id": 1}, {"fence": 9})]
)
def test_fenced_write_bad_input(reports: psycopg.Connection, key: dict, values: dict) -> None:
    with pytest.raises(BadInput):
        fenced_write(reports, "reports", key, values, 1)
    assert report(reports) is None


# -- bad input: a one-line message, nothing written --------------------------------------
class Unserialisable:
    """An object json.dumps cannot encode."""


def one_line(exc: pytest.ExceptionInfo) -> str:
    """The exception's message, asserted to be a single non-empty line."""
    text = str(exc.value)
    assert text and "\n" not in text, repr(text)
    return text


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], "JSON object"),
        ("text", "JSON object"),
        (None, "JSON object"),
        (Jsonb({"a": 1}), "JSON object"),
        ({"x": Unserialisable()}, "not JSON-serialisable"),
        ({"x": {1, 2}}, "not JSON-serialisable"),
        ({"x": float("nan")}, "not JSON-serialisable"),
        ({"x": float("inf")}, "not JSON-serialisable"),
        ({"x": "a\u0000b"}, "NUL"),
        ({"a\u0000": 1}, "NUL"),
        ({"x": "\ud800"}, "UTF-8"),
    ],
)
def test_bad_payload(queue: Queue, dsn: str, payload: object, message: str) -> None:
    with pytest.raises(BadInput) as exc:
        queue.enqueue(payload, queue="q")  # type: ignore[arg-type]
    assert message in one_line(exc)
    with pytest.raises(BadInput):
        queue.enqueue_many([{"ok": 1}, payload], queue="q")  # type: ignore[list-item]
    assert count_jobs(dsn) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay": -1},
        {"delay": float("nan")},
        {"delay": float("inf")},
        {"delay": "5"},
        {"max_attempts": 0},
        {"max_attempts": -3},
        {"max_attempts": 2.5},
        {"max_attempts": True},
        {"run_at": datetime(2030, 1, 1)},  # naive: whose clock?
        {"run_at": "2030-01-01"},
        {"queue": ""},
        {"queue": "   "},
        {"queue": None},
        {"queue": 5},
        {"queue": "x" * 201},
        {"queue": "a\x00b"},
    ],
)
def test_bad_enqueue_arguments(queue: Queue, dsn: str, kwargs: dict) -> None:
    kwargs = {"queue": "q", **kwargs}
    with pytest.raises(BadInput) as exc:
        queue.enqueue({"n": 1}, **kwargs)
    one_line(exc)
    with pytest.raises(BadInput):
        queue.enqueue_many([{"n": 1}], **kwargs)
    assert count_jobs(dsn) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease": -1},
        {"lease": 0},
        {"lease": float("nan")},
        {"lease": float("inf")},
        {"lease": 10**9},
        {"lease": "30"},
        {"limit": 0},
        {"limit": -1},
        {"limit": 1.5},
        {"limit": True},
    ],
)
def test_bad_claim_arguments_claim_nothing(queue: Queue, dsn: str, kwargs: dict) -> None:
    queue.enqueue({}, queue="q")
    with pytest.raises(BadInput) as exc:
        queue.claim("q", **kwargs)
    one_line(exc)
    assert rows(dsn, "SELECT status, fence FROM jobs") == [("ready", 0)]


def test_bad_heartbeat_and_fail_arguments_change_nothing(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q", lease=30)
    before = job_row(dsn, job.id)
    for call in (
        lambda: queue.heartbeat(job, lease=-1),
        lambda: queue.heartbeat(job, lease=0),
        lambda: queue.heartbeat(job, lease=float("nan")),
        lambda: queue.heartbeat_many([job], lease=0),
        lambda: queue.fail(job, "x", backoff=-1),
        lambda: queue.fail(job, "x", backoff=float("nan")),
        lambda: queue.prune(-5),
    ):
        with pytest.raises(BadInput) as exc:
            call()
        one_line(exc)
    assert job_row(dsn, job.id) == before
    assert not job.lost


def test_check_passes_once_installed(queue: Queue) -> None:
    queue.check()  # raises NotInstalled otherwise (below)


def test_missing_table_says_run_pgqueue_init(empty_dsn: str) -> None:
    with Queue(empty_dsn) as q:
        for call in (
            q.check,
            lambda: q.enqueue({}, queue="q"),
            lambda: q.enqueue_many([{}], queue="q"),
            lambda: q.claim("q"),
            q.reap,
            q.stats,
        ):
            with pytest.raises(NotInstalled) as exc:
                call()
            assert "pgqueue init" in one_line(exc)
    assert rows(empty_dsn, "SELECT to_regclass('jobs')") == [(None,)]


@pytest.mark.parametrize(
    "target",
    [
        "postgresql://alice:s3cret-pw@127.0.0.1:1/nowhere",
        "host=127.0.0.1 port=1 user=alice password=s3cret-pw dbname=nowhere",
        "host=/nonexistent/socket/dir password=s3cret-pw",
    ],
)
def test_unreachable_dsn_is_one_masked_line(target: str) -> None:
    with pytest.raises(ConnectError) as exc:
        Queue(target)
    text = one_line(exc)
    assert "s3cret-pw" not in text
    assert "cannot connect" in text


def test_malformed_dsn_is_one_masked_line() -> None:
    with pytest.raises(ConnectError) as exc:
        Queue("host=x password=s3cret-pw nonsense_option=1")
    assert "s3cret-pw" not in one_line(exc)


def test_large_batches_are_planned_each_time_small_ones_stay_prepared(queue: Queue) -> None:
    """A prepared statement's generic plan cannot see an array's length: thousands of ids
    then took seconds. Batches over PREPARED_UP_TO ids are never prepared."""
    from pgqueue.params import PREPARED_UP_TO

    def prepared_completions() -> int:
        [(n,)] = queue.conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%SET status = 'done', lease_until = NULL, finished_at = now()%FROM unnest%"],
        ).fetchall()
        return int(n)

    big = PREPARED_UP_TO + 1
    queue.enqueue_many([{}] * (big * 3), queue="q")
    for _ in range(3):
        assert queue.complete_many(queue.claim("q", limit=big)) == []
    assert prepared_completions() == 0
    queue.enqueue_many([{}] * 10, queue="q")
    for _ in range(5):
        assert queue.complete_many(queue.claim("q", limit=2)) == []
    assert prepared_completions() == 1


def test_a_heartbeat_moves_the_jobs_lease_until_to_what_the_database_wrote(
    queue: Queue, dsn: str
) -> None:
    queue.enqueue_many([{}, {}], queue="q")
    first, second = queue.claim("q", limit=2, lease=5)
    claimed_until = first.lease_until
    assert queue.heartbeat(first, lease=60)
    [(stored,)] = rows(dsn, "SELECT lease_until FROM jobs WHERE id = %s", [first.id])
    assert first.lease_until == stored and stored > claimed_until
    assert queue.heartbeat_many([first, second], lease=120) == []
    stored_now = dict(rows(dsn, "SELECT id, lease_until FROM jobs"))
    assert (first.lease_until, second.lease_until) == (stored_now[first.id], stored_now[second.id])


def test_cancel_many_cancels_the_ready_and_running_and_fences_out_their_holders(
    queue: Queue, dsn: str
) -> None:
    ready, running, done = queue.enqueue_many([{}, {}, {}], queue="q")
    claimed = queue.claim("q", limit=3)
    held = {j.id: j for j in claimed}
    assert queue.complete(held[done])
    assert queue.release(held[ready])
    assert sorted(queue.cancel_many([ready, running, done, 999_999])) == [ready, running]
    assert not queue.complete(held[running])  # its holder is fenced out
    assert rows(dsn, "SELECT status FROM jobs ORDER BY id") == [
        ("cancelled",),
        ("cancelled",),
        ("done",),
    ]
    assert queue.cancel_many([]) == []
