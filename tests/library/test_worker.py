"""``Worker`` with real threads on a real PostgreSQL: draining, failures, heartbeats, the
seed's paused-worker story, crashes, LISTEN/NOTIFY, graceful stop, and never an
idle-in-transaction session while a handler runs."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from conftest import rows, wait_for
from pgqueue import BadInput, EventLog, Job, NotInstalled, Queue, Worker
from pgqueue.course.faults import FaultyWorker

MakeWorker = Callable[..., Worker]


def statuses(dsn: str) -> dict[str, int]:
    """Job counts by status."""
    return dict(rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY status"))


def all_done(dsn: str, total: int) -> Callable[[], bool]:
    """A check that every one of ``total`` jobs is done."""
    return lambda: statuses(dsn) == {"done": total}


@pytest.fixture
def make_worker(dsn: str) -> Iterator[MakeWorker]:
    """Build workers on this test's database with short intervals; stop them all after."""
    made: list[Worker] = []

    def make(handler: Callable[[Job], Any], *, faulty: bool = False, **kwargs: Any) -> Worker:
        options: dict[str, Any] = {
            "queue": "q",
            "dsn": dsn,
            "lease": 2.0,
            "poll_interval": 0.1,
            "reap_interval": 0.2,
        }
        worker = (FaultyWorker if faulty else Worker)(handler, **(options | kwargs))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop(grace=2)


def noop(job: Job) -> None:
    """Do nothing: the job completes at once."""


