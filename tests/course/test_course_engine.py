"""Notebook 18 (inside the worker): the check of its exercise, a one-lane worker's claims
and completion statements for a backlog, against a real server (the rule passes, and each
plausible wrong count fails with a hint of its own kind, the symptom first and the fix at
the second slip of that kind), and the backlog's figure."""

from __future__ import annotations

import re
from typing import Any

import pandas as pd
import pytest

from pgqueue.course import engine_lab
from pgqueue.course.checks import ExerciseFailed, nb18


@pytest.fixture
def course_server(admin_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check makes a scratch database of its own on this test server."""
    monkeypatch.setenv("PGQUEUE_DSN", admin_dsn)


def batches(jobs: int, batch: int) -> tuple[int, int]:
    rule = (jobs + batch - 1) // batch
    return rule, rule


WRONG = {
    "claims-per-job": lambda jobs, batch: (jobs, batches(jobs, batch)[1]),
    "completions-per-job": lambda jobs, batch: (batches(jobs, batch)[0], jobs),
    "last-batch": lambda jobs, batch: (jobs // batch, jobs // batch),
    "dry-claim": lambda jobs, batch: (batches(jobs, batch)[0] + 1, batches(jobs, batch)[1]),
}


def slips(wrong: Any) -> tuple[str, str, str]:
    """Two runs of the check on one wrong answer, from fresh hint tiers: the symptom, then
    the symptom with its hint, and the one kind of mistake both runs counted."""
    nb18.HINTS.seen.clear()
    found = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            nb18.check_statements(wrong)
        found.append(str(info.value))
    first, second = found
    assert "Hint:" not in first and "fix it and run the check again" in first, first
    assert second.startswith(first.partition(" (fix it")[0]) and "Hint:" in second, second
    [kind] = nb18.HINTS.seen
    return first, second, kind


@pytest.mark.usefixtures("course_server")
def test_the_statements_check_passes_the_rule_and_tells_each_slip_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nb18.check_statements(batches)
    assert "25 jobs by 10: 3 + 3" in capsys.readouterr().out
    results = {want: slips(wrong) for want, wrong in WRONG.items()}
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in WRONG}
    hints = [second.partition("Hint: ")[2] for _, second, _ in results.values()]
    assert len(set(hints)) == len(hints), hints
    first, _, _ = results["last-batch"]
    assert re.search(r"25 jobs with batch=10: the worker sent 3 claims", first), first
    with pytest.raises(ExerciseFailed, match="two whole numbers"):
        nb18.check_statements(lambda jobs, batch: jobs // batch)


def test_the_backlog_figure_draws_each_runs_counts_beside_the_jobs() -> None:
    import matplotlib

    matplotlib.use("Agg")
    backlog = pd.DataFrame(
        {"jobs": [300, 300], "claims": [10, 25], "completions": [10, 300], "commits": [28, 446]},
        index=["buffered", "one by one"],
    )
    fig = engine_lab.plot_backlog(backlog)
    [ax] = fig.axes
    labels = sorted(int(t.get_text().replace(",", "")) for t in ax.texts)
    assert labels == sorted([10, 25, 10, 300, 28, 446])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "300 jobs",
        "buffered",
        "one by one",
    ]
    assert ax.get_yscale() == "log"
