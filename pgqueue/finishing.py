"""How a Worker finishes jobs by fence: complete, fail and release, retried across
reconnects and read back when a reply was lost; the completion buffer that sends a batch's
completions in one statement; and the bookkeeping and one-line logs of how each job ended.

A mixin of ``Worker`` (pgqueue/worker.py), which owns the state used here.
"""

from __future__ import annotations

import threading
import time

import psycopg

from .errors import ConnectError
from .events import EventLog
from .job import Job
from .params import _text
from .parts import (
    _FINISH_TRIES,
    Key,
    _Failure,
    _Held,
    _key,
    _Lane,
    _Link,
    describe,
    end_kind,
    log,
    log_end,
)
from .queue import Queue


class _Finishing:
    """Finishing jobs by fence (mixed into ``Worker``)."""

    # State owned by Worker.__init__.
    _lock: threading.Lock
    _in_flight: dict[Key, _Held]
    _finishing: set[Key]
    _buffer: list[tuple[Job, float]]
    _halted: threading.Event
    events: EventLog
    name: str
    done: int
    failed: int
    dead: int
    rejected: int
    gave_up: int

    def _backoff_for(self, job: Job) -> float:
        """The job's backoff (its task's, else the worker's): _TaskRules provides it."""
        raise NotImplementedError

    def _finish(
        self,
        link: _Link,
        job: Job,
        lane: _Lane,
        action: str,
        failure: _Failure | None = None,
        *,
        tried: bool = False,
    ) -> None:
        """complete / fail / release by fence, retried across reconnects (the fence makes a
        retry safe: it can only take effect while we still own the job). If a reply was
        lost (``tried``: an earlier statement may have committed), the row is read back to
        learn whether the write took effect."""
        with self._lock:
            self._finishing.add(_key(job))
        outcome = "gave-up"
        for attempt in range(_FINISH_TRIES):
            try:
                queue = link.get()
                if action == "complete":
                    ok = queue.complete(job)
                elif action == "fail":
                    assert failure is not None
                    ok = queue.fail(
                        job,
                        failure.error,
                        backoff=self._backoff_for(job),
                        delay=failure.delay,
                        give_up=failure.give_up,
                    )
                else:
                    ok = queue.release(job)
                if not ok and (attempt > 0 or tried):
                    ok = self._took_effect(queue, action, job, failure.error if failure else "")
                outcome = "ok" if ok else "refused"
                break
            except (psycopg.Error, ConnectError) as exc:
                link.drop()
                if self._halted.is_set():
                    return
                log.warning(
                    "%s: %s of job %s failed (%s)", lane.name, action, job.id, describe(exc)
                )
                time.sleep(0.05 * 2**attempt)
        error = failure.error if failure else ""
        self._settle([job], lane, action, outcome={_key(job): outcome}, error=error)

    def _took_effect(self, queue: Queue, action: str, job: Job, error: str) -> bool:
        """After a retry, whether our earlier try committed although its reply was lost."""
        row = queue.get(job.id)
        if row is None:
            return False
        if action == "complete":
            took = row.status == "done" and row.fence == job.fence
        elif action == "fail":
            took = row.fence > job.fence and row.last_error == _text(error, 10_000)
            if took:
                job.status = row.status if row.status == "dead" else "ready"
        else:
            took = row.fence == job.fence and row.attempts == job.attempts - 1
        if took and action != "fail":
            job.status = "done" if action == "complete" else "ready"
        return took

    def _flush(self, link: _Link, waited: float = 0.0) -> None:
        """Complete the buffered jobs in one fenced statement: all of them, or (``waited``)
        only if the oldest has waited that long."""
        with self._lock:
            if not self._buffer or time.monotonic() - self._buffer[0][1] < waited:
                return
            jobs = [job for job, _ in self._buffer]
            self._buffer = []
        try:
            rejected = {_key(j) for j in link.get().complete_many(jobs)}
        except (psycopg.Error, ConnectError):
            link.drop()
            for job in jobs:  # one by one; the batch may have committed before the cut
                self._finish(link, job, self._lane_of(job), "complete", tried=True)
            return
        outcome = {_key(j): "refused" if _key(j) in rejected else "ok" for j in jobs}
        self._settle(jobs, self._lane_of(jobs[0]), "complete", outcome)

    def _lane_of(self, job: Job) -> _Lane:
        with self._lock:
            held = self._in_flight.get(_key(job))
        return held.lane if held else _Lane(self.name)

    def _settle(
        self, jobs: list[Job], lane: _Lane, action: str, outcome: dict[Key, str], error: str = ""
    ) -> None:
        """Forget finished ``jobs``, count them, record how each ended and log what needs a
        person's eyes (failures, refusals, give-ups): one lock and one record call a batch."""
        ends = [(job, outcome[_key(job)]) for job in jobs]
        names: dict[Key, str] = {}
        with self._lock:
            for job in jobs:
                held = self._in_flight.pop(_key(job), None)
                names[_key(job)] = held.lane.name if held else lane.name
                self._finishing.discard(_key(job))
            self._tally(action, ends)
        self.events.record_many(
            (end_kind(action, end), names[_key(j)], j.id, j.fence, error if end == "ok" else action)
            for j, end in ends
        )
        for job, end in ends:
            log_end(names[_key(job)], job, action, end, error)

    def _forget_lane(self, lane: _Lane, why: str) -> None:
        """Stop heartbeating a lane's unfinished jobs: their leases run out and the reaper
        returns them (used when the lane's own bookkeeping failed)."""
        with self._lock:
            left = [h.job for h in self._in_flight.values() if h.lane is lane]
            for job in left:
                del self._in_flight[_key(job)]
                self._finishing.discard(_key(job))
        for job in left:
            job.mark_lost()
            log.warning("%s: left job %s to its lease after %s", lane.name, job.id, why)
