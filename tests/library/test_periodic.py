"""Periodic jobs (issue #20, item 1): every worker ticks, none leads, and the database keeps
one job per slot: the slot's row in ``pgqueue_slots`` (primary key (schedule, slot)) is
inserted with its job in one statement, deciding on the server's clock.

Unit tests of the slot computation and the bad input, then ticks against a real server:
the catch-up policies after a gap, a stale tick refused by the key, two worker threads, and
four ``pgqueue worker`` processes (one SIGSTOPped past its term) making one job per slot.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import rows
from pgqueue import AsyncQueue, BadInput, Job, NotInstalled, Queue, Tasks, Worker
from pgqueue.periodic import (
    CATCH_UP_ALL,
    GRACE,
    Schedule,
    candidates,
    schedules_for,
    tick,
)

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
ROOT = Path(__file__).resolve().parents[2]
UTC = timezone.utc
T = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def schedule(**kwargs: Any) -> Schedule:
    tasks = Tasks()
    task = tasks.periodic(**kwargs)(lambda job: None)
    return tasks.schedules[task.name]


def run_tick(dsn: str, *schedules: Schedule) -> int:
    async def go() -> int:
        async with AsyncQueue(dsn) as q:
            return await tick(q, schedules)

    return asyncio.run(go())


def made(dsn: str, name: str = "<lambda>") -> list[tuple[datetime, datetime]]:
    """(slot, the time its tick's statement ran) of every job of a schedule, by slot."""
    return rows(
        dsn,
        "SELECT (payload->>'slot')::timestamptz, run_at FROM jobs "
        "WHERE payload->>'schedule' = %s ORDER BY 1",
        [name],
    )


def no_slot_twice(dsn: str) -> None:
    """Each slot has one job, and each job the slot row that names it."""
    twice = rows(
        dsn,
        "SELECT payload->>'schedule', payload->>'slot' FROM jobs "
        "WHERE payload ? 'slot' GROUP BY 1, 2 HAVING count(*) > 1",
    )
    assert twice == []
    unmatched = rows(
        dsn,
        "SELECT j.id FROM jobs j LEFT JOIN pgqueue_slots s ON s.job_id = j.id "
        "WHERE j.payload ? 'slot' AND (s.job_id IS NULL "
        "OR s.slot <> (j.payload->>'slot')::timestamptz)",
    )
    assert unmatched == []


def set_last_slot_back(dsn: str, seconds: float, name: str = "<lambda>") -> None:
    """As if every worker had stopped ``seconds`` ago, just after its last slot."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE pgqueue_schedules SET last_slot = last_slot - make_interval(secs => %s) "
            "WHERE name = %s",
            [seconds, name],
        )


def until(check: Any, seconds: float, what: str, *workers: TickingProcess) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.name}:\n{w.stderr()[-2000:]}" for w in workers)
            raise AssertionError(f"gave up waiting for {what}\n{logs}")
        time.sleep(0.1)


def contiguous(slots: list[datetime]) -> bool:
    return slots == [slots[0] + timedelta(seconds=n) for n in range(len(slots))]


# -- slots, computed without a database -------------------------------------------------
def test_every_slots_are_aligned_to_the_epoch_newest_first() -> None:
    s = schedule(every=30)
    at = T + timedelta(seconds=47)
    assert [next(iter(s.slots_before(at)))] == [T + timedelta(seconds=30)]
    slots = s.slots_before(T)  # a slot at the time itself counts
    assert [next(slots), next(slots)] == [T, T - timedelta(seconds=30)]
    assert s.next_after(T) == T + timedelta(seconds=30)
    seven = schedule(every=7)
    assert next(iter(seven.slots_before(T))).timestamp() % 7 == 0


def test_cron_slots_in_utc_newest_first() -> None:
    s = schedule(cron="*/5 * * * *")
    slots = s.slots_before(T + timedelta(minutes=7))
    assert [next(slots), next(slots)] == [T + timedelta(minutes=5), T]
    assert next(iter(s.slots_before(T))) == T
    assert s.next_after(T) == T + timedelta(minutes=5)
    assert schedule(cron="0 3 * * 1").next_after(T) == datetime(2026, 1, 5, 3, tzinfo=UTC)
    assert s.spec == "cron */5 * * * *" and schedule(every=30).spec == "every 30s"


@pytest.mark.parametrize(
    "catch_up,missed", [("latest", 1), ("all", 10), ("none", 0)], ids=["latest", "all", "none"]
)
def test_a_tick_sends_the_on_time_slots_and_the_missed_ones_its_policy_may_make(
    catch_up: str, missed: int
) -> None:
    s = schedule(every=60, catch_up=catch_up)
    now = T + timedelta(seconds=1)  # slot T is on time; the ten before it were missed
    sent = candidates(s, T - timedelta(minutes=11), now)
    minutes = [(slot - T) / timedelta(minutes=1) for slot in sent]
    assert minutes == [*range(-missed, 0), 0, 1]  # ..., the on-time slot, the next one


def test_catch_up_all_is_bounded_and_a_new_schedule_starts_at_its_newest_slot() -> None:
    s = schedule(every=1, catch_up="all")
    sent = candidates(s, T - timedelta(days=1), T)
    on_time = [slot for slot in sent if slot >= T - timedelta(seconds=GRACE)]
    assert len(sent) - len(on_time) == CATCH_UP_ALL
    assert sent == sorted(sent) and sent[-1] == T + timedelta(seconds=2)  # margin, then next
    fresh = candidates(schedule(cron="0 * * * *"), None, T + timedelta(minutes=30))
    assert fresh == [T, T + timedelta(hours=1)]  # where it starts, and its next slot


def test_a_worker_ticks_the_schedules_of_its_own_queues_only() -> None:
    tasks = Tasks()
    tasks.periodic(every=5, queue="a")(lambda job: None)
    tasks.periodic(every=5, queue="b", name="other")(lambda job: None)
    assert [s.queue for s in schedules_for(tasks, ["b"])] == ["b"]
    assert schedules_for(tasks, ["c"]) == [] and schedules_for(len, ["a"]) == []


@pytest.mark.parametrize(
    "kwargs,says",
    [
        ({"cron": "*/5 * * *"}, "does not parse: give five fields"),
        ({"cron": "*/5 * * * * *"}, "does not parse"),
        ({"cron": "@hourly"}, "does not parse"),
        ({"cron": "61 * * * *"}, "does not parse"),
        ({"cron": 5}, "does not parse"),
        ({"cron": "0 0 30 2 *"}, "never fires"),
        ({"every": 0.5}, "every is the seconds between runs, from 1"),
        ({"every": True}, "every is the seconds"),
        ({"every": float("inf")}, "every is the seconds"),
        ({"cron": "* * * * *", "every": 5}, "one of the two"),
        ({}, "one of the two"),
        ({"every": 5, "catch_up": "some"}, "catch_up must be"),
        ({"every": 5, "priority": "high"}, "priority must be a whole number"),
        ({"every": 5, "max_attempts": 0}, "max_attempts must be"),
    ],
)
def test_bad_schedules_are_one_line_and_register_nothing(kwargs: dict[str, Any], says: str) -> None:
    tasks = Tasks()
    with pytest.raises(BadInput, match=says) as info:
        tasks.periodic(**kwargs)(lambda job: None)
    assert "\n" not in str(info.value)
    assert tasks.tasks == {} and tasks.schedules == {}


def test_two_schedules_with_one_name_are_refused_and_a_task_may_have_two() -> None:
    tasks = Tasks()

    @tasks.periodic(every=60, name="hourly-report")
    @tasks.periodic(cron="0 * * * *")
    def report(job: Job) -> None: ...

    assert sorted(tasks.schedules) == ["hourly-report", "report"]
    assert {s.task for s in tasks.schedules.values()} == {"report"}
    with pytest.raises(BadInput, match="two schedules are named 'report'"):
        tasks.periodic(every=5)(report)
    with pytest.raises(BadInput, match="a task needs a unique name"):
        tasks.periodic(every=5, name="report")(lambda job: None)
    with pytest.raises(BadInput, match="takes no task options"):
        tasks.periodic(every=5, name="x", queue="q")(report)
    assert sorted(tasks.schedules) == ["hourly-report", "report"] and list(tasks.tasks) == [
        "report"
    ]


# -- ticks against the server ------------------------------------------------------------
def test_a_new_schedule_starts_without_a_job_then_makes_one_per_slot(dsn: str) -> None:
    s = schedule(every=1, queue="ticks")
    assert run_tick(dsn, s) == 0  # its row: it starts at its newest slot
    [(spec, queue, last, following)] = rows(
        dsn, "SELECT spec, queue, last_slot, next_slot FROM pgqueue_schedules"
    )
    assert (spec, queue, following - last) == ("every 1s", "ticks", timedelta(seconds=1))
    until(lambda: run_tick(dsn, s) == 1, 5, "the next slot's job")
    assert run_tick(dsn, s) == 0  # the same slot again: nothing
    [(slot, _)] = made(dsn)
    assert slot == last + timedelta(seconds=1)
    [job] = Queue(dsn).claim("ticks")
    assert job.payload == {
        "task": "<lambda>",
        "kwargs": {},
        "schedule": "<lambda>",
        "slot": job.payload["slot"],
    }
    assert datetime.fromisoformat(job.payload["slot"]) == slot


def test_install_adds_the_periodic_tables_to_an_installation_without_them(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:  # as installed before periodic jobs
        conn.execute("DROP TABLE pgqueue_schedules, pgqueue_slots")
    with pytest.raises(NotInstalled, match=r"periodic tables .* run `pgqueue init`") as info:
        run_tick(dsn, schedule(every=1))
    assert "\n" not in str(info.value)
    with Queue(dsn) as q:
        assert q.install().changed == [
            "created pgqueue_schedules (periodic jobs)",
            "created pgqueue_slots (periodic jobs)",
        ]
        assert q.install().changed == []
        assert run_tick(dsn, schedule(every=1)) == 0 and len(q.schedules()) == 1


@pytest.mark.parametrize("catch_up", ["latest", "all", "none"])
def test_after_a_gap_each_policy_makes_its_catch_up_jobs(dsn: str, catch_up: str) -> None:
    s = schedule(every=1, catch_up=catch_up)
    run_tick(dsn, s)
    set_last_slot_back(dsn, 10)  # every worker stopped for 10 s
    [(last,)] = rows(dsn, "SELECT last_slot FROM pgqueue_schedules")
    run_tick(dsn, s)
    slots = made(dsn)
    # A slot older than GRACE when its tick's statement ran (run_at, the same now()) was
    # missed; the rest were on time, and every policy makes those.
    missed = [slot for slot, ran in slots if ran - slot > timedelta(seconds=GRACE)]
    on_time = [slot for slot, ran in slots if ran - slot <= timedelta(seconds=GRACE)]
    [ran] = {ran for _, ran in slots}  # one statement made them all
    gap = [last + timedelta(seconds=n) for n in range(1, 20)]
    gap_missed = [g for g in gap if ran - g > timedelta(seconds=GRACE)]
    assert len(gap_missed) >= 7
    assert on_time == [g for g in gap if timedelta(0) <= ran - g <= timedelta(seconds=GRACE)]
    expected = {"latest": gap_missed[-1:], "all": gap_missed, "none": []}[catch_up]
    assert missed == expected
    [(cursor,)] = rows(dsn, "SELECT last_slot FROM pgqueue_schedules")
    assert cursor == max(g for g in gap if g <= ran)  # the missed slots are behind it now
    assert run_tick(dsn, s) == 0 or made(dsn)[-1][0] > cursor
    no_slot_twice(dsn)


def test_catch_up_all_makes_at_most_its_bound(dsn: str) -> None:
    s = schedule(every=1, catch_up="all")
    run_tick(dsn, s)
    set_last_slot_back(dsn, 1000)
    assert run_tick(dsn, s) == CATCH_UP_ALL  # the newest 100 due slots
    slots = [slot for slot, _ in made(dsn)]
    assert slots == [slots[0] + timedelta(seconds=n) for n in range(CATCH_UP_ALL)]


def test_a_stale_tick_makes_no_second_job_and_the_key_decides(dsn: str) -> None:
    """A worker paused between reading the clock and writing (SIGSTOP past its term): when
    it wakes, its slots are made already. Even with the schedule's last slot set back (the
    cursor no longer stops it), the slot's primary key refuses the second job."""
    s = schedule(every=1)
    run_tick(dsn, s)

    async def paused_then_woken() -> tuple[int, int]:
        async with AsyncQueue(dsn) as stale, AsyncQueue(dsn) as other:
            await asyncio.sleep(1.1)  # a slot is due
            now, last = await stale.schedule_clock([s.name])
            plan = candidates(s, last[s.name], now)  # ... and the stale worker stops here
            assert await tick(other, [s]) >= 1  # another worker makes the slot
            refused_by_cursor = await stale.schedule_tick(s, plan)
            await stale.conn.execute("UPDATE pgqueue_schedules SET last_slot = %s", [last[s.name]])
            refused_by_key = await stale.schedule_tick(s, [p for p in plan if p <= now])
            return refused_by_cursor, refused_by_key

    assert asyncio.run(paused_then_woken()) == (0, 0)
    no_slot_twice(dsn)


