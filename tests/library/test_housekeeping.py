"""Housekeeping at the edges: ``retry_dead`` when a dead job's key is taken again (Queue,
AsyncQueue and the CLI), ``prune`` over a sparse id span, and ``stats``' latest error."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest
from test_cli import pgqueue

from conftest import rows
from pgqueue import AsyncQueue, LeftDead, Queue


def dead_job(dsn: str, queue: str, key: str | None) -> int:
    """A job that used its one attempt and went dead, holding ``key``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO jobs (queue, payload, status, key, attempts, max_attempts, fence,"
            " last_error, finished_at) VALUES (%s, '{}', 'dead', %s, 1, 1, 1, 'boom', now())"
            " RETURNING id",
            [queue, key],
        ).fetchone()
    assert row is not None
    return int(row[0])


def status(dsn: str, job_id: int) -> str:
    return rows(dsn, "SELECT status FROM jobs WHERE id = %s", [job_id])[0][0]


# -- retry_dead: a key in use again --------------------------------------------------------
def test_retry_dead_skips_a_dead_job_whose_key_is_taken_and_retries_the_others(
    queue: Queue, dsn: str
) -> None:
    taken = dead_job(dsn, "q", "k")
    holder = queue.enqueue({}, queue="q", key="k")  # the key is free again: a new job took it
    plain = dead_job(dsn, "q", None)
    other_key = dead_job(dsn, "q", "free")
    retried = queue.retry_dead("q")
    assert sorted(retried) == [plain, other_key]
    assert retried.skipped == [LeftDead(taken, "k", holder)]
    assert status(dsn, taken) == "dead"
    assert {status(dsn, plain), status(dsn, other_key)} == {"ready"}


def test_retry_dead_of_two_dead_jobs_with_one_key_retries_the_newest(
    queue: Queue, dsn: str
) -> None:
    older, newer = dead_job(dsn, "q", "k"), dead_job(dsn, "q", "k")
    retried = queue.retry_dead("q")
    assert retried == [newer]
    assert retried.skipped == [LeftDead(older, "k", newer)]
    assert (status(dsn, older), status(dsn, newer)) == ("dead", "ready")


def test_retry_dead_by_ids_skips_a_taken_key_too(queue: Queue, dsn: str) -> None:
    taken, free = dead_job(dsn, "q", "k"), dead_job(dsn, "other", "k")
    holder = queue.enqueue({}, queue="q", key="k")  # "other" has no live job with key k
    retried = queue.retry_dead(ids=[free, taken])
    assert retried == [free]
    assert retried.skipped == [LeftDead(taken, "k", holder)]
    nothing = queue.retry_dead(ids=[taken])
    assert (nothing, nothing.skipped) == ([], [LeftDead(taken, "k", holder)])


def test_async_retry_dead_skips_a_taken_key(dsn: str) -> None:
    taken, plain = dead_job(dsn, "q", "k"), dead_job(dsn, "q", None)

    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            holder = await q.enqueue({}, queue="q", key="k")
            retried = await q.retry_dead("q")
            assert retried == [plain]
            assert retried.skipped == [LeftDead(taken, "k", holder)]
            by_id = await q.retry_dead(ids=[taken])
            assert (by_id, by_id.skipped) == ([], [LeftDead(taken, "k", holder)])

    asyncio.run(main())
    assert status(dsn, taken) == "dead"


def test_retry_dead_racing_an_enqueue_of_the_key_retries_the_others(queue: Queue, dsn: str) -> None:
    """An enqueue of the key that commits after retry_dead's statement began: the unique
    index stops the statement (its snapshot could not see the new job); it runs again,
    sees the new holder, and retries every other dead job."""
    taken, plain = dead_job(dsn, "q", "k"), dead_job(dsn, "q", None)
    pid = queue.conn.info.backend_pid
    with psycopg.connect(dsn) as racer:  # a transaction: the new job is not committed yet
        holder = Queue(racer).enqueue({}, queue="q", key="k")
        result: dict = {}

        def retry() -> None:
            try:
                result["value"] = queue.retry_dead("q")
            except BaseException as exc:  # reported below
                result["error"] = exc

        thread = threading.Thread(target=retry)
        thread.start()
        deadline = time.monotonic() + 30
        while not rows(
            dsn,
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            [pid],
        ):  # retry_dead waits on the racer's insert in the unique index
            assert thread.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.01)
        racer.commit()
        thread.join(30)
    assert "error" not in result, result["error"]
    assert result["value"] == [plain]
    assert result["value"].skipped == [LeftDead(taken, "k", holder)]
    assert (status(dsn, taken), status(dsn, plain)) == ("dead", "ready")


