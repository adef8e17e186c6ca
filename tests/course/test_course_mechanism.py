"""The exercises in which the learner writes the queue's mechanism (notebooks 01, 03 and
04), against a real server: each solution passes, and each plausible wrong answer fails
with a hint of its own, the symptom first and the fragment at the second slip."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgqueue import Job
from pgqueue.course.checks import ExerciseFailed, nb01, nb03, nb04
from pgqueue.course.checks.tiers import Hints


def slips(check: Any, hints: Hints, *args: Any) -> tuple[str, str]:
    """The messages of two runs of a check that must fail, from fresh hint tiers."""
    hints.seen.clear()
    found = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            check(*args)
        found.append(str(info.value))
    first, second = found
    assert "Hint:" not in first and "fix it and run the check again" in first
    assert second.startswith(first.partition(" (fix it")[0]) and "Hint:" in second
    return first, second


def kinds(hints: Hints) -> set[str]:
    return set(hints.seen)


# Notebook 01: the ready index.
READY_INDEX = "CREATE INDEX mine ON jobs (queue, priority DESC, run_at, id) WHERE status = 'ready'"
WRONG_INDEXES = {
    "no-where": "CREATE INDEX mine ON jobs (queue, priority DESC, run_at, id)",
    "where": "CREATE INDEX mine ON jobs (queue, priority DESC, run_at, id) WHERE status <> 'done'",
    "queue-first": "CREATE INDEX mine ON jobs (priority DESC, run_at, id) WHERE status = 'ready'",
    "sorts": "CREATE INDEX mine ON jobs (queue, run_at) WHERE status = 'ready'",
}


@pytest.fixture
def course_server(admin_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """nb01's check makes a scratch database of its own on the course's server: this one."""
    monkeypatch.setenv("PGQUEUE_DSN", admin_dsn)


@pytest.mark.slow  # nine scratch databases of 20,000 rows each: 2 to 6 s
@pytest.mark.usefixtures("course_server")
def test_the_ready_index_check_passes_the_solution_and_tells_each_slip_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nb01.check_ready_index(READY_INDEX)
    assert "holds only the 40 ready jobs" in capsys.readouterr().out
    seen = {}
    for kind, wrong in WRONG_INDEXES.items():
        first, second = slips(nb01.check_ready_index, nb01.HINTS, wrong)
        assert kinds(nb01.HINTS) == {kind}, (wrong, first)
        seen[kind] = (first, second)
    assert len({first for first, _ in seen.values()}) == len(seen), "each slip, its own hint"
    first, second = seen["no-where"]
    assert "WHERE status = 'ready'" not in first, "the first slip shows the symptom only"
    assert "WHERE status = 'ready'" in second, "the second shows the fragment"


# Notebook 03: the heartbeat.
HEARTBEAT = """
UPDATE jobs SET lease_until = now() + make_interval(secs => %(lease)s)
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
"""
WRONG_HEARTBEATS = {
    "renew": "UPDATE jobs SET lease_until = lease_until"
    " WHERE id = %(id)s AND fence = %(fence)s AND status = 'running' AND %(lease)s > 0",
    "id": "UPDATE jobs SET lease_until = now() + make_interval(secs => %(lease)s)"
    " WHERE fence = %(fence)s AND status = 'running' AND %(id)s > 0",
    "from-now": "UPDATE jobs SET lease_until = lease_until + make_interval(secs => %(lease)s)"
    " WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'",
    "only-lease": "UPDATE jobs SET lease_until = now() + make_interval(secs => %(lease)s),"
    " fence = fence + 1 WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'",
    "lease-param": "UPDATE jobs SET lease_until = now() + interval '30 seconds'"
    " WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'",
    "fence": "UPDATE jobs SET lease_until = now() + make_interval(secs => %(lease)s)"
    " WHERE id = %(id)s AND status = 'running' AND %(fence)s > 0",
    "status": "UPDATE jobs SET lease_until = now() + make_interval(secs => %(lease)s)"
    " WHERE id = %(id)s AND fence = %(fence)s",
}


def test_the_heartbeat_check_passes_the_solution_and_tells_each_slip_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb03.check_heartbeat(dsn, HEARTBEAT)
    assert "moved the holder's lease" in capsys.readouterr().out
    seen = {}
    for kind, wrong in WRONG_HEARTBEATS.items():
        first, _ = slips(nb03.check_heartbeat, nb03.HEARTBEAT_HINTS, dsn, wrong)
        assert kinds(nb03.HEARTBEAT_HINTS) == {kind}, (wrong, first)
        seen[kind] = first
    assert len(set(seen.values())) == len(seen), "each slip has its own hint"


# Notebook 03: the reaper.
REAP = """
UPDATE jobs
SET status      = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END,
    run_at      = now(),
    lease_until = NULL,
    finished_at = CASE WHEN attempts >= max_attempts THEN now() END
