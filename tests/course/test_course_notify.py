"""The NOTIFY lesson's prediction exercise, against a real server: the right prediction
passes, and each plausible wrong one fails with a hint of its own."""

from __future__ import annotations

import pytest

from pgqueue.course.checks import ExerciseFailed, nb08

WRONG = {
    "commit": [],
    "fold": ["emails", "emails", "reports", "emails"],
    "distinct": ["emails"],
    "order": ["reports", "emails"],
}


def test_the_listener_hears_one_notification_per_queue(dsn: str) -> None:
    assert nb08.heard(dsn) == ["emails", "reports"]


def test_the_right_prediction_passes(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    nb08.check_heard(dsn, ["emails", "reports"])
    assert "\N{CHECK MARK}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", sorted(WRONG))
def test_each_wrong_prediction_gets_its_own_hint(dsn: str, kind: str) -> None:
    nb08.HINTS.seen.clear()
    messages = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            nb08.check_heard(dsn, WRONG[kind])
        messages.append(str(info.value))
    assert set(nb08.HINTS.seen) == {kind}, messages
    assert "Hint:" not in messages[0] and "Hint:" in messages[1]
