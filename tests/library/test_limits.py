"""Per-group concurrency limits (issue #20, item 2): at most N running jobs of one group of
a limited queue, enforced by the database across any number of workers and hosts.

The limit is a slot from 1 to N per running job under a partial unique index
(``jobs_slot_idx``), so a count read in a stale snapshot (pgqueuer #761) cannot let two
claims take one slot; a busy group is passed over for the next group's job; every way a
claim ends frees its slot. Worker processes race for slots, a worker is SIGKILLed holding
one, and a sampler counts the running jobs of each group from its own connection.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import psycopg
import pytest

from conftest import rows
from pgqueue import AsyncQueue, BadInput, Queue, SlotRace, Tasks, statements
from pgqueue.queue import Limit
from tests.faults.test_processes import PGQUEUE, WorkerProcess, wait_for
from tests.handlers import RUNS_TABLE


def claim_ids(queue: Queue, limit: int = 10) -> list[int]:
    return [job.id for job in queue.claim("q", limit=limit)]


def execute(dsn: str, query: str, params: object = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query, params)  # type: ignore[arg-type]


def running_by_group(dsn: str) -> dict[str | None, int]:
    found = rows(dsn, "SELECT group_key, count(*) FROM jobs WHERE status = 'running' GROUP BY 1")
    return dict(found)


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant (a run that ends as another begins: one)."""
    edges = sorted([(b, 1) for b, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in edges:  # at equal times an end (-1) sorts before a beginning (+1)
        now += step
        most = max(most, now)
    return most


def runs_at_once_by_group(dsn: str) -> dict[str, int]:
    """From ``runs``: the most handler runs of each group that overlapped in time."""
    by_group: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    for grp, began, ended in rows(dsn, "SELECT grp, began, ended FROM runs"):
        assert ended is not None, "a run that never ended"
        by_group[grp].append((began, ended))
    return {grp: most_at_once(spans) for grp, spans in by_group.items()}


class Sampler:
    """Counts the running jobs of each group from a connection of its own, in a loop,
    while workers run: the largest count of each group it ever saw."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.most: dict[str | None, int] = defaultdict(int)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                found = conn.execute(
                    "SELECT group_key, count(*) FROM jobs WHERE status = 'running' GROUP BY 1"
                ).fetchall()
                for group, count in found:
                    self.most[group] = max(self.most[group], count)
                self.samples += 1

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def workers(dsn: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``pgqueue worker tests.handlers:tracked`` processes on queue q; all are
    killed afterwards."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RUNS_TABLE)
    started: list[WorkerProcess] = []

    def start(name: str, *options: str) -> WorkerProcess:
        fast = ("--queue", "q", "--poll", "0.1", "--lease", "5", "--reap-interval", "0.3")
        worker = WorkerProcess(dsn, "tracked", name, tmp_path, *fast, *options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def all_done(dsn: str) -> bool:
    return rows(dsn, "SELECT count(*) FROM jobs WHERE status <> 'done'") == [(0,)]


# -- setting a limit; bad input -----------------------------------------------------------
def test_a_limit_is_set_shown_changed_and_removed(queue: Queue, dsn: str) -> None:
    assert queue.limits() == []
    queue.limit("q", per_group=2)
    queue.limit("other", per_group=1)
    queue.limit("q", per_group=3)  # replaces
    assert queue.limits() == [Limit("other", 1, 0), Limit("q", 3, 0)]
    queue.limit("q", per_group=None)
    queue.limit("nowhere", per_group=None)  # removing no limit is not an error
    assert rows(dsn, "SELECT queue, per_group FROM pgqueue_limits") == [("other", 1)]


@pytest.mark.parametrize("per_group", [0, -1, 1.5, True, "2", 10**7])
def test_a_limit_below_one_or_not_a_whole_number_is_refused(queue: Queue, per_group) -> None:
    with pytest.raises(BadInput, match="per_group must be a whole number") as info:
        queue.limit("q", per_group=per_group)
    assert "\n" not in str(info.value)
    assert queue.limits() == []


@pytest.mark.parametrize("group", ["", 42, b"g", "x" * 1001, "a\x00b", "\ud800"])
def test_a_group_that_is_not_text_is_refused_and_nothing_is_written(
    queue: Queue, dsn: str, group
) -> None:
    with pytest.raises(BadInput, match="group") as info:
        queue.enqueue({}, queue="q", group=group)
    assert "\n" not in str(info.value)
    with pytest.raises(BadInput, match="group"):
        queue.enqueue_many([{}, {}], queue="q", group=group)
    tasks = Tasks()
    with pytest.raises(BadInput, match="group"):
        tasks.task(lambda job: None, name="t", group=group)
    ok = tasks.task(lambda job: None, name="ok")
    with pytest.raises(BadInput, match="group"):
        ok.configure(group=group)
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(0,)]


def test_the_cli_sets_shows_and_removes_a_limit_and_enqueues_in_a_group(dsn: str) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PGQUEUE, "--dsn", dsn, *args], capture_output=True, text=True, timeout=60
        )

    assert cli("limit").stdout.strip() == "no queue has a per-group limit"
    done = cli("limit", "q", "--per-group", "2")
    assert done.returncode == 0 and "at most 2 running per group" in done.stdout
    assert "'q': at most 2" in cli("limit").stdout
    bad = cli("limit", "q", "--per-group", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "per_group" in bad.stderr
    assert cli("enqueue", "q", '{"n": 1}', "--group", "tenant-42").returncode == 0
    assert rows(dsn, "SELECT group_key FROM jobs") == [("tenant-42",)]
    bad = cli("enqueue", "q", "{}", "--group", "")
    assert bad.returncode == 2 and "group must be" in bad.stderr
    assert cli("limit", "q", "--remove").stdout.strip() == "'q': no limit"
    assert cli("limit", "q").stdout.strip() == "'q': no limit"
    assert cli("limit", "--remove").returncode == 2


def test_tasks_enqueue_in_their_group_or_the_one_configured(dsn: str) -> None:
    tasks = Tasks(dsn)
    try:
        mine = tasks.task(lambda job: None, name="mine", queue="q", group="tenant-1")
        plain = tasks.task(lambda job: None, name="plain", queue="q")
        a = mine.enqueue()
        b = mine.configure(group="tenant-2").enqueue()
        c = plain.enqueue()
        d = plain.configure(group="tenant-3", key="k").enqueue()
    finally:
        tasks.close()
    found = dict(rows(dsn, "SELECT id, group_key FROM jobs"))
    assert found == {a: "tenant-1", b: "tenant-2", c: None, d: "tenant-3"}


# -- the claim under a limit --------------------------------------------------------------
def test_a_full_group_is_passed_over_for_the_next_job_of_another(queue: Queue) -> None:
    # Group a's jobs come first in claim order (priority, then age): a claim that waited
    # for a's slot, or read only the first rows, would take nothing else.
    a = queue.enqueue_many([{"a": i} for i in range(5)], queue="q", group="a", priority=5)
    b = queue.enqueue_many([{"b": i} for i in range(3)], queue="q", group="b")
    free = queue.enqueue({"no group": True}, queue="q")
    queue.limit("q", per_group=1)
    assert claim_ids(queue, limit=1) == [a[0]]
    assert claim_ids(queue, limit=1) == [b[0]]  # a is full: b's first job, not a's second
    assert claim_ids(queue, limit=1) == [free]  # b is full; jobs without a group: no limit
    assert claim_ids(queue) == []


def test_a_batch_keeps_claim_order_within_what_the_limit_allows(queue: Queue, dsn: str) -> None:
    low = queue.enqueue_many([{"n": i} for i in range(4)], queue="q", group="g")
    high = queue.enqueue_many([{"n": i} for i in range(4)], queue="q", group="h", priority=1)
    free = queue.enqueue({}, queue="q", priority=-1)
    queue.limit("q", per_group=2)
    assert claim_ids(queue, limit=10) == [high[0], high[1], low[0], low[1], free]
    slots = rows(dsn, "SELECT group_key, slot FROM jobs WHERE status = 'running' ORDER BY 1, 2")
    assert slots == [("g", 1), ("g", 2), ("h", 1), ("h", 2), (None, None)]
    assert claim_ids(queue) == []


def test_without_a_limit_a_group_changes_nothing(queue: Queue, dsn: str) -> None:
    ids = queue.enqueue_many([{}] * 3, queue="q", group="g")
    queue.limit("other", per_group=1)  # another queue's limit
    assert claim_ids(queue) == ids
    assert rows(dsn, "SELECT DISTINCT slot FROM jobs") == [(None,)]


@pytest.mark.parametrize("end", ["complete", "complete_many", "fail", "release", "reap", "cancel"])
def test_every_way_a_claim_ends_frees_its_slot(queue: Queue, dsn: str, end: str) -> None:
    first, second = queue.enqueue_many([{"n": 1}, {"n": 2}], queue="q", group="g")
    queue.limit("q", per_group=1)
    [job] = queue.claim("q")
    assert job.id == first and claim_ids(queue) == []  # its one slot is taken
    if end == "complete":
        assert queue.complete(job)
    elif end == "complete_many":
        assert queue.complete_many([job]) == []
    elif end == "fail":
        assert queue.fail(job, "boom", delay=3600)
    elif end == "release":
        assert queue.release(job)
    elif end == "reap":
        execute(dsn, "UPDATE jobs SET lease_until = now() - interval '1 s' WHERE id = %s", [first])
        assert [r.id for r in queue.reap()] == [first]
    else:
        assert queue.cancel(first)
    # The next claim takes the slot (the second job: one back in the queue is newer).
    assert claim_ids(queue) == [second]
    assert rows(dsn, "SELECT slot FROM jobs WHERE status = 'running'") == [(1,)]


def test_the_unique_index_refuses_a_second_job_in_a_taken_slot(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{}, {}], queue="q", group="g")
    queue.limit("q", per_group=1)
    [job] = queue.claim("q")
    with pytest.raises(psycopg.errors.UniqueViolation, match="jobs_slot_idx"):
        execute(dsn, "UPDATE jobs SET status = 'running', slot = 1 WHERE id <> %s", [job.id])


def test_a_claim_that_counted_in_a_stale_snapshot_is_refused_whole(queue: Queue, dsn: str) -> None:
    """pgqueuer #761's race, made deterministic: a claim whose snapshot predates another
    claim's commit sees the slot free. The index refuses it (SlotRace, nothing claimed);
    Queue.claim outside a transaction would claim again with a new snapshot."""
    queue.enqueue_many([{}, {}], queue="q", group="g")
    other = queue.enqueue({}, queue="q", group="h")
    queue.limit("q", per_group=1)
    with psycopg.connect(dsn) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM jobs")  # the snapshot: nothing running
        # Another worker takes g's slot with a job this snapshot never saw, and commits.
        urgent = queue.enqueue({}, queue="q", group="g", priority=9)
        assert claim_ids(queue, limit=1) == [urgent]
        with pytest.raises(SlotRace, match="claim again"):
            Queue(conn).claim("q", limit=1)  # counted g's slots in the old snapshot
    assert rows(dsn, "SELECT id FROM jobs WHERE status = 'running'") == [(urgent,)]
    assert claim_ids(queue) == [other]  # with a new snapshot: g is full, h is free


def test_a_stale_guess_of_which_claim_a_queue_needs_never_breaks_the_limit(
    queue: Queue, dsn: str
) -> None:
    queue.enqueue_many([{}] * 4, queue="q", group="g")
    with Queue(dsn) as admin:
        assert len(claim_ids(queue, limit=1)) == 1  # this Queue now guesses: no limit
        admin.limit("q", per_group=1)  # set by another process
        # The claim without a limit refuses the queue; the one under the limit takes one
        # slot. (The job running from before holds none: a limit counts what it admits.)
        assert len(claim_ids(queue, limit=3)) == 1
        assert claim_ids(queue, limit=3) == []
        admin.limit("q", per_group=None)  # removed elsewhere: the guess flips back
        assert len(claim_ids(queue, limit=3)) == 2


def test_async_queue_claims_under_the_limit_too(dsn: str) -> None:
    async def run() -> tuple[list[int], list[int], list[Limit]]:
        async with AsyncQueue(dsn) as q:
            ids = await q.enqueue_many([{}] * 3, queue="q", group="g")
            await q.enqueue({}, queue="q", group="h")
            await q.limit("q", per_group=2)
            first = [j.id for j in await q.claim("q", limit=10)]
            return ids, first, await q.limits()

    ids, first, limits = asyncio.run(run())
    assert first[:2] == ids[:2] and len(first) == 3  # g's two, then h's one
    assert limits == [Limit("q", 2, 3)]
    assert running_by_group(dsn) == {"g": 2, "h": 1}


def test_claims_without_a_limit_read_the_ready_index_in_order(queue: Queue, dsn: str) -> None:
    execute(
        dsn,
        "INSERT INTO jobs (queue, payload, status, attempts, fence) "
        "SELECT 'q', '{}', 'done', 1, 1 FROM generate_series(1, 20000)",
    )
    queue.enqueue_many([{}] * 5, queue="q")
    queue.enqueue_many([{}] * 5, queue="q", group="g")
    queue.limit("limited", per_group=2)
    execute(dsn, "ANALYZE jobs")
    with psycopg.connect(dsn) as conn:
        for name, target in (("claim", "q"), ("claim_limited", "limited")):
            plan = "\n".join(
                r[0]
                for r in conn.execute(
                    "EXPLAIN " + statements.query(name), {"queue": target, "limit": 10, "lease": 30}
                )
            )
            assert "Index Scan using jobs_ready_idx" in plan, plan
            # The ready jobs come in claim order from the index: no sort of every ready job.
            assert "Sort Key: jobs" not in plan, plan
        conn.rollback()


def test_an_older_table_gets_groups_and_limits_from_install(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "DROP TABLE pgqueue_limits; DROP INDEX jobs_slot_idx; "
            "ALTER TABLE jobs DROP COLUMN group_key, DROP COLUMN slot; "
            "ALTER TABLE jobs_archive DROP COLUMN group_key, DROP COLUMN slot"
        )
        conn.execute("INSERT INTO jobs (queue, payload) VALUES ('q', '{}')")
    with Queue(dsn) as q:
        with pytest.raises(Exception, match="pgqueue init"):
            q.enqueue({}, queue="q", group="g")
        done = q.install()
        assert done.changed == [
            "added columns to jobs (group_key, slot)",
            "added columns to jobs_archive",
            "created pgqueue_limits",
            "built jobs_slot_idx concurrently",
        ]
        assert q.install().changed == []
        q.enqueue_many([{}, {}], queue="q", group="g")
        q.limit("q", per_group=1)
        assert len(q.claim("q", limit=5)) == 2  # the old job (no group) and one of g
        assert q.claim("q", limit=5) == []


# -- real worker processes --------------------------------------------------------------------
def worker_sessions(dsn: str) -> set[str]:
    """The workers (by application name) with a session on the server now."""
    found = rows(
        dsn,
        "SELECT DISTINCT application_name FROM pg_stat_activity "
        "WHERE application_name LIKE 'pgqueue worker w%'",
    )
    return {name for (name,) in found}


@pytest.mark.slow
@pytest.mark.parametrize("per_group", [1, 2])
def test_four_processes_racing_for_slots_never_exceed_the_limit(
    dsn: str, workers: Callable[..., WorkerProcess], per_group: int
) -> None:
    with Queue(dsn) as q:
        q.limit("q", per_group=per_group)
    with Sampler(dsn) as sampler:
        procs = [workers(f"w{i}", "--concurrency", "4", "--poll", "0.01") for i in range(4)]
        # Every worker is up before any job exists, so they all race for each group (one
        # that started first could otherwise drain a group alone on a loaded machine).
        wait_for(lambda: len(worker_sessions(dsn)) == 4, 60, "four workers connected", *procs)
        with Queue(dsn) as q:
            for group in ("a", "b", "c"):
                q.enqueue_many([{"group": group, "sleep": 0.0}] * 60, queue="q", group=group)
        wait_for(lambda: all_done(dsn), 120, "every job done", *procs)
    assert sampler.samples > 10
    assert max(sampler.most.values()) <= per_group, dict(sampler.most)
    at_once = runs_at_once_by_group(dsn)
    assert set(at_once) == {"a", "b", "c"}
    assert max(at_once.values()) <= per_group, at_once
    # They raced: more than one process ran jobs of each group.
    pids = rows(dsn, "SELECT grp, count(DISTINCT pid) FROM runs GROUP BY 1")
    assert all(n > 1 for _, n in pids), pids
    assert rows(dsn, "SELECT count(*) FROM runs") == [(180,)]  # each job ran once


@pytest.mark.slow
def test_done_when_a_limit_of_two_four_groups_two_processes_of_eight_threads(
    dsn: str, workers: Callable[..., WorkerProcess]
) -> None:
    """Issue #20's "Done when": never more than 2 running per group, sampled from the table
    while it runs, and the other groups kept busy: group slow's jobs come first and take
    long, yet the other groups' jobs all finish while slow still has jobs waiting."""
    with Queue(dsn) as q:
        q.limit("q", per_group=2)
        q.enqueue_many([{"group": "slow", "sleep": 1.0}] * 6, queue="q", group="slow", priority=1)
        for group in ("g1", "g2", "g3"):
            q.enqueue_many([{"group": group, "sleep": 0.02}] * 30, queue="q", group=group)
    with Sampler(dsn) as sampler:
        procs = [workers(f"w{i}", "--concurrency", "8", "--batch", "4") for i in range(2)]
        wait_for(lambda: all_done(dsn), 120, "every job done", *procs)
    assert sampler.samples > 10
    assert set(sampler.most) == {"slow", "g1", "g2", "g3"}
    assert max(sampler.most.values()) <= 2, dict(sampler.most)
    assert max(runs_at_once_by_group(dsn).values()) <= 2
    # The other groups were not held up behind slow: the last of their 90 jobs ended
    # before slow's last job began (slow's 6 jobs need three turns of its 2 slots).
    [(others_ended, slow_last_began)] = rows(
        dsn,
        "SELECT max(ended) FILTER (WHERE grp <> 'slow'), max(began) FILTER (WHERE grp = 'slow') "
        "FROM runs",
    )
    assert others_ended < slow_last_began
    assert rows(dsn, "SELECT count(*) FROM runs") == [(96,)]


@pytest.mark.slow
def test_a_sigkilled_workers_slot_is_freed_when_the_reaper_returns_its_job(
    dsn: str, workers: Callable[..., WorkerProcess]
) -> None:
    with Queue(dsn) as q:
        q.limit("q", per_group=1)
        hung = q.enqueue({"group": "g", "first_sleep": 600}, queue="q", group="g", priority=1)
        waiting = q.enqueue({"group": "g"}, queue="q", group="g")
    with Sampler(dsn) as sampler:
        victim = workers("victim", "--lease", "1")
        wait_for(lambda: rows(dsn, "SELECT count(*) FROM runs") == [(1,)], 60, "a run", victim)
        victim.signal(signal.SIGKILL)
        victim.proc.wait(10)
        # Its job still holds the slot (running, lease not yet out): nothing else runs.
        assert running_by_group(dsn) == {"g": 1}
        rescuer = workers("rescuer", "--lease", "1")
        wait_for(lambda: all_done(dsn), 60, "every job done", rescuer)
    assert sampler.most["g"] == 1
    # The waiting job began only once the reaper had returned the hung one (run_at: then).
    [(reaped_at, attempts)] = rows(dsn, "SELECT run_at, attempts FROM jobs WHERE id = %s", [hung])
    [(began,)] = rows(dsn, "SELECT started_at FROM jobs WHERE id = %s", [waiting])
    assert attempts == 2 and began >= reaped_at
