"""Checks for notebook 06, failures and backoff: a retry schedule that fits a budget, with
hints in tiers (what the schedule does first, the fix at the second slip of a kind)."""

from __future__ import annotations

from ...errors import BadInput
from ...queue import Queue
from ..stories import sandbox
from . import expect, passed
from .tiers import Hints

HINTS = Hints()

OUTAGE = 10 * 60  # seconds: the longest outage the retries must outlast
BUDGET = 60 * 60  # seconds: by then the job must have given up (gone dead)
MOST_ATTEMPTS = 8  # the provider asks for no more calls than this per order


def schedule(dsn: str, backoff: float, max_attempts: int) -> list[float]:
    """The delays (seconds) pgqueue's own ``fail`` statement gives a job that fails every
    attempt, with this ``backoff`` and ``max_attempts``: one per retry, until it is dead.
    Runs against a private jobs table, in one transaction (so ``now()`` stands still),
    setting each retry's ``run_at`` back to now instead of waiting for it."""
    delays: list[float] = []
    with sandbox(dsn) as conn:
        q = Queue(conn)
        q.enqueue({"order": 42}, queue="payments", max_attempts=max_attempts)
        while True:
            [job] = q.claim("payments", lease=30)
            q.fail(job, "ConnectionError: the payment service is down", backoff=backoff)
            if job.status == "dead":
                return delays
            assert job.retry_in is not None
            delays.append(job.retry_in)
            conn.execute("UPDATE jobs SET run_at = now()")  # time passes: the retry is due


def check_retry_budget(dsn: str, backoff: object, max_attempts: object) -> None:
    """Check that ``backoff`` and ``max_attempts`` keep retrying through a 10-minute outage,
    give up within the hour, and call the provider at most 8 times."""
    expect(
        isinstance(backoff, int | float) and not isinstance(backoff, bool) and backoff > 0,
        f"the backoff should be a number of seconds above 0, got {backoff!r}",
    )
    expect(
        isinstance(max_attempts, int) and not isinstance(max_attempts, bool) and max_attempts >= 1,
        f"max_attempts should be a whole number of attempts, at least 1, got {max_attempts!r}",
    )
    assert isinstance(backoff, int | float) and isinstance(max_attempts, int)
    hints = HINTS
    hints.expect(
        max_attempts <= MOST_ATTEMPTS,
        "attempts",
        f"{max_attempts} attempts would call the provider {max_attempts} times for one order, "
        f"and it asks for at most {MOST_ATTEMPTS}",
        f"keep max_attempts at {MOST_ATTEMPTS} or fewer and make each wait longer instead: a "
        "larger backoff",
    )
    try:
        delays = schedule(dsn, float(backoff), max_attempts)
    except BadInput as exc:
        expect(False, f"pgqueue refused the backoff: {exc}")
        raise
    last = sum(delays)
    waits = ", ".join(f"{d:g}" for d in delays) or "none"
    hints.expect(
        last >= OUTAGE,
        "short",
        f"with backoff {backoff:g} s and {max_attempts} attempts the last attempt starts "
        f"{last:g} s after the first failure (waits: {waits} s): a {OUTAGE // 60}-minute outage "
        "outlasts every retry",
        "after attempt k fails the job waits backoff * 2**k, so the last attempt starts "
        "backoff * (2**max_attempts - 2) s after the first failure: a larger backoff, or more "
        f"attempts (up to {MOST_ATTEMPTS})",
    )
    hints.expect(
        last <= BUDGET,
        "long",
        f"with backoff {backoff:g} s and {max_attempts} attempts the last attempt starts "
        f"{last / 60:.0f} minutes after the first failure (waits: {waits} s): the job should "
        f"have given up within {BUDGET // 60} minutes",
        "the last attempt starts backoff * (2**max_attempts - 2) s after the first failure: a "
        "smaller backoff, or fewer attempts",
    )
    passed(
        f"waits of {waits} s: the last of {max_attempts} attempts starts {last / 60:.1f} min "
        f"after the first failure, after a {OUTAGE // 60}-minute outage and within the hour"
    )