def test_workers_drain_a_queue_each_job_done_once_by_its_last_fence_holder(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    total = 60
    queue.enqueue_many([{"n": i} for i in range(total)], queue="q")
    events = EventLog()
    ran: list[tuple[int, int]] = []
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            ran.append((job.id, job.fence))

    workers = [
        make_worker(handler, name=f"w{i}", concurrency=2, batch=3, events=events).start()
        for i in range(3)
    ]
    wait_for(all_done(dsn, total), what="all jobs done")
    for worker in workers:
        worker.stop(grace=2)
    completes = events.events("complete")
    assert Counter(e.job_id for e in completes) == Counter(
        {job_id: 1 for (job_id,) in rows(dsn, "SELECT id FROM jobs")}
    )
    final_fence = dict(rows(dsn, "SELECT id, fence FROM jobs"))
    assert all(e.fence == final_fence[e.job_id] for e in completes)
    assert sorted(ran) == sorted(final_fence.items())  # each handler ran once, no retries
    assert sum(w.done for w in workers) == total
    assert sum(w.rejected for w in workers) == 0
    assert len({e.worker for e in completes}) >= 2  # the threads really competed
    frame = events.to_frame()
    assert {"t", "s", "kind", "worker", "job_id", "fence", "detail"} <= set(frame.columns)
    assert (frame["s"] >= 0).all()


def test_handler_exception_becomes_fail_with_error_and_backoff(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    retried = queue.enqueue({"n": 1}, queue="q", max_attempts=3)
    doomed = queue.enqueue({"n": 2}, queue="q", max_attempts=1)

    def handler(job: Job) -> None:
        raise ValueError(f"bad input {job.payload['n']}")

    worker = make_worker(handler, backoff=10.0).start()
    wait_for(lambda: worker.events.count("fail") == 2, what="two failures")
    worker.stop(grace=2)
    [(status, error, wait)] = rows(
        dsn,
        "SELECT status, last_error, extract(epoch FROM run_at - now()) FROM jobs WHERE id = %s",
        [retried],
    )
    assert (status, error) == ("ready", "ValueError: bad input 1")
    assert 15 < float(wait) <= 20  # backoff * 2^attempts = 10 * 2^1
    assert rows(dsn, "SELECT status, last_error FROM jobs WHERE id = %s", [doomed]) == [
        ("dead", "ValueError: bad input 2")
    ]
    assert worker.done == 0


def test_heartbeats_keep_a_long_job_past_its_lease(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    job_id = queue.enqueue({}, queue="q")
    events = EventLog()
    lease = 0.8  # heartbeats every ~0.27 s keep it; B's reaper runs every 0.2 s

    def slow(job: Job) -> None:
        time.sleep(3 * lease)
        assert not job.lost

    a = make_worker(slow, name="A", lease=lease, events=events).start()
    wait_for(lambda: events.count("claim"), what="A's claim")
    b = make_worker(noop, name="B", lease=lease, events=events).start()
    wait_for(lambda: rows(dsn, "SELECT status FROM jobs") == [("done",)], what="job done")
    a.stop(grace=2)
    b.stop(grace=2)
    assert rows(dsn, "SELECT fence, attempts FROM jobs") == [(1, 1)]
    assert [(e.worker, e.job_id) for e in events.events("claim")] == [("A", job_id)]
    assert [e.worker for e in events.events("complete")] == ["A"]
    assert events.count("heartbeat") >= 2
    assert events.count("lease-lost") == 0 and events.count("reap") == 0


def test_paused_worker_replays_the_seed_story(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE reports (id int PRIMARY KEY, body text, job_id bigint, fence bigint)"
        )
    job_id = queue.enqueue({"report": 1}, queue="q")
    events = EventLog()

    def write_report(job: Job) -> None:
        job.fenced_write("reports", {"id": 1}, {"body": f"fence {job.fence}"})

    lease = 0.5
    a = make_worker(write_report, name="A", lease=lease, events=events, faulty=True)
    a.pause_on_next_claim(3.0)  # long enough for B to reap, claim and finish
    a.start()
    wait_for(lambda: rows(dsn, "SELECT fence FROM jobs") == [(1,)], what="A's claim")
    b = make_worker(write_report, name="B", lease=lease, events=events).start()
    wait_for(lambda: rows(dsn, "SELECT status FROM jobs") == [("done",)], what="B's completion")
    wait_for(lambda: events.count("complete-rejected"), what="A's late completion")
    a.stop(grace=2)
    b.stop(grace=2)

    assert rows(dsn, "SELECT status, fence, attempts FROM jobs") == [("done", 2, 2)]
    assert rows(dsn, "SELECT body, fence FROM reports") == [("fence 2", 2)]
    by = {(e.worker, e.kind): e for e in events.events() if e.job_id == job_id}
    assert by["A", "claim"].fence == 1 and by["B", "claim"].fence == 2
    assert by["B", "fenced-write"].fence == 2 and by["B", "complete"].fence == 2
    assert by["A", "fenced-write-rejected"].fence == 1
    assert by["A", "complete-rejected"].fence == 1
    assert ("A", "complete") not in by and ("A", "fenced-write") not in by
    assert by["A", "complete-rejected"].t > by["B", "complete"].t
    assert events.count("pause") == 1 and events.count("reap") >= 1
    assert (a.done, a.rejected, b.done, b.rejected) == (0, 1, 1, 0)


def test_a_lost_heartbeat_tells_the_handler_and_its_result_is_discarded(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    job_id = queue.enqueue({}, queue="q")
    noticed = threading.Event()

    def long_job(job: Job) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if job.lost:
                noticed.set()
            job.raise_if_lost()  # the check a long handler makes between steps
            time.sleep(0.05)

    worker = make_worker(long_job, name="W", lease=0.6, reap_interval=60.0).start()
    wait_for(lambda: worker.events.count("heartbeat"), what="a first heartbeat")
    # Someone else takes the job over, as a reaper and a second worker would; in one
    # transaction, so the worker's next heartbeat waits for it and then finds fence 2.
    with queue.conn.transaction():
        queue.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
        assert [r.id for r in queue.reap()] == [job_id]
        [thief] = queue.claim("q", lease=60)
    wait_for(lambda: worker.events.count("fail-rejected"), what="the discarded result")
    assert noticed.is_set()
    [lost] = worker.events.events("lease-lost")
    assert (lost.job_id, lost.fence) == (job_id, 1)
    assert worker.events.count("fail") == 0  # nothing the stale holder wrote took effect
    # The job's last error is the reaper's note, not the stale holder's failure.
    [(status, fence, error)] = rows(dsn, "SELECT status, fence, last_error FROM jobs")
    assert (status, fence) == ("running", 2) and error.startswith("lease ran out on attempt 1")
    assert queue.complete(thief)


def test_a_batched_job_lost_before_its_turn_is_not_run(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}], queue="q")
    ran: list[int] = []
    release = threading.Event()

    def handler(job: Job) -> None:
        ran.append(job.id)
        release.wait(20)  # the first job runs while the second waits its turn

    worker = make_worker(handler, name="W", batch=2, lease=0.6, reap_interval=60.0).start()
    wait_for(lambda: ran, what="the first job to start")
    assert ran == [first]
    # Another worker takes the waiting job over (its lease ran out, the reaper returned it).
    with queue.conn.transaction():
        queue.conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 s' WHERE id = %s", [second]
        )
        assert [r.id for r in queue.reap()] == [second]
        [thief] = queue.claim("q", lease=60)
    wait_for(lambda: worker.events.count("lease-lost"), what="the heartbeat to notice")
    release.set()
    wait_for(lambda: worker.events.count("skipped"), what="the lost job to be skipped")
    # The first job's completion goes out at the batch's end, after the skip: wait for it.
    wait_for(lambda: worker.events.count("complete"), what="the first job's completion")
    assert ran == [first]  # the second job was not run a second time
    assert worker.events.count("complete") == 1
    assert rows(dsn, "SELECT id, status, fence FROM jobs ORDER BY id") == [
        (first, "done", 1),
        (second, "running", 2),
    ]
    assert queue.complete(thief)


def test_crashed_worker_job_comes_back_via_the_reaper(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    job_id = queue.enqueue({}, queue="q")
    events = EventLog()
    a = make_worker(noop, name="A", lease=0.5, events=events, faulty=True)
    a.crash_on_next_claim()
    a.start()
    wait_for(lambda: events.count("crash"), what="A's crash")
    assert rows(dsn, "SELECT status, fence FROM jobs") == [("running", 1)]
    b = make_worker(noop, name="B", lease=0.5, events=events).start()
    wait_for(lambda: rows(dsn, "SELECT status FROM jobs") == [("done",)], what="B finishing it")
    b.stop(grace=2)
    assert rows(dsn, "SELECT fence, attempts FROM jobs") == [(2, 2)]
    assert [(e.worker, e.fence) for e in events.events("complete")] == [("B", 2)]
    assert [e.job_id for e in events.events("reap")] == [job_id]
    assert a.done == 0


def _listening(dsn: str, name: str) -> bool:
    """Whether worker ``name`` has a session that issued LISTEN on this database."""
    return bool(
        rows(
            dsn,
            "SELECT 1 FROM pg_stat_activity WHERE application_name = %s "
            "AND query = 'LISTEN pgqueue' AND datname = current_database()",
            [f"pgqueue worker {name}"],
        )
    )


def test_listen_wakes_an_idle_worker_long_before_its_poll(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    poll = 30.0
    worker = make_worker(noop, name="L", poll_interval=poll).start()
    wait_for(lambda: _listening(dsn, "L"), what="the LISTEN session")
    time.sleep(0.5)  # let the job thread go idle (its first claims found nothing)
    assert worker.events.count("claim") == 0
    queue.enqueue({}, queue="q")
    enqueued = time.monotonic()
    wait_for(lambda: worker.events.count("complete"), timeout=poll / 2, what="a woken worker")
    assert time.monotonic() - enqueued < poll / 3  # woken by NOTIFY, not by the poll


def test_listen_ignores_other_queues_and_polling_still_finds_jobs(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    worker = make_worker(noop, name="P", listen=False, poll_interval=0.3).start()
    queue.enqueue({}, queue="q")
    wait_for(lambda: worker.done == 1, what="a polled job")
    assert not _listening(dsn, "P")
    # a job for another queue is left alone
    queue.enqueue({}, queue="elsewhere")
    time.sleep(0.6)
    assert rows(dsn, "SELECT status FROM jobs WHERE queue = 'elsewhere'") == [("ready",)]


def test_graceful_stop_releases_claimed_unstarted_jobs(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue_many([{"n": i} for i in range(3)], queue="q", max_attempts=5)
    started = threading.Event()
    handled: list[int] = []

    def first_is_slow(job: Job) -> None:
        handled.append(job.id)
        started.set()
        time.sleep(0.8)

    worker = make_worker(first_is_slow, batch=3).start()
    assert started.wait(10)
    worker.stop(grace=5)
    assert len(handled) == 1
    [(first_status,)] = rows(dsn, "SELECT status FROM jobs WHERE id = %s", [handled[0]])
    assert first_status == "done"  # the running one finished within the grace period
    released = rows(
        dsn,
        "SELECT status, attempts, max_attempts - attempts, fence FROM jobs WHERE id <> %s",
        [handled[0]],
    )
    assert released == [("ready", 0, 5, 1)] * 2  # attempt given back; the fence stays risen
    assert worker.events.count("release") == 2
    assert worker.in_flight == []


def test_complete_in_batches_uses_at_most_one_statement_per_batch(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue_many([{"n": i} for i in range(20)], queue="q")
    # flush_after=60: only a batch's end sends completions (not the timed flush)
    worker = make_worker(noop, batch=5, complete_in_batches=True, flush_after=60).start()
    wait_for(all_done(dsn, 20), what="all jobs done")
    worker.stop(grace=2)
    # Rows completed by one statement share its transaction id. A batch's completions go
    # out together, with those of any batch that ended while a statement was in flight.
    [(statements,)] = rows(dsn, "SELECT count(DISTINCT xmin::text) FROM jobs")
    assert 1 <= statements <= 4
    assert worker.events.count("complete") == 20 and worker.done == 20
    # Each batch's claims, and each flush's completions, are recorded together.
    assert len({e.t for e in worker.events.events("claim")}) == 4
    assert len({e.t for e in worker.events.events("complete")}) == statements


def test_record_many_adds_events_in_order_with_one_time() -> None:
    log = EventLog()
    log.record("pause", "w")
    log.record_many([("claim", "w.0", 1, 1, "1"), ("claim", "w.0", 2, 3, "3")])
    log.record_many([])
    pause, *claims = log.events()
    assert [(e.kind, e.job_id, e.fence, e.detail) for e in claims] == [
        ("claim", 1, 1, "1"),
        ("claim", 2, 3, "3"),
    ]
    assert pause.t <= claims[0].t == claims[1].t
    assert len(log) == 3


def test_burst_worker_exits_when_the_queue_is_empty(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue_many([{"n": i} for i in range(10)], queue="q")
    queue.enqueue({}, queue="q", delay=3600)  # not runnable: burst does not wait for it
    worker = make_worker(noop, burst=True, concurrency=2, batch=2, poll_interval=30.0).start()
    worker.join(timeout=20)
    assert not worker._working()
    worker.stop(grace=2)
    assert statuses(dsn) == {"done": 10, "ready": 1}


def test_no_worker_session_is_idle_in_transaction_while_handlers_run(
    queue: Queue, dsn: str, make_worker: MakeWorker
) -> None:
    queue.enqueue_many([{"n": i} for i in range(4)], queue="q")
    running = threading.Event()

    def slow(job: Job) -> None:
        running.set()
        time.sleep(1.5)

    make_worker(slow, name="tx", concurrency=2, batch=2, lease=0.6, reap_interval=0.2).start()
    assert running.wait(10)
    seen: Counter[str] = Counter()
    with psycopg.connect(dsn, autocommit=True) as watch:
        for _ in range(25):
            for (state,) in watch.execute(
                "SELECT state FROM pg_stat_activity "
                "WHERE application_name LIKE 'pgqueue worker%' AND datname = current_database()"
            ).fetchall():
                seen[state] += 1
            time.sleep(0.05)
    assert seen["idle"] > 0  # the worker's sessions are there, and visible
    assert seen["idle in transaction"] == 0, seen
    assert seen["idle in transaction (aborted)"] == 0, seen


def test_bad_worker_arguments_are_refused(dsn: str, empty_dsn: str) -> None:
    for kwargs in ({"concurrency": 0}, {"batch": -1}, {"lease": 0}, {"poll_interval": -1}):
        with pytest.raises(BadInput):
            Worker(noop, dsn=dsn, **kwargs)
    with pytest.raises(NotInstalled, match="pgqueue init"):
        Worker(noop, dsn=empty_dsn).start()