WHERE status = 'running' AND lease_until < now()
RETURNING id, status
"""
SET_STATUS = "SET status = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END,"
WHERE_EXPIRED = "WHERE status = 'running' AND lease_until < now() RETURNING id, status"
WRONG_REAPERS = {
    "live-lease": f"UPDATE jobs {SET_STATUS} lease_until = NULL,"
    " finished_at = CASE WHEN attempts >= max_attempts THEN now() END"
    " WHERE status = 'running' RETURNING id, status",
    "not-running": f"UPDATE jobs {SET_STATUS} lease_until = NULL,"
    " finished_at = CASE WHEN attempts >= max_attempts THEN now() END"
    " WHERE lease_until < now() RETURNING id, status",
    "dead": "UPDATE jobs SET status = 'ready', lease_until = NULL " + WHERE_EXPIRED,
    "finished-at": f"UPDATE jobs {SET_STATUS} lease_until = NULL {WHERE_EXPIRED}",
    "finished-early": f"UPDATE jobs {SET_STATUS} lease_until = NULL, finished_at = now() "
    + WHERE_EXPIRED,
    "lease-left": f"UPDATE jobs {SET_STATUS}"
    " finished_at = CASE WHEN attempts >= max_attempts THEN now() END " + WHERE_EXPIRED,
    "attempts": f"UPDATE jobs {SET_STATUS} lease_until = NULL, attempts = attempts + 1,"
    " finished_at = CASE WHEN attempts >= max_attempts THEN now() END " + WHERE_EXPIRED,
    # Both passed the check before: a reaper that takes leases a few seconds early, and one
    # that leaves run_at alone (the returned job jumps ahead of those waiting; notebook 17).
    "early": REAP.replace("lease_until < now()", "lease_until < now() + interval '5 seconds'"),
    "run-at": REAP.replace("    run_at      = now(),\n", ""),
}
assert all(wrong != REAP for wrong in WRONG_REAPERS.values())


def test_the_reaper_check_passes_the_solution_and_checks_finished_at(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb03.check_reaper(dsn, REAP)
    assert "job 2 (dead, finished now" in capsys.readouterr().out
    seen = {}
    for kind, wrong in WRONG_REAPERS.items():
        first, _ = slips(nb03.check_reaper, nb03.REAPER_HINTS, dsn, wrong)
        assert kinds(nb03.REAPER_HINTS) == {kind}, (wrong, first)
        seen[kind] = first
    assert len(set(seen.values())) == len(seen), "each slip has its own hint"


# Notebook 04: the fenced complete.
COMPLETE = """
UPDATE jobs SET status = 'done', lease_until = NULL, finished_at = now()
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
"""
DONE = "UPDATE jobs SET status = 'done', lease_until = NULL, finished_at = now() "
WRONG_COMPLETES = {
    "holder": "UPDATE jobs SET lease_until = NULL, finished_at = now()"
    " WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'",
    "id": DONE + "WHERE fence = %(fence)s AND status = 'running' AND %(id)s > 0",
    "lease": "UPDATE jobs SET status = 'done', finished_at = now()"
    " WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'",
    "finished-at": "UPDATE jobs SET status = 'done', lease_until = NULL"
    " WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'",
    "status": DONE + "WHERE id = %(id)s AND fence = %(fence)s",
    "fence": DONE + "WHERE id = %(id)s AND status = 'running' AND %(fence)s > 0",
}


def test_the_complete_check_passes_the_solution_and_tells_each_slip_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb04.check_fenced_complete(dsn, COMPLETE)
    assert "your complete made the holder's job done" in capsys.readouterr().out
    seen = {}
    for kind, wrong in WRONG_COMPLETES.items():
        first, _ = slips(nb04.check_fenced_complete, nb04.COMPLETE_HINTS, dsn, wrong)
        assert kinds(nb04.COMPLETE_HINTS) == {kind}, (wrong, first)
        seen[kind] = first
    assert len(set(seen.values())) == len(seen), "each slip has its own hint"


# Notebook 04: the side-table write.
WRITE = """
INSERT INTO reports (id, body, job_id, fence)
VALUES (%(id)s, %(body)s, %(job_id)s, %(fence)s)
ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, fence = EXCLUDED.fence
WHERE reports.job_id = EXCLUDED.job_id AND reports.fence <= EXCLUDED.fence
"""
UPSERT = (
    "INSERT INTO reports (id, body, job_id, fence) VALUES (%(id)s, %(body)s, %(job_id)s,"
    " %(fence)s) ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body"
)
WRONG_WRITES = {
    "insert": "UPDATE reports SET body = %(body)s, fence = %(fence)s"
    " WHERE id = %(id)s AND job_id = %(job_id)s AND fence <= %(fence)s",
    "store": "INSERT INTO reports (id, body, fence) VALUES (%(id)s, %(body)s, %(fence)s)"
    " ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, fence = EXCLUDED.fence"
    " WHERE reports.fence <= EXCLUDED.fence AND %(job_id)s > 0",
    # The reference text's rule: a strictly newer fence, no job id.
    "equal": UPSERT + ", fence = EXCLUDED.fence WHERE reports.fence < EXCLUDED.fence",
    "fence-stored": UPSERT + " WHERE reports.job_id = EXCLUDED.job_id"
    " AND reports.fence <= EXCLUDED.fence",
    "stale": UPSERT + ", fence = EXCLUDED.fence WHERE reports.job_id = EXCLUDED.job_id",
    "other-job": UPSERT + ", fence = EXCLUDED.fence WHERE reports.fence <= EXCLUDED.fence",
}


def test_the_side_write_check_passes_the_solution_and_tells_each_slip_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb04.check_side_write(dsn, WRITE)
    assert "refused the stale fence 1 and job 8's write" in capsys.readouterr().out
    seen = {}
    for kind, wrong in WRONG_WRITES.items():
        first, _ = slips(nb04.check_side_write, nb04.WRITE_HINTS, dsn, wrong)
        assert kinds(nb04.WRITE_HINTS) == {kind}, (wrong, first)
        seen[kind] = first
    assert len(set(seen.values())) == len(seen), "each slip has its own hint"


# Notebook 04: the learner's statements in a worker's loop, through the paused-worker story.
def work(conn: psycopg.Connection, job: Job, body: str) -> tuple[bool, bool]:
    params = {"id": 1, "body": body, "job_id": job.id, "fence": job.fence}
    wrote = conn.execute(WRITE, params).rowcount == 1
    done = conn.execute(COMPLETE, {"id": job.id, "fence": job.fence}).rowcount == 1
    return wrote, done


def work_with(write: str, complete: str) -> Any:
    def run(conn: psycopg.Connection, job: Job, body: str) -> tuple[bool, bool]:
        params = {"id": 1, "body": body, "job_id": job.id, "fence": job.fence}
        wrote = conn.execute(write, params).rowcount == 1
        return wrote, conn.execute(complete, {"id": job.id, "fence": job.fence}).rowcount == 1

    return run


def test_the_learners_statements_survive_the_paused_worker_and_broken_ones_do_not(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb04.check_paused_worker(dsn, work)
    out = capsys.readouterr().out
    assert "the report is B's" in out and "A's write into the still missing row went in" in out
    unfenced = work_with(WRONG_WRITES["stale"], WRONG_COMPLETES["fence"])
    first, _ = slips(nb04.check_paused_worker, nb04.STORY_HINTS, dsn, unfenced)
    assert kinds(nb04.STORY_HINTS) == {"story-A wakes after B"}
    assert "report ('report by A', 1)" in first

    def always_fine(conn: psycopg.Connection, job: Job, body: str) -> tuple[bool, bool]:
        work(conn, job, body)
        return True, True  # ignores the row counts

    first, _ = slips(nb04.check_paused_worker, nb04.STORY_HINTS, dsn, always_fine)
    assert kinds(nb04.STORY_HINTS) == {"a-told"}

    def complete_first(conn: psycopg.Connection, job: Job, body: str) -> tuple[bool, bool]:
        # Right statements, wrong order: passed before, since nothing came between them.
        completed = conn.execute(COMPLETE, {"id": job.id, "fence": job.fence}).rowcount == 1
        row = {"id": 1, "body": body, "job_id": job.id, "fence": job.fence}
        return conn.execute(WRITE, row).rowcount == 1, completed

    first, _ = slips(nb04.check_paused_worker, nb04.STORY_HINTS, dsn, complete_first)
    assert kinds(nb04.STORY_HINTS) == {"order"}
    assert "left the job done and report 1 missing" in first


FAIL = """
UPDATE jobs
SET status      = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END,
    run_at      = now() + make_interval(secs => %(backoff)s * power(2, attempts)),
    lease_until = NULL,
    fence       = fence + 1,
    last_error  = %(error)s,
    finished_at = CASE WHEN attempts >= max_attempts THEN now() END
