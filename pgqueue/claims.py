"""A claim as the engine keeps it: the job, its lane and batch, and when its handler began."""

from __future__ import annotations

from dataclasses import dataclass

from .job import Job

Key = tuple[int, int]  # (job id, fence): one claim of one job


def key_of(job: Job) -> Key:
    """What the engine files a claim under. Not the id alone: a job failed with no backoff
    can be claimed again by this worker before the first claim's bookkeeping is over."""
    return (job.id, job.fence)


@dataclass(eq=False)
class Batch:
    left: int  # jobs of one claim whose handlers have not ended yet


@dataclass(eq=False)
class Claim:
    """A claimed job this worker has not finished: the job as its handler sees it (a
    ``Job`` for a plain handler, an ``AsyncJob`` for a coroutine), its lane and batch."""

    job: Job
    slot: int
    lane: str
    batch: Batch
    plain: bool
    started: float | None = None  # time.monotonic() when the handler began
    ended: float | None = None  # time.monotonic() when the handler returned or raised
    timeout: float | None = None  # this job's (its task's, else the worker's)
    expiry_seen: bool = False  # its lease running out here was reported
    timed_out: bool = False  # failed at its timeout; what its handler does later is dropped
    result: str | None = None  # the handler's return value as JSON text, to store with it
