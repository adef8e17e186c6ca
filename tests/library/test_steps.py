"""Durable steps (``Job.step``): a step done by an earlier attempt is read back, not run
again; a new step's output is stored under the claim, checked in the same statement (the
job row running with this fence and an unexpired lease, locked ``FOR SHARE``), so a stale
holder stores nothing and is told (``LeaseLost``). Against the real server; the takeovers
are driven step by step (claim, expire, reap, claim again), and one test SIGKILLs a real
``pgqueue worker`` between two steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import rows
from pgqueue import AsyncQueue, BadInput, LeaseLost, NotInstalled, Queue, Worker
from tests.faults.test_processes import wait_for
from tests.library.test_queue import expire
from tests.step_handlers import STEP_RUNS

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
ROOT = Path(__file__).resolve().parents[2]


class Counted:
    """A step function that counts its calls and returns ``value``."""

    def __init__(self, value: Any) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.value


def stored(dsn: str, job_id: int) -> list[tuple]:
    """(name, output, fence) of every step the job stored."""
    return rows(
        dsn, "SELECT name, output, fence FROM pgqueue_steps WHERE job_id = %s ORDER BY name",
        [job_id],
    )  # fmt: skip


def take_over(dsn: str, stale: Queue, job_id: int) -> Any:
    """End ``stale``'s claim the way a pause past the lease does (lease out, reaped) and
    claim the job again on a queue of its own: the new holder."""
    expire(dsn, job_id)
    fresh = Queue(dsn)
    assert [r.id for r in fresh.reap()] == [job_id]
    [job] = fresh.claim("q")
    assert job.id == job_id and job.fence == 2
    return fresh, job


def test_a_done_step_is_not_run_again_on_the_next_attempt(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q")
    [first] = queue.claim("q")
    charge = Counted({"charge": "ch_1", "cents": 500})
    assert first.step("charge", charge) == {"charge": "ch_1", "cents": 500}
    assert first.step("charge", charge) == {"charge": "ch_1", "cents": 500}  # this claim too
    assert queue.fail(first, "crashed after charging", delay=0)
    [second] = queue.claim("q")
    assert second.fence == 3  # fail raised the fence, and the claim again
    assert second.step("charge", charge) == {"charge": "ch_1", "cents": 500}
    assert charge.calls == 1
    # What is returned is the output as stored, the same on every attempt.
    assert second.step("pair", Counted((1, 2))) == [1, 2]
    assert second.step("pair", Counted("other")) == [1, 2]
    assert stored(dsn, job_id) == [
        ("charge", {"charge": "ch_1", "cents": 500}, 1),
        ("pair", [1, 2], 3),
    ]
    assert [(s.name, s.fence) for s in queue.steps(job_id)] == [("charge", 1), ("pair", 3)]


def test_a_stale_holder_between_two_steps_stores_nothing_and_is_told(
    queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [stale] = queue.claim("q")
    assert stale.step("one", Counted("a1")) == "a1"
    fresh, holder = take_over(dsn, queue, job_id)  # the stale holder paused here
    with fresh:
        two = Counted("stale two")
        with pytest.raises(LeaseLost, match=r"step 'two' was not stored.*fence 1") as info:
            stale.step("two", two)
        assert "\n" not in str(info.value)
        assert stale.lost and two.calls == 1  # it ran, and its output was refused
        assert stored(dsn, job_id) == [("one", "a1", 1)]
        # Known lost now: a further step is refused before its function runs.
        three = Counted("x")
        with pytest.raises(LeaseLost, match="stale"):
            stale.step("three", three)
        assert three.calls == 0
        # The new holder reads step one back and stores step two under its own fence.
        one = Counted("b1")
        assert holder.step("one", one) == "a1" and one.calls == 0
        assert holder.step("two", Counted("b2")) == "b2"
        assert stored(dsn, job_id) == [("one", "a1", 1), ("two", "b2", 2)]
        assert fresh.complete(holder)


def test_a_lease_run_out_refuses_the_step_before_anyone_takes_over(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    expire(dsn, job_id)  # nobody reaped or claimed it yet: the lease alone says no
    with pytest.raises(LeaseLost):
        job.step("one", Counted(1))
    assert stored(dsn, job_id) == [] and job.lost


def test_the_step_write_holds_the_job_row_so_a_cancel_waits(queue: Queue, dsn: str) -> None:
    """In a transaction of the caller's own (not job.transaction(), whose commit check
    holds the claim instead: tests/library/test_fence_answers.py)."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert job.conn is not None
    with job.conn.transaction():
        assert job.step("one", Counted(1)) == 1
        # step_put took FOR SHARE on the row in the statement that checked and wrote: a
        # cancel (FOR UPDATE) cannot come between them, nor before this commit.
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("SET lock_timeout = '300ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute(
                    "UPDATE jobs SET status = 'cancelled', fence = fence + 1 WHERE id = %s",
                    [job_id],
                )
    assert stored(dsn, job_id) == [("one", 1, 1)]


