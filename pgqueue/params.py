"""What each statement is sent and what its reply means: shared by ``Queue`` and
``AsyncQueue``, so the two differ only in how they wait for the server. (The checks of a
caller's input are ``inputs.py``; what a driver error means, ``errormap.py``; ``conn=``
unwrapped, ``adapters.py``.)"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from .errors import (
    BadInput,
    JobFailed,
    PgQueueError,
)
from .inputs import (
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    MAX_PER_GROUP,
    MAX_PRIORITY,
    checked_group,
    checked_key,
    checked_queue_name,
    checked_seconds,
    column_text,
    payload_jsonb,
    result_text,
)
from .job import Job

KEY_TRIES = 5  # enqueues of one key racing each other settle within a try or two
SLOT_TRIES = 5  # claims racing for a group's slot: each new try sees the slots taken
COPY_FROM = 2_000  # payloads; enqueue_many uses COPY from this many on (INSERT is as fast below)
RESULT_POLL = 0.5  # seconds between Queue.result's reads when no notification comes


PREPARED_UP_TO = 100  # ids; larger arrays are planned at each call (see prepare_many)


def prepare_many(prepare: bool, jobs: Sequence[Job]) -> bool:
    """Whether to run a statement over many jobs prepared. A prepared statement gets a
    generic plan after five runs, and that plan cannot see how long the array is: for
    thousands of ids it took 3.3 s instead of 33 ms. Small batches, the common case, stay
    prepared (planning each would cost every batch); large ones are planned each time."""
    return prepare and len(jobs) <= PREPARED_UP_TO


def limit_params(queue: object, per_group: object) -> dict[str, Any]:
    """``Queue.limit``'s parameters: a queue, and a whole number of running jobs >= 1 (or
    None: no limit)."""
    if per_group is not None and (
        isinstance(per_group, bool)
        or not isinstance(per_group, int)
        or not 1 <= per_group <= MAX_PER_GROUP
    ):
        raise BadInput(
            f"per_group must be a whole number of running jobs from 1 to {MAX_PER_GROUP} "
            f"(None removes the limit), got {per_group!r}"
        )
    return {"queue": checked_queue_name(queue), "per_group": per_group}


def job_params(
    queue: object, delay: object, run_at: object, max_attempts: object, priority: object = 0
) -> dict[str, Any]:
    if run_at is not None and (not isinstance(run_at, datetime) or run_at.tzinfo is None):
        raise BadInput(f"run_at must be a timezone-aware datetime, got {run_at!r}")
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS
    ):
        raise BadInput(
            f"max_attempts must be a whole number from 1 to {MAX_ATTEMPTS}, got {max_attempts!r}"
        )
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not -MAX_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise BadInput(
            f"priority must be a whole number from {-MAX_PRIORITY} to {MAX_PRIORITY} "
            f"(higher runs first), got {priority!r}"
        )
    return {
        "queue": checked_queue_name(queue),
        "delay": checked_seconds("delay", delay, upper=10 * 365 * 86400.0),
        "run_at": run_at,
        "max_attempts": max_attempts,
        "priority": priority,
    }


def complete_params(job: Job, result: object) -> tuple[str, dict[str, Any]]:
    """Which complete statement, with what: the one that stores nothing if ``result`` is None."""
    params: dict[str, Any] = {"id": job.id, "fence": job.fence}
    text = result_text(result)
    if text is None:
        return "complete", params
    params["result"] = text
    return "complete_result", params


def complete_many_params(
    jobs: Sequence[Job], results: Sequence[object] | None
) -> tuple[str, dict[str, Any]]:
    """complete_many's name and arrays; a batch with no result sends no third array."""
    params: dict[str, Any] = held_params(jobs)
    if results is None:
        return "complete_many", params
    if len(results) != len(jobs):
        raise BadInput(f"complete_many got {len(results)} results for {len(jobs)} jobs")
    texts = [result_text(r) for r in results]
    if all(t is None for t in texts):
        return "complete_many", params
    params["results"] = texts
    return "complete_many_results", params


def result_of(job_id: int, row: tuple[Any, ...] | None) -> tuple[bool, Any]:
    """``result``'s reply: (True, the stored result) for a done job, (False, its status)
    for one not finished; ``JobFailed`` for a dead or cancelled one, ``BadInput`` for none."""
    if row is None:
        raise BadInput(f"there is no job {job_id} (never enqueued, or pruned)")
    status, result, last_error = row
    if status == "done":
        return True, result
    if status in ("dead", "cancelled"):
        raise JobFailed(job_id, status, last_error)
    return False, status


