"""Notebook 09's exercise, against a real server: the query that finds the sessions holding
the vacuum horizon passes, and each plausible wrong query fails with a hint of its own."""

from __future__ import annotations

import pytest

from pgqueue.course.checks import ExerciseFailed, nb09

RIGHT = """
SELECT pid, application_name, backend_xid, backend_xmin
FROM pg_stat_activity
WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL) AND pid <> pg_backend_pid()
ORDER BY greatest(age(backend_xid), age(backend_xmin)) DESC
"""
WRONG = {
    "state": "SELECT pid, application_name FROM pg_stat_activity "
    "WHERE state = 'idle in transaction' ORDER BY xact_start",
    "own": RIGHT.replace(" AND pid <> pg_backend_pid()", ""),
    "xid": RIGHT.replace("backend_xid IS NOT NULL OR ", ""),
    "xmin": RIGHT.replace(" OR backend_xmin IS NOT NULL", ""),
    "order": RIGHT.replace(" DESC", ""),
}
# Without ORDER BY the rows come in pg_stat_activity's own order (passed before: the check
# opened its sessions oldest first, and the view listed them so).
UNORDERED = RIGHT.replace("ORDER BY greatest(age(backend_xid), age(backend_xmin)) DESC", "")


def test_the_right_query_passes(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    nb09.check_horizon_query(dsn, RIGHT)
    assert "\N{CHECK MARK}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", sorted(WRONG))
def test_each_wrong_query_gets_its_own_hint(dsn: str, kind: str) -> None:
    nb09.HINTS.seen.clear()
    messages = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            nb09.check_horizon_query(dsn, WRONG[kind])
        messages.append(str(info.value))
    assert set(nb09.HINTS.seen) == {kind}, messages
    assert "Hint:" not in messages[0] and "Hint:" in messages[1]


def test_a_query_without_order_by_fails_on_the_order(dsn: str) -> None:
    nb09.HINTS.seen.clear()
    with pytest.raises(
        ExerciseFailed, match=r"the one that holds the horizon furthest back|no ORDER BY"
    ):
        nb09.check_horizon_query(dsn, UNORDERED)
    assert set(nb09.HINTS.seen) == {"order"}


def test_a_query_without_the_names_is_told_what_to_return(dsn: str) -> None:
    with pytest.raises(ExerciseFailed, match="return application_name"):
        nb09.check_horizon_query(dsn, "SELECT pid FROM pg_stat_activity")


def test_the_slow_queue_diagnosis_blames_the_session_holding_the_horizon() -> None:
    from pgqueue.course.slow_queue import SlowQueue

    slow = SlowQueue(churn=2000)
    try:
        seen = slow.wait_for_autovacuum()  # autovacuum runs, and removes nothing
        assert seen["n_dead_tup"] >= 2000
        nb09.DIAGNOSIS_HINTS.seen.clear()
        with pytest.raises(ExerciseFailed, match="holds neither a transaction id nor a snapshot"):
            nb09.check_diagnosis(slow, "admin console")  # idle in transaction, holds nothing
        with pytest.raises(ExerciseFailed, match="one of the shop's sessions"):
            nb09.check_diagnosis(slow, "worker")
        fixed = nb09.check_diagnosis(slow, "nightly report")
        assert fixed["dead after"] < fixed["dead before"] / 10
        assert fixed["buffers after"] < fixed["buffers before"] / 2
    finally:
        slow.close()
    assert not slow.home.exists()
