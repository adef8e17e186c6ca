"""The course's helpers: counterfactual claims misbehave as taught, timelines draw lanes."""

from __future__ import annotations

import threading
from collections import Counter

import matplotlib
import psycopg
import pytest

from conftest import rows
from pgqueue import EventLog, Queue, Worker
from pgqueue.course import lab, plot
from pgqueue.course.faults import FaultyWorker

matplotlib.use("Agg")


def _claims(log: EventLog) -> Counter[int]:
    return Counter(e.job_id for e in log.events("claim"))


def test_claim_without_lock_hands_one_job_to_two_workers(queue: Queue, dsn: str) -> None:
    queue.enqueue({"n": 1}, queue="cf")
    got: list[list[int]] = []
    barrier = threading.Barrier(2)

    def grab() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait()
            got.append([j.id for j in lab.claim_without_lock(conn, "cf", window=0.3)])

    threads = [threading.Thread(target=grab) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] and len(got[0]) == 1  # the same job, twice
    assert rows(dsn, "SELECT fence FROM jobs") == [(2,)]


def test_claim_without_skip_locked_returns_the_claimed_jobs(queue: Queue) -> None:
    ids = queue.enqueue_many([{"n": i} for i in range(3)], queue="cf")
    jobs = lab.claim_without_skip_locked(queue.conn, "cf", limit=2, hold=0)
    assert len(jobs) == 2 and {j.id for j in jobs} <= set(ids)
    assert all(j.fence == 1 for j in jobs)


@pytest.mark.parametrize(("style", "duplicates"), [("skip-locked", False), ("no-lock", True)])
def test_race_shows_duplicates_only_without_locks(
    queue: Queue, dsn: str, style: str, duplicates: bool
) -> None:
    queue.enqueue_many([{"n": i} for i in range(8)], queue="race")
    log = lab.race(dsn, style, workers=3, hold=0.05, work=0.0)
    claims = _claims(log)
    assert set(claims) == {j for (j,) in rows(dsn, "SELECT id FROM jobs")}
    assert (max(claims.values()) > 1) is duplicates
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE status <> 'done'") == [(0,)]


def test_complete_ignoring_fence_lets_a_stale_holder_through(queue: Queue) -> None:
    queue.enqueue({"n": 1}, queue="cf")
    [stale] = queue.claim("cf", lease=0.1)
    queue.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
    queue.reap()
    [fresh] = queue.claim("cf")
    assert not queue.complete(stale)  # the real statement refuses
    assert lab.complete_ignoring_fence(queue.conn, stale)  # the counterfactual does not
    assert fresh.fence == 2


def test_scratch_database_is_gone_afterwards(admin_dsn: str) -> None:
    with lab.scratch_database("pgqueue_scratch_test", admin_dsn) as target, Queue(target) as q:
        q.enqueue({"n": 1})
    names = rows(
        admin_dsn, "SELECT datname FROM pg_database WHERE datname = 'pgqueue_scratch_test'"
    )
    assert names == []


def test_timeline_draws_a_lane_per_worker_and_marks_rejected_writes(queue: Queue, dsn: str) -> None:
    queue.enqueue({"n": 1}, queue="tl")
    log = EventLog()
    common = dict(queue="tl", dsn=dsn, lease=0.5, poll_interval=0.05, reap_interval=0.1)
    a = FaultyWorker(lambda job: None, name="A", events=log, **common)  # type: ignore[arg-type]
    a.pause_on_next_claim(1.2)
    a.start()
    lab.wait_for(log, "claim", timeout=10)
    b = Worker(lambda job: None, name="B", events=log, **common).start()  # type: ignore[arg-type]
    lab.wait_for(log, "complete-rejected", timeout=15)
    a.stop(grace=1)
    b.stop(grace=1)
    fig = plot.timeline(log, lease=0.5)
    [ax] = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:2] == ["A", "B"] or sorted(labels) == ["A", "B"]
    assert ax.get_xlabel() and ax.get_title()
    assert ax.get_legend() is not None