def result_wait(job_id: int, deadline: float | None, poll_interval: float, status: str) -> float:
    """How long ``Queue.result`` may wait before reading again; ``TimeoutError`` past the
    deadline."""
    if deadline is None:
        return poll_interval
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"job {job_id} did not finish in time (it is {status})")
    return min(left, poll_interval)


def held_params(jobs: Sequence[Job]) -> dict[str, list[int]]:
    return {"ids": [j.id for j in jobs], "fences": [j.fence for j in jobs]}


# -- the claim's, the ends', retry_dead's, stats', prune's and the periodic clock's ------
# enqueue_copy's columns: id, queue, payload, run_at, max_attempts, priority, group_key
COPY_TYPES = ["bigint", "text", "jsonb", "timestamptz", "integer", "integer", "text"]


def enqueue_params(
    payload: object,
    queue: object,
    delay: object,
    run_at: object,
    max_attempts: object,
    priority: object,
    key: object,
    group: object = None,
) -> dict[str, Any]:
    params = job_params(queue, delay, run_at, max_attempts, priority)
    params["payload"] = payload_jsonb(payload)
    params["key"] = checked_key(key)
    params["group_key"] = checked_group(group)
    return params


def enqueue_many_params(
    payloads: Iterable[object],
    queue: object,
    delay: object,
    run_at: object,
    max_attempts: object,
    priority: object,
    keys: Sequence[object] | None,
    group: object = None,
) -> dict[str, Any]:
    params = job_params(queue, delay, run_at, max_attempts, priority)
    params["group_key"] = checked_group(group)
    params["payloads"] = [payload_jsonb(p, index=i) for i, p in enumerate(payloads)]
    if keys is not None:
        if len(keys) != len(params["payloads"]):
            raise BadInput(
                f"keys must give one key (or None) per payload: {len(keys)} keys for "
                f"{len(params['payloads'])} payloads"
            )
        params["keys"] = [checked_key(k) for k in keys]
    return params


def enqueue_many_route(params: dict[str, Any]) -> str:
    """How ``enqueue_many`` writes: 'none', 'keyed', 'copy' or 'insert'."""
    if not params["payloads"]:
        return "none"
    if "keys" in params:
        return "keyed"
    return "copy" if len(params["payloads"]) >= COPY_FROM else "insert"


def reserved(row: tuple[Any, ...] | None) -> tuple[list[int], datetime]:
    """``enqueue_reserve``'s ids, sorted (so they ascend in payload order), and run_at."""
    assert row is not None
    return sorted(row[0]), row[1]


def copy_rows(
    params: dict[str, Any], ids: list[int], run_at: datetime
) -> Iterable[tuple[Any, ...]]:
    """The rows ``enqueue_copy`` writes, in ``COPY_TYPES`` order."""
    tail = (run_at, params["max_attempts"], params["priority"], params["group_key"])
    for job_id, payload in zip(ids, params["payloads"], strict=True):
        yield (job_id, params["queue"], payload, *tail)


class Keyed:
    """What a keyed ``enqueue_many`` gives each payload: the id it added, or the id of
    the live job that holds its key (the first of a key in the batch wins)."""

    def __init__(self, keys: list[str | None], ids: list[int], found: list[tuple[Any, ...]]):
        added = {int(i) for i, k in found if k is None}
        self.keys = keys
        self.holders = {k: int(i) for i, k in found if k is not None}
        self.result: list[int | None] = []
        for job_id, key in zip(ids, keys, strict=True):
            if job_id in added:
                self.holders.setdefault(key, job_id)
                self.result.append(job_id)
            else:
                self.result.append(self.holders.get(key))

    @property
    def missing(self) -> list[str | None]:
        """Keys held by a job this statement's snapshot could not see (a racing enqueue)."""
        return sorted({k for k, i in zip(self.keys, self.result, strict=True) if i is None})

    def add_holders(self, rows: list[tuple[Any, ...]]) -> None:
        """Take in ``key_holders``' second look (id, key)."""
        self.holders.update({k: int(i) for i, k in rows})
        self.result = [
            self.holders.get(k) if i is None else i
            for k, i in zip(self.keys, self.result, strict=True)
        ]

    def ids(self) -> list[int]:
        if None in self.result:
            raise PgQueueError(
                "enqueue_many: a key's job ended while it was being added; try again"
            )
        return [int(i) for i in self.result if i is not None]


CLAIMS = ("claim", "claim_limited")  # without, with a per-group limit (sql/queries.sql)


