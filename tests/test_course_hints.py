"""Hints in tiers for the exercises of notebooks 02, 05, 06, 08, 09, 10, 11, 12 and 13,
against a real server: each solution passes, and each plausible wrong answer fails with a
hint of its own kind, the symptom first and the fix at the second slip of that kind."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pgqueue.course.checks import ExerciseFailed, nb02
from pgqueue.course.checks.tiers import Hints


def slips(check: Any, hints: Hints, *args: Any, **kwargs: Any) -> tuple[str, str, str]:
    """The messages of two runs of a check that must fail, from fresh hint tiers, and the
    one kind of mistake both runs counted."""
    hints.seen.clear()
    found = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            check(*args, **kwargs)
        found.append(str(info.value))
    first, second = found
    assert "Hint:" not in first and "fix it and run the check again" in first, first
    assert second.startswith(first.partition(" (fix it")[0]) and "Hint:" in second, second
    assert len(hints.seen) == 1 and set(hints.seen.values()) == {2}, hints.seen
    [kind] = hints.seen
    return first, second, kind


def distinct(results: dict[str, tuple[str, str, str]]) -> None:
    """Each wrong answer was its own kind of mistake, with its own symptom and hint."""
    kinds = [kind for _, _, kind in results.values()]
    assert len(set(kinds)) == len(kinds), kinds
    hints = [second.partition("Hint: ")[2] for _, second, _ in results.values()]
    assert len(set(hints)) == len(hints), hints


# Notebook 02: the claim.
CLAIM = """
UPDATE jobs
SET status      = 'running',
    attempts    = attempts + 1,
    fence       = fence + 1,
    lease_until = now() + make_interval(secs => %(lease)s)
WHERE id IN (
  SELECT id FROM jobs
  WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
  ORDER BY priority DESC, run_at, id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
RETURNING id, fence, attempts, lease_until
"""
WRONG_CLAIMS = {
    "skip-locked": CLAIM.replace(" SKIP LOCKED", ""),
    "for-update": CLAIM.replace("  FOR UPDATE SKIP LOCKED\n", ""),
    "oldest": CLAIM.replace("run_at, id", "run_at DESC, id"),
    "priority": CLAIM.replace("priority DESC, ", ""),
    "fence": CLAIM.replace("fence + 1", "fence"),
    "attempts": CLAIM.replace("attempts + 1", "attempts"),
    "lease-param": CLAIM.replace("make_interval(secs => %(lease)s)", "interval '30 seconds'"),
    "run-at": CLAIM.replace(" AND run_at <= now()", ""),
    "limit": CLAIM.replace("LIMIT %(limit)s", "LIMIT 5"),
}


def test_the_claim_check_passes_the_solution_and_tells_each_slip_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb02.check_claim(dsn, CLAIM)
    assert "two sessions at once got different jobs" in capsys.readouterr().out
    results = {}
    for want, wrong in WRONG_CLAIMS.items():
        assert wrong != CLAIM, want
        results[want] = slips(nb02.check_claim, nb02.CLAIM_HINTS, dsn, wrong)
        assert results[want][2] == want, (want, results[want])
    distinct(results)
    assert "it runs twice" in results["for-update"][0]
    assert "FOR UPDATE SKIP LOCKED" in results["for-update"][1]
    assert "stand in line" in results["skip-locked"][0]
    assert "fence + 1" in results["fence"][1] and "fence + 1" not in results["fence"][0]


def test_the_broken_claims_race_as_the_notebook_says(dsn: str) -> None:
    assert nb02.race(dsn, CLAIM)[:3] == ([11], [12], False)
    no_skip = nb02.race(dsn, nb02.broken(CLAIM, "SKIP LOCKED"))
    assert no_skip.b_waited and no_skip.a_ids != no_skip.b_ids
    no_lock = nb02.race(dsn, nb02.broken(CLAIM, "FOR UPDATE"))
    assert re.search(r"FOR\s+UPDATE", nb02.broken(CLAIM, "FOR UPDATE")) is None
    assert no_lock.b_waited and no_lock.a_ids == no_lock.b_ids
    assert no_lock.fences[no_lock.a_ids[0]] == 2