WHERE id = %(id)s AND fence = %(fence)s AND status = 'running'
"""
FINISHED = "finished_at = CASE WHEN attempts >= max_attempts THEN now() END"
WRONG_FAILS = {
    # The reference text's fail: the fence stays where it is.
    "raise": FAIL.replace("fence       = fence + 1,", ""),
    "by-one": FAIL.replace("fence + 1", "fence + 2"),
    "attempts": FAIL.replace("fence + 1,", "fence + 1, attempts = attempts + 1,"),
    "lease": FAIL.replace("lease_until = NULL,", ""),
    "error": FAIL.replace("last_error  = %(error)s", "last_error = 'failed' || %(error)s"),
    "finished-early": FAIL.replace(FINISHED, "finished_at = now()"),
    "backoff": FAIL.replace("power(2, attempts)", "attempts"),
    "stale": FAIL.replace("fence = %(fence)s AND", "%(fence)s > 0 AND"),
    "status": FAIL.replace("AND status = 'running'", ""),
    "finished-at": FAIL.replace(",\n    " + FINISHED, ""),
}


def test_the_fail_check_passes_the_solution_and_tells_each_slip_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb04.check_fenced_fail(dsn, FAIL)
    assert "sent a job on its last attempt dead, finished now" in capsys.readouterr().out
    seen = {}
    for kind, wrong in WRONG_FAILS.items():
        assert wrong != FAIL, kind
        first, _ = slips(nb04.check_fenced_fail, nb04.FAIL_HINTS, dsn, wrong)
        assert kinds(nb04.FAIL_HINTS) == {kind}, (wrong, first)
        seen[kind] = first
    assert len(set(seen.values())) == len(seen), "each slip has its own hint"


# "Break it" exercises: the reader's statement with one clause taken out, its damage shown
# live, and the reader's prediction compared with it.


def test_03_reaper_without_run_at_lets_the_returned_job_jump_the_line(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "run_at" not in nb03.without_run_at(REAP)
    right = {"next_claimed": 1, "job_1_due_s_ago": 60}
    nb03.check_reaper_without_run_at(dsn, REAP, right)
    assert "jumps ahead of every job waiting" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="it jumps ahead of jobs 2 and 3"):
        nb03.check_reaper_without_run_at(dsn, REAP, right | {"next_claimed": 2})
    with pytest.raises(ExerciseFailed, match="hold run_at = now"):
        nb03.check_reaper_without_run_at(dsn, nb03.without_run_at(REAP), right)


def test_04_complete_without_status_completes_a_dead_job(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    right = {"a_complete": True, "status": "done"}
    nb04.check_complete_without_status(dsn, COMPLETE, right)
    assert "made it done" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="the reaper does not raise the fence"):
        nb04.check_complete_without_status(dsn, COMPLETE, right | {"a_complete": False})
    with pytest.raises(ExerciseFailed, match="given up on"):
        nb04.check_complete_without_status(dsn, COMPLETE, right | {"status": "dead"})