class ClaimRoute:
    """Which claim statement each queue needs: ``claim``, or ``claim_limited`` for a queue
    with a per-group limit. Only a guess, kept by one Queue: each statement refuses a queue
    it does not fit with a row of NULLs (``wrong``), and the guess flips. So a limit set or
    removed elsewhere costs one round trip, and the database alone decides what may run."""

    def __init__(self) -> None:
        self.limited: set[str] = set()

    def statement(self, queue: str) -> str:
        return CLAIMS[queue in self.limited]

    def wrong(self, queue: str, rows: list[tuple[Any, ...]]) -> bool:
        """Whether ``rows`` is the refusal (the guess flips), not claimed jobs."""
        if not rows or rows[-1][0] is not None:
            return False
        self.limited ^= {queue}
        return True


def beat(job: Job, row: tuple[Any, ...] | None, deadline: float) -> bool:
    """A heartbeat's reply (the new ``lease_until``, or no row): push the job's lease and
    local deadline on, or mark the job lost. A NULL ``lease_until`` (``heartbeat_many``:
    the row was locked by another session) is neither: still held, not renewed."""
    if row is None:
        job.mark_lost()
        return False
    if row[0] is None:
        return True
    job.lease_until = row[0]
    job.deadline = max(job.deadline, deadline)
    return True


def beat_many(jobs: Sequence[Job], kept_rows: list[tuple[Any, ...]], deadline: float) -> list[Job]:
    kept = {(r[0], r[1]): r[2:] for r in kept_rows}  # by claim: (id, fence)
    return [job for job in jobs if not beat(job, kept.get((job.id, job.fence)), deadline)]


def end_reply(job: Job, took_effect: bool, status: str) -> bool:
    """A fenced complete/release's reply: the job's new status, or lost."""
    if took_effect:
        job.status = status
    else:
        job.mark_lost()
    return took_effect


def completed_many(jobs: Sequence[Job], done_rows: list[tuple[Any, ...]]) -> list[Job]:
    done = {(r[0], r[1]) for r in done_rows}  # by claim: (id, fence)
    return [job for job in jobs if not end_reply(job, (job.id, job.fence) in done, "done")]


MAX_TRACEBACK = 8_000  # characters of a failed attempt's traceback kept (its end: the raise)


def fail_params(
    job: Job,
    error: object,
    backoff: object,
    delay: object,
    give_up: object,
    traceback: str | None = None,
) -> dict[str, Any]:
    return {
        "id": job.id,
        "fence": job.fence,
        "error": column_text(error, 10_000),
        "traceback": None
        if traceback is None
        else column_text(traceback[-MAX_TRACEBACK:], MAX_TRACEBACK),
        "backoff": checked_seconds("backoff", backoff, upper=MAX_BACKOFF),
        "delay": None if delay is None else checked_seconds("delay", delay, upper=MAX_BACKOFF),
        "give_up": bool(give_up),
    }


def fail_reply(job: Job, row: tuple[Any, ...] | None) -> bool:
    """``fail``'s reply. Either way the holder is done: its fence moved on (or had already)."""
    job.mark_lost()
    if row is None:
        return False
    job.status, retry_in = row[:2]
    job.retry_in = None if job.status == "dead" else max(0.0, float(retry_in))
    return True


def retry_dead_plan(
    queue: object, ids: Sequence[object] | None, extra: object
) -> tuple[str, dict[str, Any]] | None:
    """The statement and parameters of a ``retry_dead``; None when ``ids`` is empty."""
    if isinstance(extra, bool) or not isinstance(extra, int) or not 1 <= extra <= MAX_ATTEMPTS:
        raise BadInput(
            f"extra must be a whole number of attempts from 1 to {MAX_ATTEMPTS}, got {extra!r}"
        )
    if ids is not None and not all(
        isinstance(i, int) and not isinstance(i, bool) and 1 <= i < 2**63 for i in ids
    ):
        raise BadInput(f"ids must be job ids (whole numbers >= 1), got {ids!r}")
    if ids is None:
        queue = checked_queue_name("default" if queue is None else queue)
        return "retry_dead", {"queue": queue, "extra": extra}
    if not ids:
        return None
    named = None if queue is None else checked_queue_name(queue)
    return "retry_dead_ids", {"ids": list(ids), "queue": named, "extra": extra}


class LeftDead(NamedTuple):
    """A dead job ``retry_dead`` left dead because its key is taken: by job ``held_by``,
    ready or running (or a newer dead job of the key, retried in its place)."""

    id: int
    key: str
    held_by: int


