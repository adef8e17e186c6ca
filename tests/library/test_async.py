"""``AsyncQueue`` and ``AsyncWorker`` on a real PostgreSQL and a real event loop: the same
statements, validation and errors as ``Queue``, and the threaded ``Worker``'s guarantees
(each job done once, failures by the rules, timeouts, fences, graceful stop).

pytest-asyncio is not used: each test drives its coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
import pytest

from conftest import rows
from pgqueue import (
    AsyncJob,
    AsyncQueue,
    AsyncWorker,
    BadInput,
    ConnectError,
    EventLog,
    FenceConflict,
    GiveUp,
    NotInstalled,
    PgQueueError,
    Queue,
    RetryAfter,
    Tasks,
    async_connect,
)
from pgqueue import async_queue as async_queue_module

SIDE = "CREATE TABLE side (id int PRIMARY KEY, body text, job_id bigint, fence bigint)"


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive one test's coroutine on a fresh event loop."""
    return asyncio.run(coro)


async def until(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Await ``check()`` (sync or async) until truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(0.03)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def statuses(dsn: str) -> dict[str, int]:
    return dict(rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY status"))


def worker(handler: Any, dsn: str, **kwargs: Any) -> AsyncWorker:
    """An AsyncWorker on queue q with short intervals."""
    options: dict[str, Any] = {
        "queue": "q",
        "dsn": dsn,
        "lease": 2.0,
        "poll_interval": 0.1,
        "reap_interval": 0.2,
        "backoff": 0,
    }
    return AsyncWorker(handler, **(options | kwargs))


async def noop(job: AsyncJob) -> None:
    """Do nothing: the job completes at once."""


# -- AsyncQueue: Queue's methods, awaited ---------------------------------------------
def test_async_queue_has_every_queue_method_with_the_same_arguments() -> None:
    public = [n for n, f in vars(Queue).items() if callable(f) and not n.startswith("_")]
    assert {"enqueue", "claim", "complete_many", "prune", "retry_dead"} <= set(public)
    for name in public:
        sync, awaited = getattr(Queue, name), getattr(AsyncQueue, name)
        assert inspect.iscoroutinefunction(awaited) or name == "close", name
        ours = inspect.signature(awaited).parameters
        theirs = inspect.signature(sync).parameters
        assert list(ours) == list(theirs), name
        assert [p.default for p in ours.values()] == [p.default for p in theirs.values()], name


def test_async_queue_runs_a_job_through_its_life(queue: Queue, dsn: str) -> None:
    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            first = await q.enqueue({"n": 1}, queue="q", priority=1)
            rest = await q.enqueue_many([{"n": i} for i in range(2, 5)], queue="q")
            assert await q.enqueue({"k": 1}, queue="q", key="same") == await q.enqueue(
                {"k": 2}, queue="q", key="same"
            )
            a, b, c = await q.claim("q", limit=3, lease=5)
            assert isinstance(a, AsyncJob) and a.id == first and (b.id, c.id) == tuple(rest[:2])
            assert (a.fence, a.attempts, a.conn) == (1, 1, q.conn)
            assert await q.heartbeat(a, lease=10) and await q.heartbeat_many([b, c]) == []
            assert await q.complete(a) and a.status == "done"
            assert await q.fail(b, "boom", backoff=30) and b.status == "ready" and b.lost
            assert b.retry_in is not None and 50 < b.retry_in <= 60
            assert await q.release(c) and c.status == "ready"
            assert not await q.complete(b)  # failing raised the fence: stale now
            assert await q.cancel(rest[2]) and not await q.cancel(rest[2])
            state = await q.get(b.id)
            assert state is not None and (state.status, state.last_error, state.fence) == (
                "ready",
                "boom",
                2,
            )
            assert await q.get(10**9) is None
            [d] = await q.claim("q", lease=5)
            assert await q.complete_many([d]) == [] and d.status == "done"
            assert await q.fail((await q.claim("q"))[0], "x", give_up=True)
            stats = {(r["queue"], r["status"]): r["jobs"] for r in await q.stats()}
            assert stats[("q", "dead")] == 1 and stats[("q", "ready")] == 1
            assert await q.retry_dead("q") and await q.retry_dead(ids=[]) == []
            assert await q.prune() == 3  # two done, one cancelled
            assert await q.reap() == []

    run(main())
    assert statuses(dsn) == {"ready": 2}


def test_async_queue_reaps_and_retries_dead_like_queue(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q", max_attempts=1)

    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            [job] = await q.claim("q", lease=30)
            await q.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
            [reaped] = await q.reap()
            assert (reaped.id, reaped.status) == (job_id, "dead")
            assert await q.retry_dead(ids=[job_id, 999], extra=2) == [job_id]
            assert not await q.heartbeat(job) and job.lost

    run(main())
    assert rows(dsn, "SELECT status, max_attempts FROM jobs") == [("ready", 3)]


def test_async_enqueue_commits_and_rolls_back_with_the_callers_transaction(
    queue: Queue, dsn: str
) -> None:
    async def main() -> None:
        async with AsyncQueue(dsn) as q, await async_connect(dsn) as app:
            await app.execute("CREATE TABLE orders (id int PRIMARY KEY)")
            async with app.transaction():
                await app.execute("INSERT INTO orders VALUES (1)")
                await q.enqueue({"order": 1}, queue="q", conn=app)
                await q.enqueue_many([{"order": 1, "part": i} for i in range(3)], conn=app)
            with pytest.raises(RuntimeError):
                async with app.transaction():
                    await app.execute("INSERT INTO orders VALUES (2)")
                    await q.enqueue({"order": 2}, queue="q", conn=app)
                    await q.enqueue_many([{"order": 2}] * 3000, conn=app)  # COPY, same tx
                    raise RuntimeError("payment declined")

    run(main())
    assert rows(dsn, "SELECT count(*) FROM orders") == [(1,)]
    assert rows(dsn, "SELECT DISTINCT payload->>'order' FROM jobs") == [("1",)]
    assert statuses(dsn) == {"ready": 4}


def test_async_enqueue_many_writes_all_or_none_in_order_with_keys_and_copy(
    queue: Queue, dsn: str
) -> None:
    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            held = await q.enqueue({}, queue="k", key="b")
            ids = await q.enqueue_many(
                [{"n": i} for i in range(4)], queue="k", keys=["a", "b", "a", None]
            )
            assert ids[1] == held and ids[0] == ids[2] and len(set(ids)) == 3
            copied = await q.enqueue_many([{"n": i} for i in range(2500)], queue="c")
            assert copied == sorted(copied) and len(copied) == 2500
            with pytest.raises(BadInput, match="payload #2"):
                await q.enqueue_many([{}, {}, "nope"], queue="c")  # type: ignore[list-item]

    run(main())
    assert rows(dsn, "SELECT queue, count(*) FROM jobs GROUP BY 1 ORDER BY 1") == [
        ("c", 2500),
        ("k", 3),
    ]


@pytest.mark.parametrize(
    "call",
    [
        ("enqueue", ("not a dict",), {}),
        ("enqueue", ({},), {"queue": ""}),
        ("enqueue", ({},), {"delay": -1}),
        ("enqueue", ({},), {"max_attempts": 0}),
        ("enqueue", ({},), {"priority": 10**9}),
        ("enqueue", ({"x": float("nan")},), {}),
        ("enqueue", ({},), {"key": ""}),
        ("enqueue_many", ([{}],), {"keys": ["a", "b"]}),
        ("claim", ("q",), {"limit": 0}),
        ("claim", ("q",), {"lease": 0}),
        ("claim", (["q", "q"],), {}),
        ("cancel", (0,), {}),
        ("get", (True,), {}),
        ("retry_dead", ("q",), {"extra": 0}),
        ("retry_dead", (), {"ids": [-1]}),
        ("prune", (-5,), {}),
        ("prune", (), {"batch": 0}),
    ],
    ids=lambda c: f"{c[0]}-{c[2] or c[1]}",
)
def test_async_queue_refuses_bad_input_with_queues_own_message(
    queue: Queue, dsn: str, call: tuple[str, tuple[Any, ...], dict[str, Any]]
) -> None:
    name, args, kwargs = call
    with pytest.raises(BadInput) as sync_error:
        getattr(queue, name)(*args, **kwargs)

    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            with pytest.raises(BadInput) as async_error:
                await getattr(q, name)(*args, **kwargs)
            assert str(async_error.value) == str(sync_error.value)
            assert "\n" not in str(async_error.value)

    run(main())
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(0,)]


def test_async_queue_errors_are_one_line(dsn: str, empty_dsn: str) -> None:
    async def main() -> None:
        async with AsyncQueue(empty_dsn) as q:
            with pytest.raises(NotInstalled, match="pgqueue init"):
                await q.enqueue({})
            await q.install()
            await q.install(notify=False)  # idempotent
            assert await q.enqueue({}) == 1
        with pytest.raises(ConnectError, match="cannot connect") as bad:
            await AsyncQueue("host=/nonexistent-dir port=1 password=s3cret").open()
        assert "s3cret" not in str(bad.value)
        with pytest.raises(PgQueueError, match="not open"):
            await AsyncQueue(dsn).enqueue({})

    run(main())


def test_async_fenced_write_takes_a_newer_fence_and_refuses_a_stale_one(
    queue: Queue, dsn: str
) -> None:
    queue.conn.execute(SIDE)
    queue.enqueue({}, queue="q")

    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            [old] = await q.claim("q", lease=30)
            assert await old.fenced_write("side", {"id": 1}, {"body": "first"})
            assert await old.fenced_write("side", {"id": 1}, {"body": "again"})  # same claim
            await q.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
            await q.reap()
            [new] = await q.claim("q", lease=30)
            assert await new.fenced_write("side", {"id": 1}, {"body": "second"})
            assert not await old.fenced_write("side", {"id": 1}, {"body": "late"})
            assert old.lost and not await q.complete(old) and await q.complete(new)
            other = await q.enqueue({}, queue="other")
            [stranger] = await q.claim("other")
            assert stranger.id == other
            with pytest.raises(FenceConflict, match="written by job"):
                await stranger.fenced_write("side", {"id": 1}, {"body": "not mine"})

    run(main())
    assert rows(dsn, "SELECT body, fence FROM side") == [("second", 2)]


def test_async_fenced_write_checks_the_job_itself(queue: Queue, dsn: str) -> None:
    """As with Job: once the claim is over (here cancelled, no heartbeat in between), the
    holder's write is refused even where no newer holder has written, and it is lost."""
    queue.conn.execute(SIDE)
    job_id = queue.enqueue({}, queue="q")

    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            [job] = await q.claim("q", lease=30)
            assert await job.fenced_write("side", {"id": 1}, {"body": "in time"})
            assert await q.cancel(job_id)
            assert not job.lost
            assert not await job.fenced_write("side", {"id": 2}, {"body": "late, new row"})
            assert job.lost

    run(main())
    assert rows(dsn, "SELECT id, body FROM side") == [(1, "in time")]


def test_large_batches_are_planned_each_time_small_ones_stay_prepared_async(
    queue: Queue, dsn: str
) -> None:
    """The rule of the sync Queue, now the same code (#30): a prepared statement's generic
    plan cannot see an array's length, so batches over PREPARED_UP_TO ids are planned at
    each call (the AsyncWorker's arrays can run to thousands: 3.3 s with the generic plan,
    33 ms planned); small ones stay prepared. Before, the async face never prepared them."""
    from pgqueue.params import PREPARED_UP_TO

    big = PREPARED_UP_TO + 1
    queue.enqueue_many([{}] * (big * 3 + 10), queue="q")
    completions = "%SET status = 'done', lease_until = NULL, finished_at = now()%FROM unnest%"

    async def main() -> tuple[int, int]:
        async with AsyncQueue(dsn) as q:

            async def prepared() -> int:
                query = "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s"
                cur = await q.conn.execute(query, [completions])
                [(n,)] = await cur.fetchall()
                return int(n)

            for _ in range(3):
                jobs = await q.claim("q", limit=big)
                assert await q.heartbeat_many(jobs) == []
                assert await q.complete_many(jobs) == []
            after_big = await prepared()
            for _ in range(5):
                assert await q.complete_many(await q.claim("q", limit=2)) == []
            return after_big, await prepared()

    assert run(main()) == (0, 1)


# -- AsyncWorker: drain, failures, timeouts ---------------------------------------------
def test_async_workers_drain_a_queue_each_job_done_once_with_concurrency(
    queue: Queue, dsn: str
) -> None:
    total = 120
    events = EventLog()
    ran: list[tuple[int, int]] = []
    running = {"now": 0, "most": 0}

    async def handler(job: AsyncJob) -> None:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await asyncio.sleep(0.02)
        ran.append((job.id, job.fence))
        running["now"] -= 1

    async def main() -> list[AsyncWorker]:
        workers = [
            await worker(handler, dsn, name=f"w{i}", concurrency=10, batch=4, events=events).start()
            for i in range(2)
        ]
        # The jobs come once both have started: w0 must not drain them while w1 connects.
        queue.enqueue_many([{"n": i} for i in range(total)], queue="q")
        await until(lambda: statuses(dsn) == {"done": total}, what="all jobs done")
        for w in workers:
            await w.stop(grace=2)
        return workers

    workers = run(main())
    completes = events.events("complete")
    assert Counter(e.job_id for e in completes) == Counter(
        {job_id: 1 for (job_id,) in rows(dsn, "SELECT id FROM jobs")}
    )
    final_fence = dict(rows(dsn, "SELECT id, fence FROM jobs"))
    assert all(e.fence == final_fence[e.job_id] for e in completes)
    assert sorted(ran) == sorted(final_fence.items())  # each handler ran once
    assert sum(w.done for w in workers) == total and sum(w.rejected for w in workers) == 0
    assert running["most"] > 5  # handlers really ran at once on one loop
    assert {e.worker.split(".")[0] for e in completes} == {"w0", "w1"}


@pytest.mark.parametrize(
    "raised",
    [
        SystemExit(3),
        KeyboardInterrupt(),
        asyncio.CancelledError(),
        GeneratorExit(),
        ValueError("v"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_handler_raising_anything_fails_its_job_and_the_worker_goes_on(
    queue: Queue, dsn: str, raised: BaseException
) -> None:
    bad = queue.enqueue({"bad": True}, queue="q", max_attempts=1)
    queue.enqueue_many([{"n": i} for i in range(5)], queue="q")

    async def handler(job: AsyncJob) -> None:
        await asyncio.sleep(0)
        if job.payload.get("bad"):
            raise raised

    async def main() -> AsyncWorker:
        w = await worker(handler, dsn, concurrency=2, batch=3).start()
        await until(lambda: statuses(dsn) == {"dead": 1, "done": 5}, what="bad dead, rest done")
        await w.stop(grace=2)
        return w

    w = run(main())
    [(error,)] = rows(dsn, "SELECT last_error FROM jobs WHERE id = %s", [bad])
    assert error.startswith(type(raised).__name__), error
    assert (w.failed, w.dead, w.done) == (1, 1, 5) and w.in_flight == []


def test_give_up_retry_after_and_returned_awaitables(queue: Queue, dsn: str) -> None:
    give_up = queue.enqueue({"do": "give-up"}, queue="q")
    retry = queue.enqueue({"do": "retry"}, queue="q")
    mistake = queue.enqueue({"do": "return-coroutine"}, queue="q", max_attempts=1)

    async def later() -> None:
        raise AssertionError("never awaited")

    async def handler(job: AsyncJob) -> Any:
        if job.payload["do"] == "give-up":
            raise GiveUp("no point")
        if job.payload["do"] == "retry":
            raise RetryAfter(120, "rate limited")
        return later()  # forgot the await: an error, never a silent success

    async def main() -> None:
        w = await worker(handler, dsn).start()
        await until(lambda: w.failed == 3, what="three failures")
        await w.stop(grace=2)

    run(main())
    found = {
        i: (s, e, float(w))
        for i, s, e, w in rows(
            dsn, "SELECT id, status, last_error, extract(epoch FROM run_at - now()) FROM jobs"
        )
    }
    assert found[give_up][:2] == ("dead", "GiveUp: no point")
    assert found[retry][:2] == ("ready", "RetryAfter: rate limited") and found[retry][2] > 100
    assert found[mistake][0] == "dead" and "returned an awaitable" in found[mistake][1]


def test_plain_functions_are_refused_with_one_line(dsn: str) -> None:
    def plain(job: Any) -> None:
        pass

    with pytest.raises(BadInput, match="async def") as refused:
        AsyncWorker(plain, dsn=dsn)
    assert "\n" not in str(refused.value)
    with pytest.raises(BadInput, match="concurrency"):
        AsyncWorker(noop, dsn=dsn, concurrency=0)
    for bad in ({"lease": 0}, {"batch": 0}, {"connections": 0}, {"timeout": -1}):
        with pytest.raises(BadInput):
            AsyncWorker(noop, dsn=dsn, **bad)


@pytest.mark.parametrize("face", ["Worker", "AsyncWorker"])
def test_a_registry_may_mix_plain_and_async_tasks(queue: Queue, dsn: str, face: str) -> None:
    """One engine runs both kinds: a plain task on a lane thread (``job.conn`` of its own,
    never the loop's thread), an async task on the loop, under either face."""
    import threading

    from pgqueue import Worker

    tasks = Tasks(dsn)
    seen: dict[str, tuple[bool, bool]] = {}

    @tasks.task(queue="q")
    def plain_task(job: Any) -> None:
        on_loop = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            on_loop = False
        assert job.conn is not None
        job.conn.execute("SELECT 1")
        seen["plain"] = (on_loop, threading.current_thread().name.startswith("pgqueue-"))

    @tasks.task(queue="q")
    async def async_task(job: AsyncJob) -> None:
        await (await job.connection()).execute("SELECT 1")
        seen["async"] = (True, True)

    plain_task.enqueue()
    async_task.enqueue()
    tasks.close()
    if face == "Worker":
        w: Any = Worker(tasks, dsn=dsn, concurrency=2, poll_interval=0.05, burst=True)
        w.run(grace=2)
    else:
        w = AsyncWorker(tasks, dsn=dsn, concurrency=2, poll_interval=0.05, burst=True)
        run(w.run(grace=2))
    assert statuses(dsn) == {"done": 2} and w.done == 2 and w.failed == 0
    assert seen == {"plain": (False, True), "async": (True, True)}


def test_a_missing_table_fails_start(empty_dsn: str) -> None:
    async def main() -> None:
        with pytest.raises(NotInstalled, match="pgqueue init"):
            await AsyncWorker(noop, dsn=empty_dsn).start()

    run(main())


def test_a_hung_handler_is_cancelled_and_failed_at_its_timeout(queue: Queue, dsn: str) -> None:
    queue.conn.execute(SIDE)
    hung = queue.enqueue({"hang": True}, queue="q", max_attempts=1)
    late: dict[str, Any] = {}

    async def handler(job: AsyncJob) -> None:
        if not job.payload.get("hang"):
            return
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # a handler that insists on a last write
            late["write"] = await job.fenced_write("side", {"id": 1}, {"body": "late"})
            late["lost"] = job.lost
            raise

    async def main() -> AsyncWorker:
        w = await worker(handler, dsn, concurrency=1, timeout=0.5).start()
        await until(lambda: statuses(dsn).get("dead") == 1, what="the hung job to be failed")
        others = queue.enqueue_many([{"n": i} for i in range(4)], queue="q")
        await until(lambda: statuses(dsn) == {"dead": 1, "done": len(others)}, what="the rest")
        await until(lambda: "write" in late, what="the handler to unwind")
        await w.stop(grace=2)
        return w

    w = run(main())
    [(error, fence, attempts)] = rows(
        dsn, "SELECT last_error, fence, attempts FROM jobs WHERE id = %s", [hung]
    )
    assert error.startswith("TimeoutError") and "0.5 s timeout" in error
    assert fence > attempts  # failing raised the fence
    assert late == {"write": False, "lost": True}
    assert rows(dsn, "SELECT count(*) FROM side") == [(0,)]
    assert (w.timed_out, w.done, w.rejected) == (1, 4, 0)


def test_a_handler_that_ignores_its_cancellation_still_frees_its_slot_and_stop_is_bounded(
    queue: Queue, dsn: str
) -> None:
    """Past its timeout the job is failed and its slot given back at once, even though the
    handler swallows the cancellation and keeps running: with one slot, the next jobs run
    meanwhile, and a stop does not wait for the stubborn handler."""
    queue.enqueue({"hang": True}, queue="q", max_attempts=1)
    release = asyncio.Event()

    async def handler(job: AsyncJob) -> None:
        if not job.payload.get("hang"):
            return
        while not release.is_set():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                continue  # ignores every cancellation until the test releases it

    async def main() -> tuple[AsyncWorker, float]:
        w = await worker(handler, dsn, concurrency=1, timeout=0.3).start()
        await until(lambda: statuses(dsn).get("dead") == 1, what="the stubborn job to be failed")
        others = queue.enqueue_many([{"n": i} for i in range(3)], queue="q")
        await until(lambda: statuses(dsn) == {"dead": 1, "done": len(others)}, what="the rest")
        began = time.monotonic()
        await w.stop(grace=0.5)
        took = time.monotonic() - began
        release.set()  # let the stubborn handler end, so the loop closes cleanly
        await asyncio.sleep(0.05)
        return w, took

    w, took = run(main())
    assert (w.timed_out, w.done, w.failed) == (1, 3, 1)
    assert took < 10, f"stop took {took:.1f} s, waiting for a handler that ignores cancellation"


def test_a_task_registry_of_async_tasks_with_its_own_timeout(queue: Queue, dsn: str) -> None:
    tasks = Tasks(dsn)

    @tasks.task(queue="q", timeout=0.3, max_attempts=1)
    async def slow(job: AsyncJob, seconds: float) -> None:
        await asyncio.sleep(seconds)

    @tasks.task(queue="q")
    async def add(job: AsyncJob, a: int, b: int) -> None:
        await job.fenced_write("side", {"id": a + b}, {"body": "sum"})

    queue.conn.execute(SIDE)
    slow.enqueue(seconds=5)
    add.enqueue(a=1, b=2)
    tasks.close()

    async def main() -> AsyncWorker:
        w = await worker(tasks, dsn, queue=None, concurrency=2).start()
        await until(lambda: statuses(dsn) == {"dead": 1, "done": 1}, what="both tasks ended")
        await w.stop(grace=2)
        return w

    w = run(main())
    assert w.queues == ["q"] and w.timed_out == 1
    assert rows(dsn, "SELECT id, fence FROM side") == [(3, 1)]


# -- AsyncWorker: leases and fences ------------------------------------------------------
def test_a_stale_holder_is_refused_after_a_takeover(queue: Queue, dsn: str) -> None:
    queue.conn.execute(SIDE)
    job_id = queue.enqueue({}, queue="q")
    events = EventLog()
    go = asyncio.Event()

    async def slow(job: AsyncJob) -> None:
        await go.wait()
        await job.fenced_write("side", {"id": 1}, {"body": f"fence {job.fence}"})

    async def fast(job: AsyncJob) -> None:
        await job.fenced_write("side", {"id": 1}, {"body": f"fence {job.fence}"})

    async def main() -> tuple[AsyncWorker, AsyncWorker]:
        # A's heartbeats are far apart: the lease below runs out between two of them.
        a = await worker(slow, dsn, name="A", lease=30, reap_interval=60, events=events).start()
        await until(lambda: events.count("claim"), what="A's claim")
        queue.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
        b = await worker(fast, dsn, name="B", events=events).start()  # its reaper takes it
        await until(lambda: statuses(dsn) == {"done": 1}, what="B finishing the job")
        go.set()
        await until(lambda: events.count("complete-rejected"), what="A's late completion")
        await a.stop(grace=2)
        await b.stop(grace=2)
        return a, b

    a, b = run(main())
    assert rows(dsn, "SELECT status, fence, attempts FROM jobs") == [("done", 2, 2)]
    assert rows(dsn, "SELECT body, fence FROM side") == [("fence 2", 2)]
    by = {(e.worker, e.kind): e for e in events.events() if e.job_id == job_id}
    assert by["A", "fenced-write-rejected"].fence == 1 and by["B", "fenced-write"].fence == 2
    assert (a.done, a.rejected, b.done, b.rejected) == (0, 1, 1, 0)


def test_heartbeats_keep_a_long_job_past_its_lease(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    events = EventLog()
    lease = 0.8

    async def slow(job: AsyncJob) -> None:
        await asyncio.sleep(3 * lease)
        assert not job.lost

    async def main() -> None:
        a = await worker(slow, dsn, name="A", lease=lease, events=events).start()
        await until(lambda: events.count("claim"), what="A's claim")
        b = await worker(noop, dsn, name="B", lease=lease, events=events).start()
        await until(lambda: statuses(dsn) == {"done": 1}, what="the job done")
        await a.stop(grace=2)
        await b.stop(grace=2)

    run(main())
    assert rows(dsn, "SELECT fence, attempts FROM jobs") == [(1, 1)]
    assert [e.worker for e in events.events("complete")] == ["A"]
    assert events.count("heartbeat") >= 2 and events.count("reap") == 0


def test_a_job_whose_lease_ran_out_while_it_waited_is_not_run(queue: Queue, dsn: str) -> None:
    """A handler that blocks the loop freezes the whole worker, heartbeats too: the batch
    sibling's lease runs out on the worker's own clock, so it is skipped, not started."""
    queue.enqueue_many([{"n": 1}, {"n": 2}], queue="q")
    started: list[int] = []

    async def handler(job: AsyncJob) -> None:
        started.append(job.payload["n"])
        if job.payload["n"] == 1:
            time.sleep(1.3)  # wrong on purpose: blocks the event loop past the lease

    async def main() -> AsyncWorker:
        w = await worker(handler, dsn, lease=1.0, batch=2, reap_interval=100).start()
        await until(lambda: w.events.count("skipped"), what="the sibling to be skipped")
        await w.stop(grace=2)
        return w

    w = run(main())
    assert started == [1]
    assert w.events.count("skipped") == 1 and w.done == 1


def test_graceful_stop_releases_claimed_unstarted_jobs(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{"n": i} for i in range(3)], queue="q", max_attempts=5)
    handled: list[int] = []

    async def first_is_slow(job: AsyncJob) -> None:
        handled.append(job.id)
        await asyncio.sleep(0.8)

    async def main() -> AsyncWorker:
        w = await worker(first_is_slow, dsn, concurrency=1, batch=3).start()
        await until(lambda: handled, what="the first handler")
        await w.stop(grace=5)
        return w

    w = run(main())
    assert len(handled) == 1
    assert rows(dsn, "SELECT status FROM jobs WHERE id = %s", [handled[0]]) == [("done",)]
    released = rows(dsn, "SELECT status, attempts, fence FROM jobs WHERE id <> %s", [handled[0]])
    assert released == [("ready", 0, 1)] * 2  # attempt given back; the fence stays risen
    assert w.events.count("release") == 2 and w.in_flight == []


def test_stop_after_the_grace_leaves_running_jobs_to_their_lease(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")
    cancelled = asyncio.Event()

    async def forever(job: AsyncJob) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    async def main() -> None:
        w = await worker(forever, dsn).start()
        await until(lambda: w.in_flight, what="the claim")
        began = time.monotonic()
        await w.stop(grace=0.3)
        assert time.monotonic() - began < 2 and cancelled.is_set()

    run(main())
    assert rows(dsn, "SELECT status, fence FROM jobs") == [("running", 1)]  # the reaper's now


def test_two_stops_at_once_end_the_worker_once(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{"n": i} for i in range(3)], queue="q")

    async def slow(job: AsyncJob) -> None:
        await asyncio.sleep(0.3)

    async def main() -> AsyncWorker:
        w = await worker(slow, dsn, concurrency=3, batch=3).start()
        await until(lambda: len(w.in_flight) == 3, what="three claims")
        await asyncio.gather(w.stop(grace=5), w.stop(grace=0))  # a notebook and run(), say
        await w.stop()  # and once more: nothing left to do
        return w

    w = run(main())
    assert w.done == 3 and statuses(dsn) == {"done": 3}


# -- AsyncWorker: connections, completion, LISTEN, signals ---------------------------------
def _sessions(dsn: str, name: str) -> Counter[str]:
    return Counter(
        state
        for (state,) in rows(
            dsn,
            "SELECT state FROM pg_stat_activity WHERE application_name = %s "
            "AND datname = current_database()",
            [f"pgqueue worker {name}"],
        )
    )


def test_handlers_borrow_at_most_connections_and_never_sit_in_a_transaction(
    queue: Queue, dsn: str
) -> None:
    queue.conn.execute("CREATE TABLE side (note text)")
    queue.enqueue_many([{"kind": "fine"} for _ in range(40)], queue="q")
    most: list[int] = []

    async def handler(job: AsyncJob) -> None:
        conn = await job.connection()
        kind = job.payload["kind"]
        if kind == "left-open":
            await conn.execute("BEGIN")
            await conn.execute("INSERT INTO side VALUES ('never committed')")
        elif kind == "aborted":
            await conn.execute("BEGIN")
            await conn.execute("SELECT 1/0")
        elif kind == "closed":
            await conn.close()
            raise RuntimeError("closed my own connection")
        else:
            await conn.execute("SELECT 1")
            await asyncio.sleep(0.1)  # holding its connection, outside any transaction

    async def main() -> None:
        w = worker(handler, dsn, name="pool", concurrency=20, batch=10, connections=4)
        await w.start()
        while statuses(dsn) != {"done": 40}:
            seen = _sessions(dsn, "pool")
            assert seen["idle in transaction"] == 0, seen
            most.append(sum(seen.values()))
            await asyncio.sleep(0.02)
        for kind in ("left-open", "aborted", "closed"):  # handlers that misbehave
            queue.enqueue({"kind": kind}, queue="q", max_attempts=1)
        await until(lambda: statuses(dsn) == {"done": 40, "dead": 3}, what="3 dead")
        assert not {k for k in _sessions(dsn, "pool") if k.startswith("idle in transaction")}
        await w.stop(grace=2)

    run(main())
    errors = dict(rows(dsn, "SELECT payload->>'kind', last_error FROM jobs WHERE status='dead'"))
    assert "left a transaction open" in errors["left-open"], errors
    assert errors["aborted"].startswith("DivisionByZero"), errors
    assert errors["closed"].startswith("RuntimeError"), errors
    assert rows(dsn, "SELECT count(*) FROM side") == [(0,)]
    # claims, writes, keeper, listener, and at most 4 lent to the 20 handlers at once (an
    # upper bound only: how many a sample catches at once depends on timing)
    assert 1 <= max(most) <= 4 + 4, most


def test_completions_go_in_one_statement_per_batch(
    queue: Queue, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each claimed batch's completions go out together, in one statement, once the batch is
    over. Not a count of statements: how many claims a run makes depends on timing (an
    async worker claims whatever fits; `<= 4` statements failed at 5 under load)."""
    queue.enqueue_many([{"n": i} for i in range(20)], queue="q")
    claimed: list[set[int]] = []  # each claim's job ids
    completed: list[set[int]] = []  # each complete_many statement's
    real_claim, real_complete_many = AsyncQueue.claim, AsyncQueue.complete_many

    async def claim(self: AsyncQueue, *args: Any, **kwargs: Any) -> list[AsyncJob]:
        jobs = await real_claim(self, *args, **kwargs)
        if jobs:
            claimed.append({job.id for job in jobs})
        return jobs

    async def complete_many(self: AsyncQueue, jobs: Any, *args: Any, **kwargs: Any) -> Any:
        completed.append({job.id for job in jobs})
        return await real_complete_many(self, jobs, *args, **kwargs)

    monkeypatch.setattr(AsyncQueue, "claim", claim)
    monkeypatch.setattr(AsyncQueue, "complete_many", complete_many)

    async def main() -> AsyncWorker:
        # flush_after=60: only a batch's end sends completions (the timed flush, which
        # takes whatever waited, never comes within the run)
        w = worker(noop, dsn, concurrency=5, batch=5, burst=True, flush_after=60)
        await w.start()
        await w.join(timeout=20)
        await w.stop(grace=2)
        return w

    w = run(main())
    assert statuses(dsn) == {"done": 20} and w.done == 20
    assert sorted(i for ids in completed for i in ids) == sorted(i for ids in claimed for i in ids)
    for batch in claimed:  # one statement holds the whole batch: it was never split
        holding = [ids for ids in completed if ids & batch]
        assert len(holding) == 1 and batch <= holding[0], (batch, completed)


def test_a_fast_job_is_not_held_behind_a_slow_sibling(queue: Queue, dsn: str) -> None:
    fast, slow = queue.enqueue_many([{"fast": True}, {"fast": False}], queue="q")
    go = asyncio.Event()

    async def handler(job: AsyncJob) -> None:
        if not job.payload["fast"]:
            await asyncio.wait_for(go.wait(), 30)  # the slow sibling runs until let go

    def status(job_id: int) -> str:
        return rows(dsn, "SELECT status FROM jobs WHERE id = %s", [job_id])[0][0]

    async def main() -> None:
        w = await worker(handler, dsn, concurrency=2, batch=2, flush_after=0.05).start()
        # Flushed by age, not at the batch's end: done while its sibling still runs.
        await until(lambda: status(fast) == "done", what="the fast job's completion")
        assert status(slow) == "running"
        go.set()
        await w.stop(grace=5)

    run(main())
    assert statuses(dsn) == {"done": 2}


def test_per_job_completion_when_asked(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{"n": i} for i in range(6)], queue="q")

    async def main() -> None:
        w = await worker(noop, dsn, batch=6, burst=True, complete_in_batches=False).start()
        await w.join(timeout=20)
        await w.stop()

    run(main())
    assert rows(dsn, "SELECT count(DISTINCT xmin::text) FROM jobs") == [(6,)]


def test_a_completion_whose_reply_was_lost_is_counted_done(
    queue: Queue, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = AsyncQueue.complete_many
    calls: list[int] = []

    async def complete_then_lose_reply(self: AsyncQueue, jobs: Any, results: Any = None) -> Any:
        took = await real(self, jobs, results)
        calls.append(1)
        if len(calls) == 1:
            await self.conn.close()  # the commit happened; the caller never hears of it
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return took

    monkeypatch.setattr(async_queue_module.AsyncQueue, "complete_many", complete_then_lose_reply)
    queue.enqueue({}, queue="q")

    async def main() -> AsyncWorker:
        w = await worker(noop, dsn).start()
        await until(lambda: w.done == 1, what="the job to count as done")
        await w.stop()
        return w

    w = run(main())
    assert (w.rejected, w.gave_up, statuses(dsn)) == (0, 0, {"done": 1})


def test_listen_wakes_an_idle_worker_long_before_its_poll(queue: Queue, dsn: str) -> None:
    poll = 30.0

    async def main() -> None:
        w = await worker(noop, dsn, name="L", poll_interval=poll).start()
        await until(lambda: _sessions(dsn, "L")["idle"] >= 2, what="the LISTEN session")
        await asyncio.sleep(0.5)
        await until(
            lambda: rows(
                dsn,
                "SELECT 1 FROM pg_stat_activity WHERE query = 'LISTEN pgqueue' "
                "AND datname = current_database()",
            ),
            what="LISTEN",
        )
        queue.enqueue({}, queue="q")
        enqueued = time.monotonic()
        await until(lambda: w.done == 1, timeout=poll / 2, what="a woken worker")
        assert time.monotonic() - enqueued < poll / 3  # woken by NOTIFY, not by the poll
        await w.stop()

    run(main())


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)
def test_run_restores_signal_handlers_and_a_second_signal_forces_the_stop(
    queue: Queue, dsn: str
) -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    queue.enqueue({}, queue="q")
    started = asyncio.Event()

    async def handler(job: AsyncJob) -> None:
        started.set()
        await asyncio.sleep(30)

    async def main() -> float:
        w = AsyncWorker(handler, queue="q", dsn=dsn, poll_interval=0.1, lease=5)

        async def interrupt_twice() -> None:
            await started.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)

        poke = asyncio.create_task(interrupt_twice())
        began = time.monotonic()
        await w.run(grace=20)
        await poke
        return time.monotonic() - began

    try:
        assert run(main()) < 10  # the second signal did not wait out the grace period
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_burst_worker_ends_when_the_queue_is_dry(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{"n": i} for i in range(10)], queue="q")
    queue.enqueue({}, queue="q", delay=3600)  # not runnable: burst does not wait for it

    async def main() -> None:
        await worker(noop, dsn, burst=True, concurrency=3, batch=2, poll_interval=30).run()

    run(asyncio.wait_for(main(), 30))
    assert statuses(dsn) == {"done": 10, "ready": 1}