def test_a_periodic_task_is_a_task_that_can_be_enqueued_by_hand(dsn: str) -> None:
    tasks = Tasks(dsn)

    @tasks.periodic(cron="0 3 * * *", queue="nightly", max_attempts=2, priority=4)
    def cleanup(job: Job, dry_run: bool = False) -> None: ...

    job_id = cleanup.enqueue(dry_run=True)
    assert rows(dsn, "SELECT queue, payload, max_attempts, priority FROM jobs WHERE id = %s", [
        job_id
    ]) == [("nightly", {"task": "cleanup", "kwargs": {"dry_run": True}}, 2, 4)]  # fmt: skip
    tasks.close()


# -- real workers ticking -------------------------------------------------------------
def test_two_worker_threads_ticking_make_one_job_per_slot(dsn: str) -> None:
    tasks = Tasks(dsn)
    ran: list[str] = []

    @tasks.periodic(every=1)
    def beat(job: Job) -> None:
        ran.append(job.payload["slot"])

    workers = [Worker(tasks, dsn=dsn, name=f"w{i}", poll_interval=0.2).start() for i in (1, 2)]
    try:
        until(lambda: len(made(dsn, "beat")) >= 4, 15, "four slots")
    finally:
        for w in workers:
            w.stop(grace=2)
    slots = [slot for slot, _ in made(dsn, "beat")]
    assert slots == [slots[0] + timedelta(seconds=n) for n in range(len(slots))]
    assert len(set(ran)) == len(ran) and len(ran) >= len(slots) - 1
    no_slot_twice(dsn)


