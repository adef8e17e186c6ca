"""``pgqueue.monitor`` on a real PostgreSQL with real worker threads: what each look saw
(running jobs with their fences and leases, counts that add up while jobs are enqueued and
finished), the ways it stops (time, a worker done, a condition, an interrupt), the figure it
leaves, the cheap statements it reads with, and one-line errors for bad arguments."""

from __future__ import annotations

import asyncio
import importlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import pgqueue
from conftest import rows, wait_for
from pgqueue import BadInput, Job, NotInstalled, Queue, Worker
from pgqueue.monitor import ALT, Counts, Monitor, Snapshot, _sql

# The module (pgqueue.monitor, the attribute, is the function of the same name).
module = importlib.import_module("pgqueue.monitor")


def looked(watch: Monitor, test: Callable[[Snapshot], bool]) -> Callable[[], Snapshot | None]:
    """A check for ``wait_for``: the first look of ``watch`` that passes ``test``."""
    return lambda: next((s for s in list(watch.snapshots) if test(s)), None)


def monitor_sessions(dsn: str) -> int:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
    return rows(dsn, query, [dbname, "pgqueue monitor"])[0][0]


def test_it_sees_the_running_jobs_with_their_fences_and_the_counts_add_up(dsn: str) -> None:
    release = threading.Event()

    def hold(job: Job) -> None:
        release.wait(10)

    workers = [
        Worker(hold, queue="race", dsn=dsn, name=f"w{i}", lease=5, poll_interval=0.05)
        for i in range(3)
    ]
    with Queue(dsn) as q, Monitor(q, "race", every=0.05, until="drained", show=False) as watch:
        for worker in workers:
            worker.start()
        first = q.enqueue_many([{"n": n} for n in range(3)], queue="race")
        busy = wait_for(looked(watch, lambda s: len(s.leases) == 3), what="3 running jobs")
        more = q.enqueue_many([{"n": n} for n in range(3, 20)], queue="race")  # while they run
        release.set()
        watch.wait(timeout=15)  # until the queue had jobs and has none ready or running
    for worker in workers:
        worker.stop()

    # Three workers side by side: three different jobs, each under fence 1, leases running.
    assert sorted(lease.id for lease in busy.leases) == first
    assert busy.queues["race"].running == 3 and busy.total.ready == 0
    assert all(lease.fence == 1 and lease.attempt == 1 for lease in busy.leases)
    assert all(0 < lease.left <= 5 and lease.queue == "race" for lease in busy.leases)
    # Every running job it saw, with the fence the table holds for it now.
    stored = dict(rows(dsn, "SELECT id, fence FROM jobs"))
    assert watch.fences and all(fences == {stored[i]} for i, fences in watch.fences.items())
    # The first look saw an empty queue, so every one of the 20 finished while it watched,
    # the 17 enqueued meanwhile included: nothing counted twice, nothing missed.
    assert watch.snapshots[0].total == Counts()
    assert watch.done == len(first) + len(more) == 20
    assert [s.t for s in watch.snapshots] == sorted(s.t for s in watch.snapshots)
    assert watch.stopped_by == "until" and monitor_sessions(dsn) == 0
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'done'") == [(20,)]
    frame = watch.frame()
    assert frame["finished"].sum() == 20 and set(frame["queue"]) == {"race"}


def test_a_lease_that_ran_out_then_the_next_claim_shows_a_new_fence(dsn: str) -> None:
    with Queue(dsn) as q, Monitor(q, every=0.05, show=False) as watch:
        job_id = q.enqueue({"n": 1}, queue="slow")
        [job] = q.claim("slow", lease=0.2)  # and never a heartbeat: a paused worker
        wait_for(looked(watch, lambda s: any(x.left < 0 for x in s.leases)), what="lease over")
        assert [r.id for r in q.reap()] == [job_id]
        [again] = q.claim("slow", lease=30)
        wait_for(looked(watch, lambda s: any(x.fence == 2 for x in s.leases)), what="fence 2")
        assert q.complete(job) is False and q.complete(again) is True
        wait_for(looked(watch, lambda s: s.total.finished == 1))
    assert (job.fence, again.fence) == (1, 2)
    assert watch.fences == {job_id: {1, 2}}
    ran_out = [x for s in watch.snapshots for x in s.leases if x.left < 0]
    assert ran_out and all(x.fence == 1 for x in ran_out)
    assert watch.done == 1


