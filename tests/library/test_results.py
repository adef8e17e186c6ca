"""Job results (issue #21, item 1): a handler's return value is stored with its job by the
fenced completion and comes back through ``Queue.result`` / ``AsyncQueue.result``, which
wait on the notification the completing statement sends (polling is only the fallback);
a dead or cancelled job raises ``JobFailed``; a value that cannot be stored fails the job
in one line and stores nothing."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conftest import rows
from pgqueue import (
    MAX_RESULT_BYTES,
    AsyncJob,
    AsyncQueue,
    AsyncWorker,
    BadInput,
    Job,
    JobFailed,
    Queue,
    Worker,
)
from pgqueue.install import block
from pgqueue.statements import query

# A poll interval no test waits out: a result that arrives within the test's own 20 s
# wait came through the notification.
NEVER = 60.0
WAIT = 20.0


def wait_for(check: Callable[[], Any], timeout: float = WAIT, what: str = "condition") -> Any:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def run_worker(dsn: str) -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(handler: Callable[[Job], Any], **kwargs: Any) -> Worker:
        options = {"queue": "q", "dsn": dsn, "lease": 5.0, "poll_interval": 0.1} | kwargs
        worker = Worker(handler, **options).start()
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop(grace=2)


def waiting(dsn: str, app: str) -> Callable[[], bool]:
    """Whether the session named ``app`` has read the job's row and sits idle: waiting."""
    query = (
        "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND state = 'idle' "
        "AND query LIKE '%%SELECT status, result, last_error%%'"
    )
    return lambda: bool(rows(dsn, query, (app,)))


# -- results come back ---------------------------------------------------------------------
def test_a_plain_handlers_return_value_comes_back(queue: Queue, run_worker: Any) -> None:
    ids = [queue.enqueue({"n": n}, queue="q") for n in range(5)]
    run_worker(lambda job: {"twice": job.payload["n"] * 2, "tags": ["a", "é"]}, concurrency=2)
    for n, job_id in enumerate(ids):
        assert queue.result(job_id, timeout=WAIT) == {"twice": 2 * n, "tags": ["a", "é"]}
    state = queue.get(ids[1])
    assert state is not None and state.result == {"twice": 2, "tags": ["a", "é"]}


def test_a_handler_returning_none_stores_null(queue: Queue, run_worker: Any, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q")
    run_worker(lambda job: None)
    assert queue.result(job_id, timeout=WAIT) is None
    assert rows(dsn, "SELECT status, result FROM jobs WHERE id = %s", (job_id,)) == [("done", None)]


def test_an_async_handlers_return_value_comes_back(dsn: str) -> None:
    async def handler(job: AsyncJob) -> Any:
        await asyncio.sleep(0.01)
        return [job.payload["n"], "done"]

    async def run() -> list[Any]:
        worker = AsyncWorker(handler, queue="q", dsn=dsn, poll_interval=0.1, concurrency=3)
        async with AsyncQueue(dsn) as q:
            ids = [await q.enqueue({"n": n}, queue="q") for n in range(4)]
            await worker.start()
            try:
                return [await q.result(i, timeout=WAIT) for i in ids]
            finally:
                await worker.stop(grace=2)

    assert asyncio.run(run()) == [[n, "done"] for n in range(4)]


# -- jobs that end without a result --------------------------------------------------------
def test_a_dead_job_raises_job_failed_with_its_last_error(queue: Queue, run_worker: Any) -> None:
    def boom(job: Job) -> None:
        raise ValueError("the disk is full")

    job_id = queue.enqueue({}, queue="q", max_attempts=1)
    run_worker(boom)
    with pytest.raises(JobFailed) as failed:
        queue.result(job_id, timeout=WAIT, poll_interval=NEVER)
    assert failed.value.status == "dead"
    assert failed.value.last_error == "ValueError: the disk is full"
    assert str(failed.value) == f"job {job_id} is dead: ValueError: the disk is full"


def test_a_cancelled_job_raises_job_failed_and_wakes_its_waiter(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q", delay=3600)
    app = "waiter-cancel"
    raised: list[BaseException] = []

    def wait() -> None:
        with Queue(dsn, application_name=app) as q:
            try:
                q.result(job_id, poll_interval=NEVER)
            except BaseException as exc:
                raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(waiting(dsn, app), what="the waiter to wait")
    assert queue.cancel(job_id)
    waiter.join(WAIT)  # the cancel's notification, not the 60 s poll, wakes it
    assert not waiter.is_alive()
    [exc] = raised
    assert isinstance(exc, JobFailed) and exc.status == "cancelled"


def test_a_job_still_running_past_the_timeout_raises_timeout_error(queue: Queue) -> None:
    job_id = queue.enqueue({}, queue="q")
    with pytest.raises(TimeoutError, match=f"job {job_id} did not finish in time .it is ready"):
        queue.result(job_id, timeout=0.2, poll_interval=0.05)
    with pytest.raises(BadInput, match="there is no job 999999"):
        queue.result(999_999, timeout=0)


# -- results that cannot be stored ---------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("x" * MAX_RESULT_BYTES, f"over the {MAX_RESULT_BYTES:,}-byte cap"),
        ({1, 2}, "the return value (set) is not JSON-serialisable"),
        ({"x": float("nan")}, "the return value (dict) is not JSON-serialisable"),
    ],
)
def test_a_result_it_cannot_store_fails_the_job_in_one_line(
    queue: Queue, run_worker: Any, dsn: str, value: object, words: str
) -> None:
    job_id = queue.enqueue({}, queue="q", max_attempts=3)
    run_worker(lambda job: value)
    with pytest.raises(JobFailed) as failed:
        queue.result(job_id, timeout=WAIT)
    error = failed.value.last_error
    assert error is not None and words in error and "\n" not in error
    # Dead at once, nothing stored: the handler would return the same again.
    assert rows(dsn, "SELECT status, attempts, result FROM jobs WHERE id = %s", (job_id,)) == [
        ("dead", 1, None)
    ]


