"""The exceptions pgqueue raises; each message is one line saying what to do."""

from __future__ import annotations

import math
import numbers
from datetime import timedelta

MAX_RETRY_DELAY = 24 * 3600.0  # seconds: the longest delay fail's SQL takes (a day)


class PgQueueError(Exception):
    """Base class: something pgqueue cannot do, with a one-line reason."""


class BadInput(PgQueueError, ValueError):
    """A value given to pgqueue is not usable (nothing was written)."""


class NotInstalled(PgQueueError):
    """The jobs table does not exist in this database yet."""


class InstallBlocked(PgQueueError):
    """``install()`` gave up waiting for a lock (its ``lock_timeout``), most likely held by
    a long transaction on ``jobs``: run it again when that transaction ends."""


class ConnectError(PgQueueError):
    """No PostgreSQL server could be reached at the configured address."""


class KeyRace(PgQueueError):
    """A job's key was taken by an enqueue that committed while this statement ran, so
    the unique index stopped it (nothing was written); running it again settles it."""


class SlotRace(PgQueueError):
    """A claim under a per-group limit chose a slot that a claim committed while it ran
    had taken, so the unique index stopped it (nothing was claimed). ``Queue.claim`` claims
    again by itself; inside your own transaction (now aborted) it raises this."""


class LeaseLost(PgQueueError):
    """This worker no longer holds the job: its fence is stale. Stop and discard the work."""


class FenceConflict(PgQueueError):
    """A fenced write met a row written by another job: fences of different jobs are not
    comparable, so nothing was written. Key the row by job, or use one job per row."""


class JobFailed(PgQueueError):
    """``Queue.result``: the job ended without a result, ``status`` 'dead' (its attempts
    used, or GiveUp) or 'cancelled'; ``last_error`` says why (None if nothing was recorded)."""

    def __init__(self, job_id: int, status: str, last_error: str | None) -> None:
        self.job_id = job_id
        self.status = status
        self.last_error = last_error
        why = (last_error or "").strip().splitlines()[:1] or ["no error recorded"]
        super().__init__(f"job {job_id} is {status}: {why[0]}")


class GiveUp(Exception):
    """Raise from a handler to send its job dead now, whatever attempts are left."""


class RetryAfter(Exception):
    """Raise from a handler to retry its job after ``seconds`` (a number or a
    ``timedelta``) instead of the backoff. It counts as an attempt, so ``max_attempts``
    still bounds a job that keeps asking. A time already past (a negative delay) retries at
    once; more than a day waits a day. Anything else is a ``TypeError`` or ``ValueError``
    raised in the handler, which fails the job with that error (and the backoff)."""

    def __init__(self, seconds: float | timedelta, reason: str = "") -> None:
        asked = _as_seconds(seconds)
        self.seconds = min(max(asked, 0.0), MAX_RETRY_DELAY)
        said = f"retry after {self.seconds:g} s"
        if self.seconds != asked:
            said += f" (asked for {asked:g} s)"
        super().__init__(reason or said)


def _as_seconds(seconds: object) -> float:
    """A delay given as a number or a ``timedelta``, in seconds (not NaN)."""
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"RetryAfter takes seconds, a number or a timedelta; got {seconds!r}")
    if math.isnan(seconds):
        raise ValueError("RetryAfter takes seconds, a number or a timedelta; got NaN")
    return float(seconds)


def retry_delay(exc: RetryAfter) -> float | None:
    """The delay a ``RetryAfter`` asks for, checked again from 0 to a day (its ``seconds``
    may have been changed after it was made); None, so the backoff applies, if unusable."""
    try:
        return min(max(_as_seconds(exc.seconds), 0.0), MAX_RETRY_DELAY)
    except (TypeError, ValueError):
        return None
