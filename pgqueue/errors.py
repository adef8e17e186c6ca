"""The exceptions pgqueue raises; each message is one line saying what to do."""

from __future__ import annotations


class PgQueueError(Exception):
    """Base class: something pgqueue cannot do, with a one-line reason."""


class BadInput(PgQueueError, ValueError):
    """A value given to pgqueue is not usable (nothing was written)."""


class NotInstalled(PgQueueError):
    """The jobs table does not exist in this database yet."""


class ConnectError(PgQueueError):
    """No PostgreSQL server could be reached at the configured address."""


class LeaseLost(PgQueueError):
    """This worker no longer holds the job: its fence is stale. Stop and discard the work."""


class FenceConflict(PgQueueError):
    """A fenced write met a row written by another job: fences of different jobs are not
    comparable, so nothing was written. Key the row by job, or use one job per row."""


class GiveUp(Exception):
    """Raise from a handler to send its job dead now, whatever attempts are left."""


class RetryAfter(Exception):
    """Raise from a handler to retry its job after ``seconds`` instead of the backoff (it
    counts as an attempt, so ``max_attempts`` still bounds a job that keeps asking)."""

    def __init__(self, seconds: float, reason: str = "") -> None:
        super().__init__(reason or f"retry after {seconds:g} s")
        self.seconds = seconds
