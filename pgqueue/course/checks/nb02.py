"""Checks for notebook 02, SKIP LOCKED: the reader's own claim statement (alone, then two
sessions at once, and broken on purpose), and a worker loop built from ``Queue`` methods."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import psycopg
from psycopg.pq import TransactionStatus

from ...db import connect, first_line
from ...job import Job
from ...queue import Queue
from .. import lab
from . import expect, passed
from .tiers import Hints

QUEUE = "exercise-02"
JOBS = 30
LOOPS = 3  # the reader's loop runs in this many threads at once, each with its own Queue
TIMEOUT = 20.0  # seconds for all of them to drain the queue


class BadJob(ValueError):
    """What the check's handler raises for the jobs meant to fail."""


def _is_bad(n: int) -> bool:
    return n % 7 == 3


# The job cancelled while its handler runs, so that its complete is refused (returns False):
# a loop that counts completions without complete()'s answer counts it anyway.
CANCELLED = 5


def check_worker_loop(drain: Callable[[Queue, Callable[[Job], Any], str], Any]) -> None:
    """Run ``drain(q, handler, queue)`` in several threads at once over a queue of jobs,
    some of whose handlers raise, and check that every job ran once, outside any
    transaction, and ended done (or dead with its error, for the failing ones)."""
    expect(callable(drain), "drain should be a function: def drain(q, handler, queue): ...")
    with lab.scratch_database("course_02_exercise") as dsn:
        with Queue(dsn) as producer:
            # One attempt each, so a failed job ends dead at once instead of retrying later.
            ids = producer.enqueue_many(
                [{"n": n} for n in range(JOBS)], queue=QUEUE, max_attempts=1
            )
        number = dict(zip(ids, range(JOBS), strict=True))
        runs: Counter[int] = Counter()
        in_transaction: list[int] = []
        lock = threading.Lock()

        def handler(job: Job) -> None:
            with lock:
                runs[job.id] += 1
                if job.conn is not None and job.conn.info.transaction_status not in (
                    TransactionStatus.IDLE,
                    TransactionStatus.UNKNOWN,
                ):
                    in_transaction.append(job.id)
            if job.payload["n"] == CANCELLED:
                with Queue(dsn) as other:  # someone cancels the job while its handler runs
                    other.cancel(job.id)
            if _is_bad(job.payload["n"]):
                raise BadJob(f"bad job {job.payload['n']}")

        returned: list[Any] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                with Queue(dsn, application_name="exercise 02") as q:
                    returned.append(drain(q, handler, QUEUE))
            except BaseException as exc:  # shown to the reader below, as one line
                errors.append(exc)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(LOOPS)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = any(thread.is_alive() for thread in threads)
        with connect(dsn) as conn:
            if stuck:  # stop the reader's loops: their connections go, their claims fail
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'exercise 02'"
                )
            rows = conn.execute(
                "SELECT id, status, last_error FROM jobs WHERE queue = %s ORDER BY id", [QUEUE]
            ).fetchall()
    expect(
        not stuck,
        f"your loop was still running after {TIMEOUT:g} s: return when q.claim gives no job",
    )
    if errors:
        exc = errors[0]
        expect(
            not isinstance(exc, BadJob),
            f"your loop stopped on the handler's error ({first_line(exc)}): catch it and "
            "record it with q.fail(job, error text), then go on",
        )
        expect(False, f"your loop raised {type(exc).__name__}: {first_line(exc)}")
    status = {job_id: (state, error) for job_id, state, error in rows}
    ready = [i for i, (s, _) in status.items() if s == "ready"]
    expect(
        not ready,
        f"{len(ready)} jobs are still ready (job {ready[0] if ready else ''} for one): "
        "keep claiming until q.claim returns an empty list",
    )
    in_flight = [i for i, (s, _) in status.items() if s == "running"]
    expect(
        not in_flight,
        f"job {in_flight[0] if in_flight else ''} is still running: after its handler, "
        "call q.complete(job), or q.fail(job, error) if the handler raised",
    )
    twice = [i for i, n in runs.items() if n > 1]
    expect(not twice, f"job {twice[0] if twice else ''} ran {runs[twice[0]] if twice else 0} times")
    never = [i for i in ids if runs[i] == 0]
    expect(not never, f"job {never[0] if never else ''} never ran: call handler(job) for each job")
    expect(
        not in_transaction,
        f"job {in_transaction[0] if in_transaction else ''} ran inside an open transaction: "
        "claim (the claim commits by itself), then run the handler outside any transaction",
    )
    for job_id, (state, error) in status.items():
        n = number[job_id]
        if _is_bad(n):
            expect(
                state == "dead" and error and f"bad job {n}" in error,
                f"job {job_id} raised 'bad job {n}' but ended {state} with last_error {error!r}:"
                " pass the handler's error text to q.fail(job, ...)",
            )
        elif n == CANCELLED:
            expect(
                state == "cancelled",
                f"job {job_id} was cancelled while its handler ran, but ended {state}",
            )
        else:
            expect(state == "done", f"job {job_id} ended {state}, not done: q.complete(job)")
    good = sum(not _is_bad(n) and n != CANCELLED for n in range(JOBS))
    cancelled = next(i for i, n in number.items() if n == CANCELLED)
    expect(
        all(isinstance(r, int) for r in returned),
        f"drain returned {returned[0]!r}: return how many jobs your loop completed",
    )
    expect(
        sum(returned) == good,
        f"your {LOOPS} loops say they completed {sum(returned)} jobs, the table says {good}"
        + (
            f": job {cancelled} was cancelled while its handler ran, so its q.complete(job) "
            "returned False and completed nothing; count the jobs whose q.complete(job) "
            "returned True"
            if sum(returned) == good + 1
            else ": count the jobs whose q.complete(job) returned True"
        ),
    )
    passed(
        f"{LOOPS} loops at once ran each of the {JOBS} jobs once: {good} done, "
        f"{JOBS - good - 1} dead with their error, and the one cancelled mid-run not counted"
    )