def test_cli_retry_dead_says_which_jobs_were_left_dead_and_why(queue: Queue, dsn: str) -> None:
    taken, plain = dead_job(dsn, "q", "k"), dead_job(dsn, "q", None)
    holder = queue.enqueue({}, queue="q", key="k")
    result = pgqueue("retry-dead", "q", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "requeued 1 dead job(s) on 'q'" in result.stdout
    assert f"left dead: job {taken} (key 'k' is held by job {holder})" in result.stdout
    assert status(dsn, plain) == "ready"
    by_id = pgqueue("retry-dead", "--id", str(taken), dsn=dsn)
    assert by_id.returncode == 0, by_id.stderr
    assert f"left dead: job {taken} (key 'k' is held by job {holder})" in by_id.stdout
    assert "not dead" not in by_id.stdout  # it is dead: only its key is taken


@pytest.mark.parametrize("extra", [1, 3])
def test_retry_dead_still_gives_extra_attempts(queue: Queue, dsn: str, extra: int) -> None:
    job = dead_job(dsn, "q", "k")
    assert queue.retry_dead("q", extra=extra) == [job]
    assert rows(dsn, "SELECT max_attempts, status FROM jobs WHERE id = %s", [job]) == [
        (1 + extra, "ready")
    ]


# -- prune: statements in proportion to the rows, not to the span of ids -------------------
def finished_job(dsn: str, queue: str, status: str, days_ago: float) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO jobs (queue, payload, status, attempts, fence, finished_at)"
            " VALUES (%s, '{}', %s, 1, 1, now() - make_interval(days => %s)) RETURNING id",
            [queue, status, days_ago],
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_prune_over_a_sparse_id_span_runs_a_handful_of_statements(queue: Queue, dsn: str) -> None:
    """One old dead job at id 1 and the next job 50 M ids later: prune used to walk the
    span in ranges of ``batch`` ids (5,001 DELETEs, each a progress call, to remove one)."""
    old_dead = dead_job(dsn, "q", None)
    assert old_dead == 1
    rows(dsn, "SELECT setval('jobs_id_seq', 50000000 - 1)")
    old_done = finished_job(dsn, "q", "done", days_ago=2)
    assert old_done == 50_000_000
    calls: list[tuple[int, int]] = []
    removed = queue.prune(
        older_than=86400, progress=lambda done, total: calls.append((done, total))
    )
    assert removed == 1
    assert 1 <= len(calls) <= 2, len(calls)
    assert calls[-1] == (50_000_000, 50_000_000)  # ids done, ids in all: the whole span
    assert rows(dsn, "SELECT id, status FROM jobs") == [(old_dead, "dead")]


def test_prune_in_batches_removes_every_old_finished_job_and_nothing_else(
    queue: Queue, dsn: str
) -> None:
    kept, gone = [], []
    for i in range(25):  # interleaved, so that every batch holds some of each
        kind = i % 5
        if kind == 0:
            kept.append(dead_job(dsn, "q", None))
        elif kind == 1:
            kept.append(finished_job(dsn, "q", "done", days_ago=0))  # too recent
        elif kind == 2:
            kept.append(queue.enqueue({}, queue="q"))
        else:
            gone.append(finished_job(dsn, "q", "done" if kind == 3 else "cancelled", 3))
    calls: list[tuple[int, int]] = []
    removed = queue.prune(86400, batch=10, progress=lambda d, t: calls.append((d, t)))
    assert removed == len(gone) == 10
    assert [i for (i,) in rows(dsn, "SELECT id FROM jobs ORDER BY id")] == sorted(kept)
    assert len(calls) == 3  # 25 jobs, 10 a statement
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and calls[-1] == (25, 25)


def test_prune_archive_moves_in_batches_and_async_prune_does_the_same(dsn: str) -> None:
    first = finished_job(dsn, "q", "done", 3)
    rows(dsn, "SELECT setval('jobs_id_seq', 10000000)")
    second = finished_job(dsn, "q", "cancelled", 3)
    recent = finished_job(dsn, "q", "done", 0)
    with Queue(dsn) as q:
        calls: list[tuple[int, int]] = []
        assert q.prune(86400, archive=True, progress=lambda d, t: calls.append((d, t))) == 2
    assert len(calls) == 1
    assert rows(dsn, "SELECT id FROM jobs_archive ORDER BY id") == [(first,), (second,)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobs SET finished_at = now() - interval '3 days' WHERE id = %s", [recent]
        )

    async def main() -> tuple[int, list[tuple[int, int]]]:
        seen: list[tuple[int, int]] = []
        async with AsyncQueue(dsn) as q:
            removed = await q.prune(86400, progress=lambda d, t: seen.append((d, t)))
        return removed, seen

    removed, seen = asyncio.run(main())
    assert (removed, len(seen)) == (1, 1)
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(0,)]
    with Queue(dsn) as q:  # an empty table: nothing to walk
        calls.clear()
        assert q.prune(0, progress=lambda d, t: calls.append((d, t))) == 0
        assert calls == []


