"""Handlers are user code: what a misbehaving handler, a hung one, a stalled keeper or a
lost reply does to a Worker, each against a real PostgreSQL. Whatever happens, no job
stays ``running``, no lane dies silently, and late writes are refused by the fence."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from conftest import rows, wait_for
from pgqueue import AsyncQueue, Job, NotInstalled, Queue, Worker

MakeWorker = Callable[..., Worker]


def statuses(dsn: str) -> dict[str, int]:
    return dict(rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY status"))


@pytest.fixture
def make_worker(dsn: str) -> Iterator[MakeWorker]:
    made: list[Worker] = []

    def make(handler: Callable[[Job], Any], cls: type[Worker] = Worker, **kwargs: Any) -> Worker:
        options: dict[str, Any] = {
            "queue": "q",
            "dsn": dsn,
            "lease": 2.0,
            "poll_interval": 0.1,
            "reap_interval": 0.2,
            "backoff": 0,
        }
        worker = cls(handler, **(options | kwargs))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop(grace=2)


# -- 1. BaseException and broken connections -------------------------------------------
@pytest.mark.parametrize(
    "raised",
    [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError(), GeneratorExit()],
    ids=lambda e: type(e).__name__,
)
def test_a_handler_raising_base_exception_fails_its_job_and_the_lane_goes_on(
    queue: Queue, dsn: str, make_worker: MakeWorker, raised: BaseException
) -> None:
    bad = queue.enqueue({"bad": True}, queue="q", max_attempts=1)
    good = queue.enqueue_many([{"n": i} for i in range(5)], queue="q")

    def handler(job: Job) -> None:
        if job.payload.get("bad"):
            raise raised

    worker = make_worker(handler, concurrency=1, batch=3).start()
    wait_for(lambda: statuses(dsn) == {"dead": 1, "done": 5}, what="bad dead, the rest done")
    # The row is written before the worker counts it: wait for the worker to settle too.
    wait_for(lambda: worker.in_flight == [], what="the worker to settle every job")
    [(error,)] = rows(dsn, "SELECT last_error FROM jobs WHERE id = %s", [bad])
    assert error.startswith(type(raised).__name__), error
    assert worker.failed == 1 and worker.dead == 1 and worker.done == len(good)


def test_a_handler_that_breaks_its_connection_cannot_break_the_bookkeeping(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    """The seed's worker writes with the handler's connection; a handler that opens a
    transaction and makes it fail once left the worker's fail in InFailedSqlTransaction."""
    queue.enqueue({"kind": "aborted"}, queue="q", max_attempts=1)
    queue.enqueue({"kind": "left-open"}, queue="q", max_attempts=1)
    queue.enqueue({"kind": "closed"}, queue="q", max_attempts=1)
    queue.enqueue_many([{"kind": "fine"} for _ in range(3)], queue="q")
    queue.conn.execute("CREATE TABLE side (note text)")

    def handler(job: Job) -> None:
        assert job.conn is not None
        kind = job.payload["kind"]
        if kind == "aborted":
            job.conn.execute("BEGIN")
            job.conn.execute("SELECT 1/0")
        elif kind == "left-open":
            job.conn.execute("BEGIN")
            job.conn.execute("INSERT INTO side VALUES ('never committed')")
        elif kind == "closed":
            job.conn.close()
            raise RuntimeError("closed my own connection")

    worker = make_worker(handler, concurrency=1, batch=6).start()
    wait_for(lambda: statuses(dsn) == {"dead": 3, "done": 3}, what="3 dead, 3 done")
    errors = dict(rows(dsn, "SELECT payload->>'kind', last_error FROM jobs WHERE status='dead'"))
    assert errors["aborted"].startswith("DivisionByZero"), errors
    assert "left a transaction open" in errors["left-open"], errors
    assert errors["closed"].startswith("RuntimeError"), errors
    assert rows(dsn, "SELECT count(*) FROM side") == [(0,)]  # the open transaction rolled back
    idle = rows(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        " AND state LIKE 'idle in transaction%%'",
        [worker.app_name],
    )
    assert idle == [(0,)]