# The claim the reader writes, run against a private jobs table in a schema of its own (two
# sessions must see the same rows, so a temporary table will not do). Its parameters:
# %(queue)s, %(limit)s and %(lease)s (seconds); it ends with RETURNING id, ...
CLAIM_HINTS = Hints()
PARAMS = "%(queue)s, %(limit)s and %(lease)s"
# id -> (queue, status, priority, run_at from now, fence, what it is)
_JOBS: dict[int, tuple[str, str, int, str, int, str]] = {
    1: ("check", "ready", 0, "-3 minutes", 0, "ready, the oldest, priority 0"),
    2: ("check", "ready", 0, "-2 minutes", 1, "ready, newer, priority 0, retried once"),
    3: ("check", "ready", 5, "-1 minute", 0, "ready, the newest, priority 5"),
    4: ("check", "ready", 9, "1 hour", 0, "ready, but not due for an hour (run_at)"),
    5: ("check", "running", 9, "-10 minutes", 3, "running: another worker holds it"),
    6: ("check", "done", 9, "-10 minutes", 1, "done"),
    7: ("other", "ready", 9, "-10 minutes", 0, "ready, but on the queue 'other'"),
}
ORDER = (3, 1, 2)  # highest priority first, then oldest: what three claims of 1 take
WAIT = 3.0  # seconds the second session is given to show it waits for the first one's lock


class Race(NamedTuple):
    """Two sessions claiming one job each at once: A's transaction stays open until B has
    either returned or is seen waiting for a lock."""

    a_ids: list[int]
    b_ids: list[int]
    b_waited: bool  # B sat waiting for a row lock A held
    fences: dict[int, int]  # each job's fence after both committed


@contextmanager
def _private_jobs(dsn: str) -> Iterator[str]:
    """A schema holding an empty copy of the jobs table, dropped at the end; its name."""
    schema = f"check02_{uuid.uuid4().hex[:12]}"
    with connect(dsn) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.jobs (LIKE public.jobs INCLUDING ALL)")
    try:
        yield schema
    finally:
        with connect(dsn) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def _session(dsn: str, schema: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, autocommit=False, application_name="exercise 02 claim")
    conn.execute(f"SET search_path = {schema}, public")
    conn.execute("SET lock_timeout = '10s'")  # a claim stuck behind a lock fails, never hangs
    conn.commit()
    return conn


def _claim(conn: psycopg.Connection, statement: str, limit: int, lease: float) -> list[int]:
    """Run the reader's claim; the ids it returned, in order. Fails with a plain hint when
    PostgreSQL refuses it or it returns no id column."""
    params = {"queue": "check", "limit": limit, "lease": lease}
    try:
        cur = conn.execute(statement, params)  # type: ignore[arg-type]  # the reader's own SQL
    except (psycopg.Error, KeyError, TypeError) as exc:
        conn.rollback()
        expect(False, f"the claim failed: {first_line(exc)} (its parameters: {PARAMS})")
        raise
    names = [c.name for c in cur.description or []]
    expect(
        names[:1] == ["id"],
        "your claim returns "
        + (f"({', '.join(names)})" if names else "no rows")
        + ": end it with RETURNING id, fence, attempts, lease_until",
    )
    return [row[0] for row in cur.fetchall()]


def _rows(conn: psycopg.Connection) -> dict[int, tuple[Any, ...]]:
    """Each job's status, attempts, fence, lease_until, and the lease left (seconds from
    now(), or None)."""
    rows = conn.execute(
        "SELECT id, status, attempts, fence, lease_until,"
        " round(extract(epoch FROM lease_until - now())::numeric, 1)::float8"
        " FROM jobs ORDER BY id"
    ).fetchall()
    return {row[0]: row[1:] for row in rows}


