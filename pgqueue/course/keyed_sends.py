"""The paused-worker story of notebook 04 replayed against an e-mail service that
de-duplicates on an idempotency key, the key chosen by the caller: what the lesson on
idempotency keys compares (the job id and fence, the job id, no key). The story and the
service are ``pgqueue.course.idempotency``'s; this module only wires them together.
``at_once`` delivers one event from many connections at the same moment (05's enqueue key)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..events import EventLog
from ..job import Job
from ..queue import Queue
from .idempotency import FakeMailer, paused_worker_story
from .lab import run_threads

Key = Callable[[Job], "str | None"]  # the idempotency key a run sends for its job


@dataclass(frozen=True)
class Replay:
    """One replay: the service (its ``calls`` and ``delivered``), the events, the job."""

    service: FakeMailer
    events: EventLog
    job_id: int


def replay(
    dsn: str, key: Key, *, pause: float, lease: float, to: str = "grace@example.com"
) -> Replay:
    """Worker A claims a welcome e-mail job and freezes for ``pause`` seconds, B takes it
    over once A's ``lease`` has run out; both handlers render for 0.2 s and then send with
    ``key(job)`` to a de-duplicating service."""
    events = EventLog()
    service = FakeMailer(dedupe=True, events=events)

    def send(job: Job) -> None:
        time.sleep(0.2)  # render the e-mail
        service.send(job.payload["to"], "Welcome!", key=key(job), job=job)

    job_id, _ = paused_worker_story(
        dsn, send, payload={"to": to}, pause=pause, lease=lease, events=events
    )
    return Replay(service, events, job_id)


def at_once(dsn: str, deliver: Callable[[Queue], int], *, times: int = 8) -> list[int]:
    """``times`` threads, each with a ``Queue`` of its own connection, call ``deliver`` on it
    at the same moment (a barrier); the job ids they got back."""
    start = threading.Barrier(times)
    ids: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            with Queue(dsn) as q:
                start.wait()
                job_id = deliver(q)
            with lock:
                ids.append(job_id)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
            start.abort()

    run_threads([threading.Thread(target=one) for _ in range(times)], errors)
    return ids