def test_complete_refuses_a_result_it_cannot_store(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    with pytest.raises(BadInput, match="not JSON-serialisable"):
        queue.complete(job, object())
    with pytest.raises(BadInput, match="NUL character"):
        queue.complete_many([job], ["a\x00b"])
    assert rows(dsn, "SELECT status FROM jobs") == [("running",)]  # nothing written
    assert queue.complete(job, {"ok": True})


# -- fenced like every completion ----------------------------------------------------------
@pytest.mark.parametrize("many", [False, True])
def test_a_stale_holders_result_is_refused(queue: Queue, dsn: str, many: bool) -> None:
    job_id = queue.enqueue({}, queue="q")
    [stale] = queue.claim("q", lease=30)
    rows(dsn, "UPDATE jobs SET lease_until = now() - interval '1 s' RETURNING id")
    assert [r.id for r in queue.reap()] == [job_id]
    [holder] = queue.claim("q")
    assert holder.fence > stale.fence
    assert queue.complete(holder, {"by": "the new holder"})
    if many:
        assert queue.complete_many([stale], [{"by": "the stale one"}]) == [stale]
    else:
        assert not queue.complete(stale, {"by": "the stale one"})
    assert stale.lost
    assert queue.result(job_id, timeout=0) == {"by": "the new holder"}


def test_a_batch_stores_each_jobs_own_result(queue: Queue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(4)], queue="q")
    jobs = queue.claim("q", limit=4)
    results = [None if j.payload["n"] == 2 else {"n": j.payload["n"]} for j in jobs]
    assert queue.complete_many(jobs, results) == []
    got = [queue.result(i, timeout=0) for i in ids]
    assert got == [{"n": 0}, {"n": 1}, None, {"n": 3}]


# -- the waiter hears the job end ----------------------------------------------------------
def test_the_waiter_is_woken_by_the_notification(queue: Queue, run_worker: Any, dsn: str) -> None:
    release = threading.Event()

    def handler(job: Job) -> str:
        release.wait(WAIT)
        return "finished"

    job_id = queue.enqueue({}, queue="q")
    run_worker(handler)
    app = "waiter-notify"
    got: list[Any] = []

    def wait() -> None:
        with Queue(dsn, application_name=app) as q:
            got.append(q.result(job_id, poll_interval=NEVER))

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(waiting(dsn, app), what="the waiter to wait")
    release.set()
    waiter.join(WAIT)  # a 60 s poll cannot have brought it: the notification did
    assert not waiter.is_alive()
    assert got == ["finished"]


def _heard(listener: psycopg.Connection[Any], seconds: float = 0.5) -> list[str]:
    """The pgqueue_done payloads ``listener`` receives within ``seconds``."""
    return [n.payload for n in listener.notifies(timeout=seconds)]


def test_a_job_nobody_waits_for_ends_without_a_notification(queue: Queue, dsn: str) -> None:
    """A notifying commit takes a server-wide lock, so the statements that end a job notify
    only for jobs a Queue.result waits for (a row in pgqueue_waiters): here every way a job
    ends (complete, complete_many, a fail that kills it, a reap that kills it, a cancel) is
    silent without a waiter and heard with one."""
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN pgqueue_done")
        for waited in (False, True):
            ids = [queue.enqueue({}, queue="n", max_attempts=1) for _ in range(6)]
            if waited:  # what Queue.result does while it waits
                for job_id in ids:
                    queue.conn.execute(query("wait_for"), {"id": job_id})
            one, two, three, dead, reaped, _cancelled = queue.claim("n", limit=6, lease=30)
            queue.complete(one)
            queue.complete(two, {"a": 1})
            queue.complete_many([three])
            queue.fail(dead, "boom")
            queue.conn.execute(
                "UPDATE jobs SET lease_until = now() - interval '1 s' WHERE id = %s", [reaped.id]
            )
            queue.reap()
            queue.cancel(ids[5])
            heard = _heard(listener)
            assert sorted(heard) == (sorted(str(i) for i in ids) if waited else []), waited
            assert {s for (s,) in rows(dsn, "SELECT DISTINCT status FROM jobs")} == {
                "done",
                "dead",
                "cancelled",
            }