def race(dsn: str, statement: str) -> Race:
    """Sessions A and B claim one job each from three ready ones at once, with ``statement``
    (the claim's parameters): A claims and keeps its transaction open; B claims; once B has
    returned, or is seen waiting for a lock, A commits, then B."""
    with _private_jobs(dsn) as schema:
        a, b = _session(dsn, schema), _session(dsn, schema)
        try:
            for job_id in (11, 12, 13):
                a.execute(
                    "INSERT INTO jobs (id, queue, payload, run_at)"
                    " VALUES (%s, 'check', '{}', now() - %s * interval '1 minute')",
                    [job_id, 20 - job_id],
                )
            a.commit()
            a_ids = _claim(a, statement, 1, 30)  # A's transaction stays open, its locks held
            b_pid = b.info.backend_pid
            b_result: list[list[int]] = []
            b_error: list[BaseException] = []

            def claim_b() -> None:
                try:
                    b_result.append(_claim(b, statement, 1, 30))
                    b.commit()
                except BaseException as exc:  # reported below, in the checking thread
                    b_error.append(exc)

            thread = threading.Thread(target=claim_b, daemon=True)
            thread.start()
            waited = False
            deadline = time.monotonic() + WAIT
            with connect(dsn) as watcher:
                while thread.is_alive() and time.monotonic() < deadline:
                    (event,) = watcher.execute(
                        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [b_pid]
                    ).fetchone() or (None,)
                    if event == "Lock":
                        waited = True
                        break
                    time.sleep(0.01)
            a.commit()
            thread.join(15)
            if b_error:
                raise b_error[0]
            fences = {job_id: row[2] for job_id, row in _rows(a).items()}
            a.commit()
        finally:
            a.close()
            b.close()
    return Race(a_ids, b_result[0] if b_result else [], waited, fences)


def _fill(conn: psycopg.Connection) -> None:
    for job_id, (queue, status, priority, run_at, fence, _) in _JOBS.items():
        conn.execute(
            "INSERT INTO jobs (id, queue, payload, status, priority, run_at, fence, attempts,"
            " lease_until) VALUES (%s, %s, '{}', %s, %s, now() + %s::interval, %s, %s,"
            " CASE WHEN %s = 'running' THEN now() + interval '20 seconds' END)",
            [job_id, queue, status, priority, run_at, fence, fence, status],
        )
    conn.commit()


def _what(job_id: int) -> str:
    return f"job {job_id} ({_JOBS[job_id][5]})"


def _check_taken(ids: list[int], want: int, limit: int, nth: str) -> None:
    """The one claim's ids: exactly ``want``, with a hint per way of taking the wrong job."""
    hints = CLAIM_HINTS
    hints.expect(
        len(ids) <= limit,
        "limit",
        f"the {nth} claim asked for {limit} job(s) (limit {limit}) and got {len(ids)}: {ids}",
        "the inner SELECT takes at most the limit: ... LIMIT %(limit)s",
    )
    for job_id in ids:
        queue, status, _, run_at, _, _ = _JOBS[job_id]
        hints.expect(
            queue == "check",
            "queue",
            f"the {nth} claim, for the queue 'check', took {_what(job_id)}",
            "WHERE queue = %(queue)s",
        )
        hints.expect(
            status == "ready",
            "status",
            f"the {nth} claim took {_what(job_id)}: a second worker now runs it too",
            "claim only what waits: AND status = 'ready'",
        )
        hints.expect(
            not run_at[0].isdigit(),
            "run-at",
            f"the {nth} claim took {_what(job_id)}: a retry's backoff or a job scheduled "
            "for later would run at once",
            "AND run_at <= now()",
        )
    hints.expect(
        ids,
        "none",
        f"the {nth} claim returned no job, though {_what(want)} was waiting",
        "WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()",
    )
    if ids != [want]:
        got = ids[0]
        if _JOBS[got][2] < _JOBS[want][2]:
            hints.fail(
                "priority",
                f"the {nth} claim took {_what(got)} before {_what(want)}",
                "the highest priority first: ORDER BY priority DESC, ...",
            )
        hints.fail(
            "oldest",
            f"the {nth} claim took {_what(got)} before {_what(want)}: the newest first",
            "among equal priorities the oldest first: ORDER BY priority DESC, run_at, id",
        )