class Retried(list[int]):
    """What ``retry_dead`` returns: the ids of the jobs made ready again (a list), and in
    ``skipped`` the dead jobs it left dead because their key is taken, by id."""

    def __init__(self, ids: Iterable[int] = (), skipped: Iterable[LeftDead] = ()) -> None:
        super().__init__(ids)
        self.skipped: list[LeftDead] = sorted(skipped)


def retried_reply(name: str, rows: list[tuple[Any, ...]]) -> Retried:
    """``retry_dead``'s reply: (id, NULL, NULL) per job retried, (id, key, held_by) per
    job left dead."""
    ids = [int(r[0]) for r in rows if r[2] is None]
    skipped = [LeftDead(int(r[0]), r[1], int(r[2])) for r in rows if r[2] is not None]
    return Retried(sorted(ids) if name == "retry_dead_ids" else ids, skipped)


def stats_reply(
    description: Sequence[Any] | None, rows: list[tuple[Any, ...]]
) -> list[dict[str, Any]]:
    names = [c.name for c in description or []]
    return [dict(zip(names, row, strict=True)) | {"estimated": False} for row in rows]


def finished_estimate(rows: list[dict[str, Any]], total: tuple[Any, ...] | None) -> dict[str, Any]:
    """The 'finished' row of ``stats``: the planner's row estimate less the live jobs; before
    the table was ever analyzed, the count of a small table (``counted``), else None."""
    reltuples, counted = total or (-1.0, None)
    if counted is not None:
        jobs: int | None = int(counted)
    else:
        live = sum(r["jobs"] for r in rows)
        jobs = None if reltuples < 0 else max(0, round(reltuples) - live)
    return {
        "queue": None,
        "status": "finished",
        "jobs": jobs,
        "oldest_ready_seconds": None,
        "latest_error": None,
        "estimated": True,  # the finished row: not read through the partial indexes
        "counted": counted is not None,
    }


class Pruning:
    """Where a prune run is: the next statement's parameters, what the replies added up
    to, and the progress in ids (done, in all) between the two ends ``id_span`` found."""

    def __init__(self, span: tuple[Any, ...] | None, batch: int, age: float) -> None:
        self.low, self.high = 1, 0  # an empty table: nothing to look at
        if span is not None and span[0] is not None:
            self.low, self.high = int(span[0]), int(span[1])
        self.after = self.low - 1  # the last id looked at
        self.batch, self.age = batch, age
        self.removed = 0

    def params(self) -> dict[str, Any] | None:
        """The next batch's parameters; None once the last id of the span was looked at."""
        if self.after >= self.high:
            return None
        return {"after": self.after, "upto": self.high, "batch": self.batch, "older_than": self.age}

    def took(self, row: tuple[Any, ...] | None) -> None:
        """Take in a batch's reply: the last id it looked at (NULL: none left), and how many
        jobs it removed."""
        assert row is not None
        self.after = self.high if row[0] is None else int(row[0])
        self.removed += int(row[1])

    @property
    def progress(self) -> tuple[int, int]:
        return self.after - self.low + 1, self.high - self.low + 1


def schedule_clock_reply(rows: list[tuple[Any, ...]]) -> tuple[datetime, dict[str, datetime]]:
    """``schedule_clock``'s reply: the server's clock, and each schedule's last slot."""
    return rows[0][0], {r[1]: r[2] for r in rows if r[1] is not None}


class Reaped(NamedTuple):
    """A job the reaper moved: back to ``ready``, or to ``dead`` at max_attempts."""

    id: int
    queue: str
    status: str
    fence: int


class Limit(NamedTuple):
    """A queue's per-group limit (``Queue.limits``): at most ``per_group`` running jobs of
    one group; ``running``: its jobs running under the limit now, all groups together."""

    queue: str
    per_group: int
    running: int


class JobState(NamedTuple):
    """One job as the table holds it now (``Queue.get``)."""

    id: int
    queue: str
    status: str  # ready, running, done, dead or cancelled
    payload: dict[str, Any]
    priority: int
    key: str | None
    attempts: int
    max_attempts: int
    fence: int
    run_at: datetime
    lease_until: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    last_error: str | None
    group_key: str | None  # enqueue's group: limited together by the queue's per-group limit
    result: Any = None  # what the handler returned (done jobs; None: nothing)
    traceback: str | None = None  # the last failed attempt's, bounded (None: none kept)


class ScheduleState(NamedTuple):
    """One periodic schedule as the table holds it (``Queue.schedules``): its last slot
    (a job made, or skipped as missed) and its next, as of the last tick that moved it."""

    name: str
    spec: str  # 'cron */5 * * * *' or 'every 30s'
    queue: str
    last_slot: datetime
    next_slot: datetime | None
