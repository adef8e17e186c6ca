"""Checks for notebook 18, inside the worker: the claims and completion statements a
one-lane worker sends for a backlog, with hints in tiers (what the run shows first, the fix
at the second slip of a kind)."""

from __future__ import annotations

from collections.abc import Callable

from .. import engine_lab, lab
from . import expect, passed
from .tiers import Hints

HINTS = Hints()
BACKLOGS = ((30, 1), (60, 10), (25, 10))  # (jobs, batch), drained by one lane each


def _slip(
    kind: str, predicted: int, measured: int, jobs: int, batch: int, what: str, fragment: str
) -> None:
    """The hint for one wrong count: what the worker sent, then (second time) the fix."""
    if predicted == jobs and batch > 1:
        kind, fragment = f"{kind}-per-job", PER_JOB[kind]
    elif kind == "claims" and predicted == measured + 1:
        kind = "dry-claim"
        fragment = (
            "count the claims that brought jobs: the last one, which finds the queue dry, "
            "brings none and is not counted"
        )
    elif predicted == jobs // batch:
        kind = "last-batch"
        fragment = (
            "a last batch that is only partly filled still costs a claim and a completion "
            "statement: round up, (jobs + batch - 1) // batch"
        )
    HINTS.fail(
        kind,
        f"{jobs} jobs with batch={batch}: the worker sent {measured} {what}, you predicted "
        f"{predicted}",
        fragment,
    )


PER_JOB = {
    "claims": "one claim takes up to batch jobs at once: count claims per batch, not per job",
    "completions": "finished jobs wait in a buffer until their batch is over, then go out "
    "together in one fenced complete_many: count completion statements per batch",
}


def check_statements(predict: Callable[[int, int], tuple[int, int]]) -> None:
    """Drain three backlogs of no-op jobs with a one-lane Worker (``flush_after=5``) in a
    scratch database and compare its claims that returned jobs and its completion
    statements (from its event record) with ``predict(jobs, batch)``."""
    expect(callable(predict), "statements should be a function of (jobs, batch)")
    predicted = {}
    for jobs, batch in BACKLOGS:
        got = predict(jobs, batch)
        expect(
            isinstance(got, tuple)
            and len(got) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in got),
            f"statements({jobs}, {batch}) should return two whole numbers, (claims, "
            f"completions); it returned {got!r}",
        )
        predicted[jobs, batch] = got
    measured = {}
    with lab.scratch_database("course_18_exercise") as dsn:
        for jobs, batch in BACKLOGS:
            queue = f"jobs-{jobs}-batch-{batch}"
            engine_lab.enqueue_noops(dsn, jobs, queue)
            drained = engine_lab.drain(dsn, queue, concurrency=1, batch=batch, flush_after=5.0)
            measured[jobs, batch] = (drained["claims"], drained["completions"])
            rule = (jobs + batch - 1) // batch
            expect(
                drained["jobs"] == jobs and measured[jobs, batch] == (rule, rule),
                f"the worker's run over {jobs} jobs was disturbed (a batch's completions left "
                "before it was over on a busy machine): run the check again",
            )
    for (jobs, batch), (claims, completions) in measured.items():
        guess_claims, guess_completions = predicted[jobs, batch]
        if guess_claims != claims:
            fragment = (
                "one lane holds at most batch jobs whose handler has not ended, and claims in "
                "whole batches: it claims again once the last job of its batch has ended"
            )
            _slip("claims", guess_claims, claims, jobs, batch, "claims that brought jobs", fragment)
        if guess_completions != completions:
            fragment = "one completion statement per claimed batch, sent when its last job ends"
            _slip(
                "completions",
                guess_completions,
                completions,
                jobs,
                batch,
                "completion statements",
                fragment,
            )
    shown = ", ".join(f"{j} jobs by {b}: {c[0]} + {c[1]}" for (j, b), c in measured.items())
    passed(
        f"claims + completion statements: {shown}. One lane claims a whole batch once the "
        "last job of the one before has ended, so each batch costs one claim and one completion"
    )