# -- stats: the latest error, looked up, not aggregated ------------------------------------
def test_stats_reads_one_error_per_queue_instead_of_aggregating_them_all(queue: Queue) -> None:
    """The latest error of each queue comes from one row looked up through an index (newest
    first, LIMIT 1), never from an array or string of every error text of the queue."""
    from pgqueue import statements

    queue.conn.execute("SET enable_seqscan = off")  # a tiny table: ask what it can use
    plan = "\n".join(
        r[0] for r in queue.conn.execute("EXPLAIN (VERBOSE) " + statements.query("stats"))
    )
    for aggregate in ("array_agg", "string_agg", "max(jobs.last_error", "min(jobs.last_error"):
        assert aggregate not in plan, plan
    assert "Index Scan Backward using jobs_dead_idx" in plan, plan
    assert plan.count("Limit") >= 2, plan


def test_stats_latest_error_is_the_newest_per_queue_and_status(queue: Queue, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO jobs (queue, payload, status, attempts, max_attempts, fence,"
            " last_error, started_at, finished_at) VALUES"
            " ('a', '{}', 'dead', 1, 1, 1, 'old a', now() - interval '2 hours',"
            "  now() - interval '2 hours'),"
            " ('a', '{}', 'dead', 1, 1, 1, 'new a', now() - interval '1 hour',"
            "  now() - interval '1 hour'),"
            " ('a', '{}', 'dead', 1, 1, 1, 'older, id later', now() - interval '3 hours',"
            "  now() - interval '3 hours'),"
            " ('b', '{}', 'dead', 1, 1, 1, 'from before finished_at', NULL, NULL),"
            " ('a', '{}', 'ready', 1, 5, 2, 'retry old', now() - interval '2 hours', NULL),"
            " ('a', '{}', 'ready', 1, 5, 2, 'retry new', now() - interval '1 minute', NULL),"
            " ('a', '{}', 'ready', 0, 5, 0, NULL, NULL, NULL),"
            " ('b', '{}', 'ready', 0, 5, 0, NULL, NULL, NULL)"
        )
    stats = {(r["queue"], r["status"]): r for r in queue.stats() if not r["estimated"]}
    assert {k: (r["jobs"], r["latest_error"]) for k, r in stats.items()} == {
        ("a", "dead"): (3, "new a"),
        ("a", "ready"): (3, "retry new"),
        ("b", "dead"): (1, "from before finished_at"),
        ("b", "ready"): (1, None),
    }
    assert list(stats) == sorted(stats)  # ordered by queue, then status, as before
    names = next(r for r in queue.stats() if not r["estimated"]).keys()
    assert list(names) == [
        "queue",
        "status",
        "jobs",
        "oldest_ready_seconds",
        "latest_error",
        "estimated",
    ]