class TickingProcess:
    """One ``pgqueue worker tests.periodic_tasks:tasks`` subprocess, output kept in files."""

    def __init__(self, dsn: str, name: str, logs: Path) -> None:
        self.name, self.err = name, logs / f"{name}.err"
        with open(logs / f"{name}.out", "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [PGQUEUE, "--dsn", dsn, "worker", "tests.periodic_tasks:tasks", "--name", name,
                 "--lease", "1", "--poll", "0.2", "--reap-interval", "0.5"],
                cwd=ROOT, stdout=out, stderr=err,
                env={k: v for k, v in os.environ.items() if k != "PGQUEUE_DSN"},
            )  # fmt: skip

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> int:
        """SIGCONT, SIGTERM (a graceful stop) and the exit code; SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def stderr(self) -> str:
        return self.err.read_text()


@pytest.fixture
def ticking(dsn: str, tmp_path: Path) -> Iterator[Any]:
    """Start ticking worker processes on this test's database; all stopped afterwards."""
    started: list[TickingProcess] = []

    def start(name: str) -> TickingProcess:
        started.append(TickingProcess(dsn, name, tmp_path))
        return started[-1]

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.signal(signal.SIGCONT)
            worker.proc.kill()
            worker.proc.wait(10)


@pytest.mark.slow
def test_four_worker_processes_make_one_job_per_slot_one_paused_past_its_term(
    dsn: str, ticking: Any
) -> None:
    """Done when (issue #20): four ``pgqueue worker`` processes ticking every=1 make one job
    per slot and no slot twice, one of them SIGSTOPped for 3 s (past its 1 s lease, and its
    tick's plan gone stale) and woken; then, every worker stopped and the record moved 10 s
    back (as if they had stopped 10 s ago), the `latest` policy makes one catch-up job."""
    name = "every_second"
    workers = [ticking(f"p{i}") for i in range(4)]
    until(lambda: len(made(dsn, name)) >= 2, 60, "the first slots", *workers)
    workers[1].signal(signal.SIGSTOP)
    time.sleep(3)
    workers[1].signal(signal.SIGCONT)
    time.sleep(3)
    for w in workers:
        assert w.stop() == 0, w.stderr()
    slots = [slot for slot, _ in made(dsn, name)]
    assert len(slots) >= 6 and contiguous(slots)  # a job for every slot, none twice
    no_slot_twice(dsn)

    with psycopg.connect(dsn, autocommit=True) as conn:  # every worker stopped 10 s ago
        conn.execute("UPDATE pgqueue_schedules SET last_slot = last_slot - interval '10 s'")
        conn.execute("UPDATE pgqueue_slots SET slot = slot - interval '10 s'")
        conn.execute(
            "UPDATE jobs SET payload = jsonb_set(payload, '{slot}', "
            "to_jsonb((payload->>'slot')::timestamptz - interval '10 s'))"
        )
    before = {slot for slot, _ in made(dsn, name)}
    workers = [ticking(f"q{i}") for i in range(4)]
    until(lambda: len(made(dsn, name)) >= len(before) + 5, 60, "ticks after the gap", *workers)
    for w in workers:
        assert w.stop() == 0, w.stderr()
    after = [(slot, ran) for slot, ran in made(dsn, name) if slot not in before]
    caught_up = [slot for slot, ran in after if ran - slot > timedelta(seconds=GRACE)]
    on_time = [slot for slot, ran in after if ran - slot <= timedelta(seconds=GRACE)]
    assert len(caught_up) == 1  # the newest missed slot of the gap, no other
    assert contiguous(on_time) and caught_up[0] < on_time[0]
    no_slot_twice(dsn)