def check_claim(dsn: str, statement: object) -> None:
    """Run the reader's claim ``statement`` (parameters %(queue)s, %(limit)s, %(lease)s;
    RETURNING id, ...) against a private jobs table: claimed one at a time, the jobs come
    highest priority first, then oldest, each made running with attempts and fence raised
    and a lease of the given length; jobs of another queue, not ready or not due yet are
    never taken; and two sessions claiming at once get different jobs, without waiting."""
    hints = CLAIM_HINTS
    expect(
        isinstance(statement, str) and re.search(r"\bupdate\b", statement, re.I),
        "CLAIM should be a text holding one UPDATE jobs ... RETURNING id, ... statement",
    )
    assert isinstance(statement, str)
    with _private_jobs(dsn) as schema, _session(dsn, schema) as conn:
        _fill(conn)
        before = _rows(conn)
        for nth, want, lease in (("first", ORDER[0], 30.0), ("second", ORDER[1], 7.0)):
            ids = _claim(conn, statement, 1, lease)
            conn.commit()
            _check_taken(ids, want, 1, nth)
            status, attempts, fence, _, left = _rows(conn)[want]
            was = before[want]
            hints.expect(
                status == "running",
                "running",
                f"the {nth} claim returned {_what(want)}, but the row still says {status!r}: "
                "the next claim can take it again",
                "SET status = 'running', ...",
            )
            hints.expect(
                attempts == was[1] + 1,
                "attempts",
                f"{_what(want)} had {was[1]} attempts before the claim and {attempts} after",
                "each claim is an attempt: attempts = attempts + 1",
            )
            hints.expect(
                fence == was[2] + 1,
                "fence",
                f"{_what(want)} had fence {was[2]} before the claim and {fence} after: the "
                "worker before could still complete it",
                "each claim raises the fence: fence = fence + 1",
            )
            hints.expect(
                left is not None and left > 0,
                "lease",
                f"{_what(want)} is running with "
                + ("no lease" if left is None else f"a lease that ended {-left:g} s ago")
                + ": the reaper would take it back at once",
                "lease_until = now() + make_interval(secs => %(lease)s)",
            )
            assert left is not None
            hints.expect(
                abs(left - lease) < 1,
                "lease-param",
                f"the {nth} claim asked for a {lease:g} s lease and {_what(want)} got {left:g} s",
                "take the length from the parameter: make_interval(secs => %(lease)s)",
            )
        ids = _claim(conn, statement, 5, 30.0)
        conn.commit()
        hints.expect(
            ids == [ORDER[2]],
            "rest",
            f"with job 2 the last ready and due job, a claim of up to 5 returned {ids}",
            "WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()",
        )
        after = _rows(conn)
        for job_id in (4, 5, 6, 7):
            hints.expect(
                after[job_id][:4] == before[job_id][:4],
                "others",
                f"your claims changed {_what(job_id)}: {before[job_id][:3]} became "
                f"{after[job_id][:3]} (status, attempts, fence), or its lease",
                "change only the rows the inner SELECT picked: WHERE id IN (SELECT id ...)",
            )
    both = race(dsn, statement)
    hints.expect(
        both.a_ids and both.b_ids and both.a_ids != both.b_ids,
        "for-update",
        f"A and B claimed at once and both got job {both.a_ids[0] if both.a_ids else '?'} "
        f"(its fence is now {both.fences.get(both.a_ids[0], '?') if both.a_ids else '?'}): "
        "it runs twice"
        if both.a_ids == both.b_ids
        else f"A and B claimed at once: A got {both.a_ids}, B got {both.b_ids}",
        "lock what the inner SELECT reads: ... LIMIT %(limit)s FOR UPDATE SKIP LOCKED",
    )
    hints.expect(
        not both.b_waited,
        "skip-locked",
        f"B waited for A's transaction to end before it got job {both.b_ids[0]}: claims "
        "stand in line behind each other's row locks",
        "pass over rows another claim holds: FOR UPDATE SKIP LOCKED",
    )
    passed(
        "your claim took job 3 (priority 5), then job 1 (the oldest), then job 2, each with "
        "attempts and fence raised and the lease asked for; it never took a job of another "
        "queue, not ready or not due; and two sessions at once got different jobs, "
        f"{both.a_ids[0]} and {both.b_ids[0]}, without waiting"
    )


def broken(statement: str, clause: str) -> str:
    """``statement`` without ``clause``: "SKIP LOCKED", or "FOR UPDATE" (and with it the
    SKIP LOCKED that cannot stand without it)."""
    pattern = {
        "SKIP LOCKED": r"\s+SKIP\s+LOCKED",
        "FOR UPDATE": r"\s+FOR\s+UPDATE(\s+SKIP\s+LOCKED)?",
    }
    expect(clause in pattern, f"clause should be 'SKIP LOCKED' or 'FOR UPDATE', got {clause!r}")
    out, n = re.subn(pattern[clause], "", statement, flags=re.I)
    expect(n == 1, f"your CLAIM should hold {clause} once, to take it away; it holds it {n} times")
    return out