def test_a_cancel_between_steps_refuses_the_next_and_keeps_the_steps(
    queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert job.step("one", Counted(1)) == 1
    assert queue.cancel(job_id)
    with pytest.raises(LeaseLost):
        job.step("two", Counted(2))
    assert job.lost
    assert stored(dsn, job_id) == [("one", 1, 1)]  # cancel leaves the steps


def test_a_job_killed_after_two_of_three_steps_runs_the_third_alone(
    dsn: str, tmp_path: Path
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(STEP_RUNS)
    after_two = tmp_path / "after-two"
    with Queue(dsn) as q:
        job_id = q.enqueue({"after_two": str(after_two)}, queue="q")
    fast = ("--lease", "1", "--poll", "0.2", "--reap-interval", "0.3")

    def worker(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [PGQUEUE, "--dsn", dsn, "worker", "tests.step_handlers:three_steps",
             "--queue", "q", "--name", name, *fast],
            cwd=ROOT,
            stdout=(tmp_path / f"{name}.out").open("wb"),
            stderr=(tmp_path / f"{name}.err").open("wb"),
            env={k: v for k, v in os.environ.items() if k != "PGQUEUE_DSN"},
        )  # fmt: skip

    a = worker("A")
    try:
        wait_for(after_two.exists, 60, "A to store step two")
        os.kill(a.pid, signal.SIGKILL)  # between step two and step three
        a.wait(10)
    finally:
        if a.poll() is None:
            a.kill()
    b = worker("B")
    try:
        done = "SELECT status, attempts FROM jobs"
        wait_for(lambda: rows(dsn, done) == [("done", 2)], 60, "B to finish the job")
    finally:
        b.send_signal(signal.SIGTERM)
        b.wait(15)
    runs = "SELECT step, attempt FROM step_runs ORDER BY attempt, step"
    assert rows(dsn, runs) == [("one", 1), ("two", 1), ("three", 2)]
    assert [(s.name, s.fence) for s in Queue(dsn).steps(job_id)] == [
        ("one", 1),
        ("two", 1),
        ("three", 2),
    ]


def test_async_steps_are_read_back_stored_and_refused_alike(dsn: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn) as q:
            job_id = await q.enqueue({}, queue="q")
            [stale] = await q.claim("q")
            calls: list[str] = []

            async def fetch() -> dict[str, int]:
                calls.append("fetch")
                await asyncio.sleep(0)
                return {"rows": 3}

            assert await stale.step("fetch", fetch) == {"rows": 3}
            assert await stale.step("fetch", fetch) == {"rows": 3}
            assert await stale.step("plain", lambda: calls.append("plain") or 7) == 7
            assert calls == ["fetch", "plain"]
            expire(dsn, job_id)
            assert [r.id for r in await q.reap()] == [job_id]
            [holder] = await q.claim("q")
            with pytest.raises(LeaseLost, match="not stored"):
                await stale.step("late", lambda: "stale")
            assert stale.lost
            assert await holder.step("fetch", fetch) == {"rows": 3}
            assert await holder.step("late", lambda: "fresh") == "fresh"
            assert calls == ["fetch", "plain"]
            steps = [(s.name, s.fence) for s in await q.steps(job_id)]
            assert sorted(steps) == [("fetch", 1), ("late", 2), ("plain", 1)]
            with pytest.raises(BadInput, match="step 'bad' returned"):
                await holder.step("bad", fetch_set)

    async def fetch_set() -> set[int]:
        return {1}

    asyncio.run(run())
    [(job_id,)] = rows(dsn, "SELECT id FROM jobs")
    assert [name for name, _, _ in stored(dsn, job_id)] == ["fetch", "late", "plain"]


def test_prune_removes_a_jobs_steps_and_archive_moves_them(queue: Queue, dsn: str) -> None:
    def finished_with_a_step(n: int) -> int:
        job_id = queue.enqueue({"n": n}, queue="q")
        [job] = queue.claim("q")
        job.step("s", Counted(n))
        assert queue.complete(job)
        return job_id

    finished_with_a_step(1)
    finished_with_a_step(2)
    running = queue.enqueue({}, queue="q")
    [held] = queue.claim("q")
    held.step("s", Counted("kept"))
    assert queue.prune(0) == 2
    assert rows(dsn, "SELECT job_id FROM pgqueue_steps") == [(running,)]
    moved = finished_with_a_step(3)
    assert queue.prune(0, archive=True) == 1
    assert rows(dsn, "SELECT job_id, name, output, fence FROM pgqueue_steps_archive") == [
        (moved, "s", 3, 1)
    ]
    assert rows(dsn, "SELECT job_id FROM pgqueue_steps") == [(running,)]


@pytest.mark.parametrize("name", ["", "   ", 7, None, "two\nlines", "x" * 201])
def test_a_bad_step_name_is_one_line_and_runs_nothing(queue: Queue, dsn: str, name: Any) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    fn = Counted(1)
    with pytest.raises(BadInput, match="step name must be non-empty text") as info:
        job.step(name, fn)
    assert "\n" not in str(info.value)
    assert fn.calls == 0 and stored(dsn, job_id) == [] and not job.lost


@pytest.mark.parametrize(
    "output, says",
    [(object(), "not JSON"), ({"x": float("nan")}, "not JSON"), ("a\x00b", "NUL")],
)
def test_an_output_that_is_not_json_fails_the_job_and_stores_nothing(
    dsn: str, output: object, says: str
) -> None:
    def handler(job: Any) -> None:
        job.step("ok", lambda: 1)
        job.step("bad", lambda: output)

    with Queue(dsn) as q:
        job_id = q.enqueue({}, queue="q", max_attempts=1)
    worker = Worker(handler, queue="q", dsn=dsn, burst=True, poll_interval=0.05).start()
    worker.join(60)
    [(status, error)] = rows(dsn, "SELECT status, last_error FROM jobs")
    assert status == "dead"
    assert "step 'bad' returned" in error and says in error, error
    assert [name for name, _, _ in stored(dsn, job_id)] == ["ok"]


def test_install_adds_the_steps_tables_to_an_installation_without_them(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:  # as installed before durable steps
        conn.execute("DROP TABLE pgqueue_steps, pgqueue_steps_archive")
    with Queue(dsn) as q:
        q.enqueue({}, queue="q")
        [job] = q.claim("q")
        with pytest.raises(NotInstalled, match=r"pgqueue_steps does not exist.*pgqueue init"):
            job.step("one", Counted(1))
        with pytest.raises(NotInstalled, match="pgqueue_steps"):
            q.prune(0)
        assert q.install().changed == [
            "created pgqueue_steps (durable steps)",
            "created pgqueue_steps_archive (durable steps)",
        ]
        assert q.install().changed == []
        assert job.step("one", Counted(1)) == 1


def test_cli_show_lists_the_stored_steps(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    job.step("charge", Counted({"id": 1}))
    job.step("ship", Counted(None))

    def show(*flags: str) -> str:
        done = subprocess.run(
            [PGQUEUE, "--dsn", dsn, "show", str(job_id), *flags],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = show()
    assert "steps         2" in text
    assert "  charge  fence 1  " in text and "  ship  fence 1  " in text
    shown = json.loads(show("--json"))["steps"]
    assert [(s["name"], s["fence"], s["output"]) for s in shown] == [
        ("charge", 1, {"id": 1}),
        ("ship", 1, None),
    ]