def test_a_waiter_takes_its_row_away_when_it_returns_or_times_out(
    queue: Queue, run_worker: Any, dsn: str
) -> None:
    job_id = queue.enqueue({}, queue="q")
    with pytest.raises(TimeoutError):
        queue.result(job_id, timeout=0.2)
    assert rows(dsn, "SELECT count(*) FROM pgqueue_waiters") == [(0,)]
    run_worker(lambda job: "ok")
    assert queue.result(job_id, timeout=WAIT) == "ok"
    assert rows(dsn, "SELECT count(*) FROM pgqueue_waiters") == [(0,)]


def test_an_async_waiter_is_woken_by_the_notification(dsn: str) -> None:
    async def run() -> Any:
        release = asyncio.Event()

        async def handler(job: AsyncJob) -> dict[str, int]:
            await release.wait()
            return {"answer": 42}

        worker = AsyncWorker(handler, queue="q", dsn=dsn, poll_interval=0.1)
        app = "waiter-async"
        async with AsyncQueue(dsn) as q:
            job_id = await q.enqueue({}, queue="q")
        await worker.start()
        try:
            conn = await psycopg.AsyncConnection.connect(
                make_conninfo(dsn, application_name=app), autocommit=True
            )
            async with conn, AsyncQueue(conn) as waiter_q:
                waiter = asyncio.create_task(waiter_q.result(job_id, poll_interval=NEVER))
                await asyncio.to_thread(wait_for, waiting(dsn, app), WAIT, "the waiter")
                release.set()
                return await asyncio.wait_for(waiter, WAIT)
        finally:
            await worker.stop(grace=2)

    assert asyncio.run(run()) == {"answer": 42}


@pytest.mark.parametrize("how", ["listen=False", "pgbouncer=True"])
def test_without_listen_it_polls(queue: Queue, run_worker: Any, dsn: str, how: str) -> None:
    release = threading.Event()
    job_id = queue.enqueue({}, queue="q")
    run_worker(lambda job: release.wait(WAIT) and "polled")
    app = f"waiter-{how.split('=')[0]}"
    got: list[Any] = []

    def wait() -> None:
        kwargs = {"pgbouncer": True} if how == "pgbouncer=True" else {}
        with Queue(dsn, application_name=app, **kwargs) as q:
            listen = how != "listen=False"
            got.append(q.result(job_id, timeout=WAIT, poll_interval=0.1, listen=listen))

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(waiting(dsn, app), what="the waiter to poll")
    listens = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN pgqueue_done%%'"
    assert rows(dsn, listens) == [(0,)]  # polling only: it never listened
    release.set()
    waiter.join(WAIT)
    assert got == ["polled"]


# -- the column on an older table ----------------------------------------------------------
def test_install_adds_the_result_column_to_an_older_table(empty_dsn: str) -> None:
    # The table as the release before results made it: the same, without the last column.
    before = re.sub(r"\n  result +jsonb,[^\n]*", "", block("jobs_table"))
    assert "result" not in before
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(before)
        conn.execute("CREATE TABLE jobs_archive (LIKE jobs)")
        conn.execute("INSERT INTO jobs (queue, payload, status) VALUES ('q', '{}', 'done')")
    with Queue(empty_dsn) as q:
        done = q.install()
        assert "added columns to jobs (result)" in done.changed
        assert "added columns to jobs_archive" in done.changed
        assert q.install().changed == []
        job_id = q.enqueue({}, queue="q")
        [job] = q.claim("q")
        assert q.complete(job, {"kept": [1, 2]})
        assert q.result(job_id, timeout=0) == {"kept": [1, 2]}
        assert q.prune(0, archive=True) == 2  # the archive has the column, in the same place
    columns = "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
    assert rows(empty_dsn, columns, ("jobs",)) == rows(empty_dsn, columns, ("jobs_archive",))
    assert rows(empty_dsn, "SELECT result FROM jobs_archive ORDER BY id") == [
        (None,),
        ({"kept": [1, 2]},),
    ]


def test_pgqueue_show_prints_the_result(queue: Queue) -> None:
    from test_cli import pgqueue

    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert queue.complete(job, {"rows": 3, "name": "é"})
    dsn = queue.conn.info.dsn
    shown = pgqueue("show", str(job_id), dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    # jsonb keeps no key order: shorter keys first
    assert 'result        {"name": "\\u00e9", "rows": 3}' in shown.stdout.splitlines()
    as_json = pgqueue("show", str(job_id), "--json", dsn=dsn)
    assert json.loads(as_json.stdout)["result"] == {"rows": 3, "name": "é"}