def test_it_stops_when_a_burst_worker_is_done_or_time_is_up(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with Queue(dsn) as q:
        q.enqueue_many([{"n": n} for n in range(10)], queue="b")
        worker = Worker(lambda job: time.sleep(0.02), queue="b", dsn=dsn, burst=True).start()
        watch = pgqueue.monitor(q, "b", until=worker, every=0.05, show=False)
        assert watch.stopped_by == "until"
        last = watch.snapshots[-1].total
        assert (last.ready, last.running) == (0, 0)
        assert rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'done'")[0][0] == 10
        worker.stop()

        capsys.readouterr()
        timed = pgqueue.monitor(q, seconds=0.3, every=0.05)  # not in a notebook: text lines
        assert timed.stopped_by == "seconds" and len(timed.snapshots) >= 2
        assert timed.snapshots[-1].t >= 0.3 - 0.05  # its last look was at the end
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].endswith("no jobs") and "stopped by seconds" in printed[-1]

        done = threading.Event()
        threading.Timer(0.2, done.set).start()
        assert pgqueue.monitor(q, until=[done], every=0.05, show=False).stopped_by == "until"
    assert monitor_sessions(dsn) == 0


def test_an_interrupt_ends_the_watch_cleanly_and_leaves_the_figure(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not raise KeyboardInterrupt in this test run")
    shown: list[dict[str, Any]] = []

    class Handle:  # what IPython's display(..., display_id=True) returns
        def update(self, bundle: dict[str, Any], raw: bool) -> None:
            shown.append(bundle)

    def display(bundle: dict[str, Any], raw: bool, display_id: bool) -> Handle:
        shown.append(bundle)
        return Handle()

    import IPython.display

    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(module, "_in_notebook", lambda: True)
    with Queue(dsn) as q:
        q.enqueue_many([{"n": n} for n in range(3)], queue="i")
        jobs = q.claim("i", limit=2, lease=60)
        watch = Monitor(q, "i", every=0.05)  # no seconds, no until: only an interrupt ends it

        def interrupt() -> None:  # what Jupyter's interrupt button does to the kernel
            wait_for(lambda: len(watch.snapshots) >= 3 and len(shown) >= 2)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        assert watch.run() is watch  # returned: the interrupt ended the watch, not the test
    assert watch.stopped_by == "interrupted" and monitor_sessions(dsn) == 0
    last = watch.snapshots[-1]
    assert (last.total.ready, last.total.running) == (1, 2)
    assert {x.id: x.fence for x in last.leases} == {job.id: 1 for job in jobs}
    # Its place in the output first (text), then figures drawn into it while it watched,
    # and the final one, all with the same alt text.
    assert shown[0] == {"text/plain": ALT} and len(shown) >= 3
    assert all(b["image/png"].startswith(b"\x89PNG") and b["text/plain"] == ALT for b in shown[1:])
    figure = watch.figure()
    texts = [t.get_text() for ax in figure.axes for t in ax.get_yticklabels()]
    assert {f"#{job.id} f=1" for job in jobs} <= set(texts)
    assert "stopped: interrupted" in figure.get_suptitle()


def test_it_reads_through_the_partial_indexes_not_the_done_jobs(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO jobs (queue, payload, status, finished_at) "
            "SELECT 'old', '{}', 'done', now() FROM generate_series(1, 20000)"
        )
        conn.execute("INSERT INTO jobs (queue, payload) VALUES ('new', '{}')")
        conn.execute("ANALYZE jobs")
        newest = conn.execute("SELECT max(id) FROM jobs").fetchone()[0]  # type: ignore[index]
        cur = psycopg.ClientCursor(conn)
        for name in ("monitor_counts", "monitor_leases", "monitor_limits"):
            params = {"queues": None, "after": newest - 5, "limit": 10}
            plan = "\n".join(r[0] for r in cur.execute("EXPLAIN " + _sql()[name], params))
            assert "Seq Scan on jobs" not in plan, plan
    watch = pgqueue.monitor(dsn, seconds=0.1, every=0.05, show=False)  # a DSN does too
    assert watch.snapshots[-1].queues == {"new": watch.snapshots[-1].queues["new"]}
    assert watch.snapshots[-1].queues["new"].ready == 1


def test_it_shows_each_schedules_next_slot_and_which_groups_are_at_their_limit(
    dsn: str,
) -> None:
    with Queue(dsn) as q:
        q.limit("reports", per_group=2)
        q.enqueue_many([{"n": n} for n in range(3)], queue="reports", group="tenant-1")
        q.enqueue({"n": 9}, queue="reports", group="tenant-2")
        held = q.claim("reports", limit=10)  # 2 of tenant-1 (its limit), 1 of tenant-2
        q.conn.execute(
            "INSERT INTO pgqueue_schedules (name, spec, queue, last_slot, next_slot) VALUES "
            "('beat', 'every 60s', 'ticks', '2026-12-01 10:00Z', '2026-12-01 10:01Z')"
        )
        watch = pgqueue.monitor(q, seconds=0.1, every=0.05, show=False)
        only = pgqueue.monitor(q, "ticks", seconds=0.05, every=0.05, show=False)
    assert len(held) == 3
    last = watch.snapshots[-1]
    [beat] = last.schedules
    assert (beat.name, beat.queue, f"{beat.next_slot:%H:%M}") == ("beat", "ticks", "10:01")
    [limit] = last.limits
    assert (limit.queue, limit.per_group) == ("reports", 2)
    assert limit.running == (("tenant-1", 2), ("tenant-2", 1)) and limit.full == ["tenant-1"]
    line = module._line(watch, final=True)
    assert "beat next 10:01:00" in line and "1 group(s) full (tenant-1)" in line
    assert "tenant-1" in watch.figure()._suptitle.get_text()  # the figure says it too
    # Watching one queue shows that queue's schedules and limits only.
    assert [s.name for s in only.snapshots[-1].schedules] == ["beat"]
    assert only.snapshots[-1].limits == ()


def test_an_async_queue_is_watched_on_a_connection_of_its_own(dsn: str) -> None:
    async def watch() -> Monitor:
        async with pgqueue.AsyncQueue(dsn) as aq:
            await aq.enqueue({"n": 1}, queue="a")
            return pgqueue.monitor(aq, seconds=0.1, every=0.05, show=False)

    seen = asyncio.run(watch())
    assert seen.snapshots[-1].queues == {"a": Counts(ready=1)}
    assert monitor_sessions(dsn) == 0


def test_bad_arguments_are_one_line_errors(dsn: str, empty_dsn: str) -> None:
    def one_line(error: type[Exception], call: Callable[[], object], *words: str) -> None:
        with pytest.raises(error) as raised:
            call()
        message = str(raised.value)
        assert "\n" not in message and all(word in message for word in words), message

    one_line(BadInput, lambda: pgqueue.monitor(None), "queue connection", "Queue")  # type: ignore[arg-type]
    one_line(BadInput, lambda: pgqueue.monitor(42), "got 42")  # type: ignore[arg-type]
    closed = Queue(dsn)
    closed.close()
    one_line(BadInput, lambda: pgqueue.monitor(closed), "closed")
    with Queue(dsn) as q:
        one_line(BadInput, lambda: pgqueue.monitor(q, every=0), "every")
        one_line(BadInput, lambda: pgqueue.monitor(q, seconds=-1), "seconds")
        one_line(BadInput, lambda: pgqueue.monitor(q, until="soon"), "until", "'soon'")
        one_line(BadInput, lambda: pgqueue.monitor(q, until=[]), "until")
        one_line(BadInput, lambda: pgqueue.monitor(q, bars=-1), "bars")
        one_line(BadInput, lambda: pgqueue.monitor(q, queue=""), "queue")
    one_line(NotInstalled, lambda: pgqueue.monitor(empty_dsn, seconds=1), "pgqueue init")
    one_line(NotInstalled, lambda: Monitor(empty_dsn).start(), "pgqueue init")
    assert monitor_sessions(empty_dsn) == 0  # the connection it opened was closed
    assert monitor_sessions(dsn) == 0
