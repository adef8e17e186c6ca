"""Pausing a queue (Queue.pause / resume, `pgqueue pause` / `resume`): the claim statement
itself skips a paused queue, so every worker on every host stops claiming from it with no
restart, and starts again when it is resumed. Against the real server, with real workers;
no sleeps: what a worker did is read from the database."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import rows, wait_for
from pgqueue import AsyncQueue, BadInput, Job, NotInstalled, Queue, Worker
from tests.library.test_queue import execute

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
FAST = {"poll_interval": 0.05, "reap_interval": 0.5}


def statuses(dsn: str, queue: str) -> list[str]:
    return [
        s for (s,) in rows(dsn, "SELECT status FROM jobs WHERE queue = %s ORDER BY id", [queue])
    ]


def test_a_paused_queue_is_not_claimed_and_a_resumed_one_is(queue: Queue, dsn: str) -> None:
    queue.enqueue_many([{}, {}], queue="emails")
    assert queue.pause("emails") is True
    assert queue.pause("emails") is False  # paused already: nothing changes
    assert list(queue.paused()) == ["emails"]
    assert queue.claim("emails", limit=5) == []
    assert queue.claim(["emails", "other"], limit=5) == []
    queue.limit("emails", per_group=1)  # the limited claim obeys the pause too
    queue.enqueue({}, queue="emails", group="t1")
    assert queue.claim("emails", limit=5) == []
    assert queue.resume("emails") is True
    assert queue.resume("emails") is False
    assert queue.paused() == {}
    assert len(queue.claim("emails", limit=5)) == 3


def test_a_running_worker_stops_claiming_from_a_paused_queue_until_it_is_resumed(
    queue: Queue, dsn: str
) -> None:
    """The worker serves 'emails' then 'other', in that order, in each claim round: once the
    'other' job enqueued after the paused ones is done, it has claimed past them."""
    done: list[str] = []

    def handler(job: Job) -> None:
        done.append(job.queue)

    worker = Worker(handler, queue=["emails", "other"], dsn=dsn, **FAST).start()
    try:
        queue.enqueue({}, queue="emails")
        wait_for(lambda: done == ["emails"], what="the first e-mail done")
        assert queue.pause("emails")
        queue.enqueue_many([{}, {}], queue="emails")
        queue.enqueue({}, queue="other")
        wait_for(lambda: "other" in done, what="the later job of another queue done")
        assert statuses(dsn, "emails") == ["done", "ready", "ready"]
        assert queue.resume("emails")
        wait_for(lambda: statuses(dsn, "emails") == ["done"] * 3, what="the e-mails done")
    finally:
        worker.stop(grace=2)
    assert sorted(done) == ["emails"] * 3 + ["other"]


def test_the_async_face_pauses_the_same_way(queue: Queue, dsn: str) -> None:
    queue.enqueue({}, queue="q")

    async def main() -> tuple[bool, list[int], dict[str, object], int]:
        async with AsyncQueue(dsn) as q:
            paused = await q.pause("q")
            claimed = [j.id for j in await q.claim("q")]
            listed = await q.paused()
            await q.resume("q")
            return paused, claimed, listed, len(await q.claim("q"))

    paused, claimed, listed, after = asyncio.run(main())
    assert (paused, claimed, list(listed), after) == (True, [], ["q"], 1)


def test_a_bad_queue_name_is_one_line_and_changes_nothing(queue: Queue, dsn: str) -> None:
    for bad in ("", "  ", "x" * 201, "a\x00b", 42):
        with pytest.raises(BadInput):
            queue.pause(bad)  # type: ignore[arg-type]
    assert queue.paused() == {}


def test_an_older_database_says_to_run_init(queue: Queue, dsn: str) -> None:
    execute(dsn, "DROP TABLE pgqueue_paused")
    with pytest.raises(NotInstalled, match=r"pgqueue_paused does not exist.*pgqueue init"):
        queue.claim("q")
    with pytest.raises(NotInstalled, match="pgqueue init"):
        Worker(lambda job: None, queue="q", dsn=dsn).start()
    assert "created pgqueue_paused (paused queues)" in queue.install().changed
    assert queue.claim("q") == []


def test_the_command_line_pauses_lists_and_resumes(dsn: str) -> None:
    def run(*args: str) -> str:
        done = subprocess.run(
            [PGQUEUE, "--dsn", dsn, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "no queue is paused" in run("pause")
    assert "'emails': paused" in run("pause", "emails")
    assert "'emails': paused since" in run("pause")
    assert "queue 'emails' is paused" in run("stats")
    assert {"queue": "emails", "status": "paused"}.items() <= json.loads(run("stats", "--json"))[
        -1
    ].items()
    assert "'emails': resumed" in run("resume", "emails")
    assert "'emails': was not paused" in run("resume", "emails")