def test_cli_stats_shows_each_schedule_with_its_last_and_next_slot(dsn: str) -> None:
    run_tick(dsn, schedule(every=30, name="sample", queue="metrics"))
    [state] = Queue(dsn).schedules()
    assert (state.name, state.spec, state.queue) == ("sample", "every 30s", "metrics")
    assert state.next_slot - state.last_slot == timedelta(seconds=30)
    env = {k: v for k, v in os.environ.items() if k != "PGQUEUE_DSN"}
    text = subprocess.run(
        [PGQUEUE, "--dsn", dsn, "stats"], capture_output=True, text=True, env=env, check=True
    ).stdout
    last, following = (t.astimezone(UTC) for t in (state.last_slot, state.next_slot))
    assert (
        f"schedule sample (every 30s) on 'metrics': last slot {last:%Y-%m-%d %H:%M:%S} UTC" in text
    )
    assert f"next {following:%Y-%m-%d %H:%M:%S} UTC" in text
    listed = subprocess.run(
        [PGQUEUE, "--dsn", dsn, "stats", "--json"], capture_output=True, text=True, env=env
    ).stdout
    [row] = [r for r in json.loads(listed) if r["status"] == "schedule"]
    assert row["schedule"] == "sample" and row["queue"] == "metrics" and not row["estimated"]
    assert datetime.fromisoformat(row["next_slot"]) == state.next_slot