def test_a_handler_returning_a_coroutine_is_an_error_not_a_silent_success(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    """A plain function that returns a coroutine (an ``async`` call it forgot to await) fails
    its job; an ``async def`` handler given to a Worker is awaited on the engine's loop."""
    ran: list[int] = []

    async def later(job: Job) -> None:
        ran.append(job.id)

    def forgot(job: Job) -> Any:
        return later(job)

    queue.enqueue({}, queue="q", max_attempts=1)
    make_worker(forgot).start()
    wait_for(lambda: statuses(dsn) == {"dead": 1}, what="the job to fail")
    [(error,)] = rows(dsn, "SELECT last_error FROM jobs")
    assert "awaitable" in error and ran == []
    awaited = queue.enqueue({}, queue="q2", max_attempts=1)
    make_worker(later, queue="q2").start()
    wait_for(lambda: ran == [awaited], what="the async handler to run")
    wait_for(lambda: statuses(dsn) == {"dead": 1, "done": 1}, what="the job to be done")


def test_every_failed_attempt_logs_one_line_and_the_worker_counts_it(
    queue: Queue, dsn: str, make_worker: MakeWorker, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = queue.enqueue({}, queue="q", max_attempts=2)

    def handler(job: Job) -> None:
        raise LookupError(f"no such table\nsecond line, attempt {job.attempts}")

    def failed_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "failed, attempt" in r.getMessage()]

    caplog.set_level(logging.WARNING, logger="pgqueue")
    worker = make_worker(handler).start()
    wait_for(lambda: statuses(dsn) == {"dead": 1}, what="the job to go dead")
    # The worker counts and logs an attempt after its row is written: wait for the line.
    wait_for(lambda: len(failed_lines()) >= 2, what="the second failed attempt's line")
    lines = failed_lines()
    assert len(lines) == 2, lines
    assert (
        f"job {job_id} (q) failed, attempt 1 of 2: LookupError: no such table; retry in"
        in (lines[0])
    )
    assert lines[1].endswith("now dead"), lines
    assert all("\n" not in line for line in lines)
    assert (worker.failed, worker.dead, worker.done) == (2, 1, 0)


# -- 2. timeouts -----------------------------------------------------------------------
def test_a_hung_handler_is_failed_at_its_timeout_and_its_lane_replaced(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.conn.execute(
        "CREATE TABLE receipts (id int PRIMARY KEY, body text, fence bigint, job_id bigint)"
    )
    hung = queue.enqueue({"hang": True}, queue="q", max_attempts=1)
    hang_over = threading.Event()
    late: dict[str, bool] = {}

    def handler(job: Job) -> None:
        if job.payload.get("hang"):
            hang_over.wait(30)  # hangs until the test lets it go
            late["write"] = job.fenced_write("receipts", {"id": 1}, {"body": "late"})
            late["lost"] = job.lost

    worker = make_worker(handler, concurrency=1, batch=3, timeout=0.5).start()
    wait_for(lambda: statuses(dsn).get("dead") == 1, what="the hung job to be failed")
    [(error, fence, attempts)] = rows(
        dsn, "SELECT last_error, fence, attempts FROM jobs WHERE id = %s", [hung]
    )
    assert error.startswith("TimeoutError") and "0.5 s timeout" in error
    assert fence > attempts  # failing raised the fence: the hung handler's writes are stale
    # concurrency is kept: a new lane drains the queue while the old one still hangs
    others = queue.enqueue_many([{"n": i} for i in range(4)], queue="q")
    wait_for(lambda: statuses(dsn) == {"dead": 1, "done": len(others)}, what="the rest done")
    # The worker counts and records a completion after its row is written: wait for those.
    wait_for(lambda: worker.events.count("complete") >= len(others), what="the completions")
    assert worker.timed_out == 1
    # the hung handler's thread still runs, retired; another lane thread ran the rest
    lanes = [t for t in threading.enumerate() if t.name == "pgqueue-worker"]  # lane threads
    assert len(lanes) >= 2
    hang_over.set()
    wait_for(lambda: "write" in late, what="the stale handler to return")
    assert late == {"write": False, "lost": True}
    assert rows(dsn, "SELECT count(*) FROM receipts") == [(0,)]
    assert worker.done == len(others) and worker.rejected == 0


def test_a_timed_out_batch_gives_back_its_unstarted_jobs(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue({"hang": True}, queue="q", max_attempts=1)
    rest = queue.enqueue_many([{"n": i} for i in range(3)], queue="q")
    hang_over = threading.Event()
    ran: list[int] = []

    def handler(job: Job) -> None:
        ran.append(job.id)
        if job.payload.get("hang"):
            hang_over.wait(30)

    make_worker(handler, concurrency=1, batch=4, timeout=0.5).start()
    wait_for(lambda: statuses(dsn) == {"dead": 1, "done": 3}, what="siblings done by the new lane")
    hang_over.set()
    time.sleep(0.3)
    assert sorted(ran[1:]) == rest and len(ran) == 4  # each sibling ran once, not twice
    attempts = rows(dsn, "SELECT attempts FROM jobs WHERE id = ANY(%s)", [rest])
    assert attempts == [(1,)] * 3  # the release gave the first claim's attempt back


# -- 3. a stalled keeper: the local lease deadline --------------------------------------
class StalledKeeper(Worker):
    """A worker whose heartbeats hang, as on a half-open TCP connection."""

    stall = threading.Event()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

        async def hang(queue: AsyncQueue) -> None:
            await asyncio.to_thread(self.stall.wait, 30)

        self.engine.keeper.heartbeat = hang  # type: ignore[method-assign]


def test_a_stalled_keeper_does_not_start_jobs_after_their_lease_ran_out(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue_many([{"n": i} for i in range(2)], queue="q")
    seen_lost: list[bool] = []
    started: list[int] = []

    def handler(job: Job) -> None:
        started.append(job.id)
        deadline = time.monotonic() + 5
        while not job.lost and time.monotonic() < deadline:  # a long job that checks
            time.sleep(0.02)
        seen_lost.append(job.lost)

    StalledKeeper.stall.clear()
    worker = make_worker(handler, cls=StalledKeeper, lease=1.0, batch=2, reap_interval=100)
    worker.start()
    try:
        wait_for(lambda: seen_lost, what="the handler to notice the lease ran out")
        assert seen_lost == [True]  # no heartbeat said so: the local deadline did
        # The lane comes to the sibling once the handler has returned: wait for its decision.
        wait_for(lambda: worker.events.count("skipped"), what="the sibling to be skipped")
        assert len(started) == 1  # its batch sibling, past its lease too, was never started
        assert worker.events.count("skipped") == 1
    finally:
        StalledKeeper.stall.set()


# -- 9. a lost reply, and giving up -----------------------------------------------------
@pytest.mark.parametrize("method", ["complete", "complete_many"])
def test_a_completion_whose_reply_was_lost_is_counted_done_not_refused(
    queue: Queue,
    dsn: str,
    make_worker: MakeWorker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    method: str,
) -> None:
    real = getattr(AsyncQueue, method)  # the engine's statements go through AsyncQueue
    calls: list[int] = []

    async def complete_then_lose_the_reply(self: AsyncQueue, job: Any, *more: Any) -> Any:
        calls.append(1)
        took = await real(self, job, *more)
        if len(calls) == 1:
            await self.conn.close()  # the commit happened; the caller never hears of it
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return took

    monkeypatch.setattr(AsyncQueue, method, complete_then_lose_the_reply)
    caplog.set_level(logging.WARNING, logger="pgqueue")
    queue.enqueue({}, queue="q")
    batched = method == "complete_many"
    worker = make_worker(lambda job: None, complete_in_batches=batched).start()
    wait_for(lambda: worker.done == 1, what="the job to count as done")
    assert (worker.rejected, worker.gave_up, statuses(dsn)) == (0, 0, {"done": 1})
    assert not [r for r in caplog.records if "refused" in r.getMessage()]


def test_a_worker_that_cannot_finish_says_it_gave_up_and_the_reaper_returns_the_job(
    queue: Queue,
    dsn: str,
    make_worker: MakeWorker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def never(self: AsyncQueue, job: Job, *more: Any) -> bool:
        raise psycopg.OperationalError("no route to host")

    monkeypatch.setattr(AsyncQueue, "complete", never)
    monkeypatch.setattr(AsyncQueue, "complete_many", never)  # the buffered path
    caplog.set_level(logging.WARNING, logger="pgqueue")
    job_id = queue.enqueue({}, queue="q")
    worker = make_worker(lambda job: None, lease=1.0, reap_interval=0.2).start()
    wait_for(lambda: worker.gave_up == 1, what="the worker to give up")
    assert worker.rejected == 0
    assert any("gave up on the complete of job" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    worker.stop(grace=1)
    with Queue(dsn) as q:
        wait_for(lambda: q.reap() or q.get(job_id).status == "ready", what="reaper")  # type: ignore[union-attr]
        assert q.get(job_id).status == "ready"  # type: ignore[union-attr]


# -- 10. signals -------------------------------------------------------------------------
@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)
def test_run_restores_signal_handlers_and_a_second_signal_forces_the_stop(
    queue: Queue, dsn: str
) -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGINT, mine)
    try:
        queue.enqueue({}, queue="q")
        started = threading.Event()
        release = threading.Event()

        def handler(job: Job) -> None:
            started.set()
            release.wait(30)

        worker = Worker(handler, queue="q", dsn=dsn, poll_interval=0.1, lease=5)

        def interrupt_twice() -> None:
            started.wait(10)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_twice, daemon=True).start()
        began = time.monotonic()
        worker.run(grace=20)
        assert time.monotonic() - began < 10  # the second signal did not wait out the grace
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) is not worker._on_signal
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)


# -- 8. first in, first out among equals -------------------------------------------------
def test_jobs_with_the_same_run_at_are_claimed_first_in_first_out(queue: Queue, dsn: str) -> None:
    # Forty jobs sharing one run_at (as a bulk enqueue's do), written to the heap in the
    # reverse of their ids: ordered by run_at alone, the claim would follow the heap.
    queue.conn.execute(
        "INSERT INTO jobs (id, queue, payload, run_at)"
        " SELECT g, 'q', '{}', now() - interval '1 s' FROM generate_series(40, 1, -1) AS g"
    )
    claimed = [job.id for _ in range(40) for job in queue.claim("q")]
    assert claimed == list(range(1, 41))


def test_higher_priority_runs_first_and_the_claim_reads_the_index_in_order(
    queue: Queue, dsn: str
) -> None:
    low = queue.enqueue_many([{"n": i} for i in range(3)], queue="q")
    high = queue.enqueue({"urgent": True}, queue="q", priority=5)
    assert [j.id for j in queue.claim("q", limit=4)] == [high, *low]
    from pgqueue import statements

    queue.conn.execute("SET enable_seqscan = off")  # a near-empty table: ask for the index
    plan = "\n".join(
        r[0]
        for r in queue.conn.execute(
            "EXPLAIN " + statements.query("claim"), {"queue": "q", "limit": 1, "lease": 30}
        )
    )
    # The ready jobs come from the index in claim order: the only sort is of the claimed
    # batch itself (at most ``limit`` rows), never of all ready jobs.
    sorts = [line.strip() for line in plan.splitlines() if "Sort Key" in line]
    assert "Index Scan using jobs_ready_idx" in plan, plan
    assert all(key.startswith("Sort Key: claimed.") for key in sorts), plan


def test_a_setting_that_retrying_cannot_mend_stops_the_worker_with_that_error(
    dsn: str, make_worker: MakeWorker
) -> None:
    """A dropped jobs table (like prepared statements through PgBouncer without the flag)
    would meet every retry: the worker stops, and run() raises the one-line error."""
    worker = make_worker(lambda job: None, burst=False, poll_interval=0.05)
    with psycopg.connect(dsn, autocommit=True) as conn:
        threading.Timer(0.5, lambda: conn.execute("DROP TABLE jobs CASCADE")).start()
        began = time.monotonic()
        with pytest.raises(NotInstalled):
            worker.run(grace=1)
    assert time.monotonic() - began < 10
    assert isinstance(worker.error, NotInstalled)


def test_stop_does_not_wait_for_a_hung_handler_already_timed_out(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue({}, queue="q", max_attempts=1)
    hang_over = threading.Event()
    worker = make_worker(lambda job: hang_over.wait(30), timeout=0.3, burst=True)
    try:
        began = time.monotonic()
        worker.run(grace=20)  # burst: the queue is dry once the hung job has been failed
        assert time.monotonic() - began < 10
        assert statuses(dsn) == {"dead": 1}
    finally:
        hang_over.set()


# -- a job claimed again by a sibling lane before the first claim's bookkeeping is over --
class _SlowBookkeeping(Worker):
    """A Worker whose engine files each ending 0.3 s after the row was written, as a busy
    machine may between writing a job's row and forgetting the job; the loop goes on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        engine = self.engine
        settle = engine.ends.settle

        def later(*a: Any, **k: Any) -> None:
            asyncio.get_running_loop().call_later(0.3, lambda: settle(*a, **k))

        engine.ends.settle = later  # type: ignore[method-assign]


def test_a_failed_job_claimed_again_by_a_sibling_lane_is_run_not_dropped(
    queue: Queue, dsn: str
) -> None:
    """With no backoff, a failed job is ready at once, and the worker's other lane may
    claim it (fence 3) while the first lane is still filing the fail of fence 1. The two
    claims are different claims: the second must run, be heartbeated and be completed, not
    be taken for the first one (skipped, then forgotten, then reaped without running)."""
    job_id = queue.enqueue({}, queue="q", max_attempts=2)
    runs: list[tuple[int, int]] = []

    def handler(job: Job) -> None:
        runs.append((job.attempts, job.fence))
        if job.attempts == 1:
            raise ValueError("the first attempt fails")

    worker = _SlowBookkeeping(
        handler, queue="q", dsn=dsn, concurrency=2, lease=2.0, poll_interval=0.05, backoff=0
    ).start()
    try:
        wait_for(lambda: worker.done + worker.dead == 1, 30, "the job's second attempt to end")
    finally:
        worker.stop(grace=2)
    assert runs == [(1, 1), (2, 3)]  # claim 1, fail raised the fence to 2, claim 3
    assert rows(dsn, "SELECT status, attempts, fence, last_error FROM jobs") == [
        ("done", 2, 3, "ValueError: the first attempt fails")
    ]
    assert (worker.failed, worker.done, worker.rejected) == (1, 1, 0)
    claims = {e.fence: e.worker for e in worker.events.events("claim")}
    [fail] = worker.events.events("fail")
    [done] = worker.events.events("complete")
    # each ending is filed under the lane that held that claim
    assert (fail.job_id, fail.fence, fail.worker) == (job_id, 1, claims[1])
    assert (done.job_id, done.fence, done.worker) == (job_id, 3, claims[3])
    assert worker.events.count("skipped") == 0


# -- RetryAfter with a delay already past, too long, or not a number ---------------------
def test_retry_after_takes_a_timedelta_and_bounds_its_delay() -> None:
    from datetime import timedelta

    from pgqueue import RetryAfter

    assert RetryAfter(timedelta(minutes=2)).seconds == 120.0
    past = RetryAfter(-3.5)  # a reset time that has already passed: retry at once
    assert past.seconds == 0.0 and str(past) == "retry after 0 s (asked for -3.5 s)"
    assert RetryAfter(3 * 86400).seconds == 86400.0  # at most a day, as the backoff
    assert str(RetryAfter(30, "rate limited")) == "rate limited"
    for bad, error in (("soon", TypeError), (True, TypeError), (float("nan"), ValueError)):
        with pytest.raises(error, match="RetryAfter takes seconds"):
            RetryAfter(bad)  # type: ignore[arg-type]


def test_a_retry_after_of_any_delay_retries_its_job_and_the_worker_stays_up(
    queue: Queue, dsn: str
) -> None:
    """A RetryAfter whose delay fail's SQL would refuse (negative, over a day) once escaped
    the lane, left its job running and stopped the whole worker. Now each job is retried
    as asked, within bounds, and a RetryAfter that cannot be made fails its job instead."""
    from datetime import timedelta

    from pgqueue import RetryAfter

    asks: dict[str, Any] = {
        "past": -0.5,
        "two days": 2 * 86400.0,
        "timedelta": timedelta(seconds=0),
        "not a number": "soon",
    }
    ids = {name: queue.enqueue({"ask": name}, queue="q", max_attempts=2) for name in asks}

    def handler(job: Job) -> None:
        if job.attempts == 1:
            raise RetryAfter(asks[job.payload["ask"]])

    worker = Worker(handler, queue="q", dsn=dsn, concurrency=2, poll_interval=0.05, backoff=0)
    worker.start()
    try:
        wait_for(lambda: worker.failed == 4 and worker.done == 3, 30, "3 retries done")
    finally:
        worker.stop(grace=2)
    assert worker.error is None and worker.gave_up == 0
    found = {
        i: (status, error, float(wait))
        for i, status, error, wait in rows(
            dsn, "SELECT id, status, last_error, extract(epoch FROM run_at - now()) FROM jobs"
        )
    }
    assert found[ids["past"]][:2] == ("done", "RetryAfter: retry after 0 s (asked for -0.5 s)")
    assert found[ids["timedelta"]][:2] == ("done", "RetryAfter: retry after 0 s")
    status, error, wait = found[ids["two days"]]
    assert (status, error) == ("ready", "RetryAfter: retry after 86400 s (asked for 172800 s)")
    assert 86000 < wait <= 86400
    status, error, _ = found[ids["not a number"]]  # failed by its TypeError, then retried
    assert status == "done" and error.startswith("TypeError: RetryAfter takes seconds")


# -- an exception whose __str__ raises ----------------------------------------------------
class _Unprintable(Exception):
    def __str__(self) -> str:
        return f"status {self.status}"  # type: ignore[attr-defined]  # never set


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_exception_that_cannot_be_printed_still_fails_its_job(
    queue: Queue, dsn: str, asynchronous: bool
) -> None:
    """Its message cannot be read, but the job is failed at once with its type named, not
    left to its lease (where each attempt would cost a whole lease and end as a reap)."""
    job_id = queue.enqueue({}, queue="q", max_attempts=1)
    expected = "_Unprintable: (its message could not be read: its __str__ raised)"
    if asynchronous:
        from pgqueue import AsyncWorker

        async def handle(job: Job) -> None:
            raise _Unprintable()

        async def main() -> None:
            w = await AsyncWorker(handle, queue="q", dsn=dsn, lease=30, poll_interval=0.05).start()
            try:
                for _ in range(400):
                    if w.dead == 1:
                        break
                    await asyncio.sleep(0.05)
            finally:
                await w.stop(grace=2)

        asyncio.run(main())
    else:

        def handler(job: Job) -> None:
            raise _Unprintable()

        worker = Worker(handler, queue="q", dsn=dsn, lease=30, poll_interval=0.05).start()
        try:
            wait_for(lambda: worker.dead == 1, 20, "the job to be failed")
        finally:
            worker.stop(grace=2)
    assert rows(dsn, "SELECT id, status, last_error FROM jobs") == [(job_id, "dead", expected)]


# -- graceful stop: a finished job's buffered completion is not left to its lease ---------
def test_a_graceful_stop_completes_buffered_jobs_even_when_a_sibling_outlives_the_grace(
    queue: Queue, dsn: str
) -> None:
    """A batch [fast, slow]: fast's completion waits in the buffer for the batch's end or
    flush_after (5 s here), slow outlives the stop's grace. The keeper must not leave with
    fast still buffered: its handler succeeded, so it must not run again."""
    queue.enqueue_many([{"kind": "fast"}, {"kind": "slow"}], queue="q")
    slow_started, release = threading.Event(), threading.Event()

    def handler(job: Job) -> None:
        if job.payload["kind"] == "slow":
            slow_started.set()
            release.wait(10)  # runs past the stop's grace

    worker = Worker(
        handler, queue="q", dsn=dsn, lease=5.0, poll_interval=0.1, batch=2, flush_after=5.0
    ).start()
    try:
        assert slow_started.wait(20)
        wait_for(
            lambda: len(worker.engine.ends.buffer) == 1, 10, "fast's completion to be buffered"
        )
        worker.stop(grace=0.5)
        wait_for(lambda: worker.done == 1, 10, "fast's completion to be counted")
        assert dict(rows(dsn, "SELECT payload->>'kind', status FROM jobs")) == {
            "fast": "done",
            "slow": "running",  # still in its handler: its lease decides
        }
    finally:
        release.set()


# -- burst mode with a timeout: the run does not end with the timed-out job left over -----
def test_a_burst_run_retries_a_timed_out_job_before_it_ends(queue: Queue, dsn: str) -> None:
    """The timed-out lane's successor used to start before the keeper had filed the fail,
    so it found nothing to claim (the job was still running) and ended the burst run,
    leaving the job ready with nobody to run it."""
    job_id = queue.enqueue({}, queue="q", max_attempts=3)
    gate = threading.Event()

    def handler(job: Job) -> None:
        if job.attempts == 1:
            gate.wait(10)  # hangs past the timeout on its first attempt

    worker = Worker(
        handler,
        queue="q",
        dsn=dsn,
        lease=5.0,
        poll_interval=0.1,
        backoff=0,
        timeout=0.5,
        burst=True,
    ).start()
    try:
        worker.join(30)
        assert not worker._working(), "the burst run did not end"
    finally:
        worker.stop(grace=1)
        gate.set()
    assert rows(dsn, "SELECT id, status, attempts FROM jobs") == [(job_id, "done", 2)]
    assert (worker.timed_out, worker.done) == (1, 1)


# -- a flush files each claim's answer under that claim ----------------------------------
def test_a_flush_with_two_claims_of_one_job_counts_the_accepted_one_as_done(
    queue: Queue, dsn: str
) -> None:
    """Two claims of one job can sit in the completion buffer together: the first's lease
    ran out while it waited there, and another lane ran the job again. complete_many
    refuses the first and accepts the second; the worker must file the answers by claim,
    not call both refused. (Driven through the worker's own buffer and flush.)"""
    job_id = queue.enqueue({}, queue="q")
    [old] = queue.claim("q", lease=30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
    assert [r.id for r in queue.reap()] == [job_id]
    [new] = queue.claim("q", lease=30)
    # not started: its bookkeeping only, two lanes (w.1, w.2)
    engine = Worker(lambda job: None, queue="q", dsn=dsn, name="w", concurrency=2).engine
    engine._take([old])  # type: ignore[list-item]
    engine._take([new])  # type: ignore[list-item]
    engine._waiting.clear()
    for claim in engine.claims.values():
        claim.batch.left = 0  # both handlers have returned: their batches are over
    engine.ends.buffer = [(claim, time.monotonic()) for claim in engine.claims.values()]

    async def flush() -> None:
        try:
            await engine.ends.flush()
        finally:
            await engine.ends.link.drop()

    asyncio.run(flush())
    assert rows(dsn, "SELECT status, fence FROM jobs") == [("done", 2)]
    assert (engine.done, engine.rejected) == (1, 1)
    ends = [(e.kind, e.fence, e.worker) for e in engine.events.events() if e.kind != "claim"]
    assert sorted(ends) == [("complete", 2, "w.2"), ("complete-rejected", 1, "w.1")]
    assert not engine.claims and not engine.ends.finishing
