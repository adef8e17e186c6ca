"""The exercises in which the learner writes the queue's mechanism (notebooks 01, 03 and
04), against a real server: each solution passes, and each plausible wrong answer fails
with a hint of its own, the symptom first and the fragment at the second slip."""

from __future__ import annotations

from typing import Any

import pytest

from pgqueue.course.checks import ExerciseFailed, nb01, nb03
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
}


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
