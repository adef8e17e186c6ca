"""Checks for notebook 16: the reader's step write (one statement that checks the claim and
stores the step), and a claim loop's finish that writes its result and completes the job in
one transaction. Both run against the notebook's database, on jobs the check makes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ...db import first_line
from ...errors import LeaseLost
from ...job import Job
from ...queue import Queue
from ..steps_lab import INVOICES
from . import compare_prediction, expect, passed
from .tiers import Hints

STEP_HINTS = Hints()
FINISH_HINTS = Hints()


class _Jobs:
    """Jobs of a queue of the check's own, removed (with their steps) at the end."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.queue = f"check-{uuid.uuid4().hex[:8]}"
        self.q = Queue(dsn)

    def claim(self, lease: float = 30) -> Job:
        self.q.enqueue({}, queue=self.queue)
        [job] = self.q.claim(self.queue, lease=lease)
        return job

    def take_over(self, job: Job) -> Job:
        """End ``job``'s claim as a pause past its lease does, and claim it again."""
        self.q.conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [job.id]
        )
        self.q.reap()
        [holder] = self.q.claim(self.queue, lease=30)
        return holder

    def close(self) -> None:
        conn = self.q.conn
        conn.execute(
            "DELETE FROM pgqueue_steps WHERE job_id IN (SELECT id FROM jobs WHERE queue = %s)",
            [self.queue],
        )
        conn.execute("DELETE FROM jobs WHERE queue = %s", [self.queue])
        self.q.close()


def _stored(conn: psycopg.Connection, job_id: int, name: str) -> tuple[Any, int] | None:
    row = conn.execute(
        "SELECT output, fence FROM pgqueue_steps WHERE job_id = %s AND name = %s", [job_id, name]
    ).fetchone()
    return None if row is None else (row[0], int(row[1]))


def check_step_put(statement: object, dsn: str) -> None:
    """Run the reader's ``STEP_PUT`` (parameters %(job)s, %(fence)s, %(name)s, %(output)s):
    the holder's write is stored with its fence, a second write of a step keeps the first,
    a stale holder, a lease run out (even within a transaction begun before), a done job
    store nothing, and the check holds the job row until the write's transaction ends."""
    expect(
        isinstance(statement, str) and "insert" in statement.lower(),
        "STEP_PUT should be a text holding one INSERT INTO pgqueue_steps ... statement",
    )
    assert isinstance(statement, str)
    jobs = _Jobs(dsn)
    conn = jobs.q.conn

    def put(job: Job, name: str, output: Any, on: psycopg.Connection = conn) -> None:
        params = {"job": job.id, "fence": job.fence, "name": name, "output": Jsonb(output)}
        try:
            on.execute(statement, params)  # type: ignore[arg-type]
        except psycopg.errors.UniqueViolation:
            STEP_HINTS.fail(
                "unique-error",
                f"writing step {name!r} a second time raised a unique_violation: a step already "
                "stored must stay as it is, quietly (a lost reply makes a worker write twice)",
                "ON CONFLICT (job_id, name) DO NOTHING",
            )
        except psycopg.Error as exc:
            STEP_HINTS.fail(
                "sql",
                f"PostgreSQL refused your statement: {first_line(exc)}",
                "INSERT INTO pgqueue_steps (job_id, name, output, fence, written_at) "
                "SELECT ... FROM jobs WHERE ...",
            )
        except (KeyError, TypeError) as exc:
            expect(False, f"your statement asks for a parameter the check does not pass ({exc}): "
                   "use %(job)s, %(fence)s, %(name)s and %(output)s")  # fmt: skip

    try:
        # 1. The holder stores a step, with its fence.
        holder = jobs.claim()
        put(holder, "charge", {"charge_id": "ch_1"})
        got = _stored(conn, holder.id, "charge")
        STEP_HINTS.expect(
            got is not None,
            "holder-refused",
            f"the holder of job {holder.id} (running, fence {holder.fence}, lease 30 s ahead) "
            "stored nothing",
            "INSERT INTO pgqueue_steps ... SELECT id, %(name)s, %(output)s, fence, "
            "clock_timestamp() FROM jobs WHERE id = %(job)s AND ...",
        )
        assert got is not None
        expect(
            got == ({"charge_id": "ch_1"}, holder.fence),
            f"the stored step is {got}, not the output with the holder's fence "
            f"({{'charge_id': 'ch_1'}}, {holder.fence})",
        )
        # 2. The same step again: the first output stays.
        put(holder, "charge", {"charge_id": "ch_2"})
        STEP_HINTS.expect(
            _stored(conn, holder.id, "charge") == got,
            "overwrite",
            "writing step 'charge' again replaced its stored output: a step once stored is "
            "the answer for every later attempt",
            "ON CONFLICT (job_id, name) DO NOTHING, not DO UPDATE",
        )
        # 3. A stale holder: the job was taken over.
        stale = jobs.claim()
        current = jobs.take_over(stale)
        put(stale, "ship", "stale")
        STEP_HINTS.expect(
            _stored(conn, stale.id, "ship") is None,
            "fence",
            f"a stale holder (fence {stale.fence}; job {stale.id} is held with fence "
            f"{current.fence} now) stored step 'ship'",
            "check the claim in jobs: AND fence = %(fence)s AND status = 'running'",
        )
        # 4. A done job.
        done = jobs.claim()
        jobs.q.complete(done)
        put(done, "ship", "late")
        STEP_HINTS.expect(
            _stored(conn, done.id, "ship") is None,
            "status",
            f"job {done.id} is done (its fence is still {done.fence}), yet a step was stored",
            "AND status = 'running'",
        )
        # 5. A lease run out, nobody has reaped it yet.
        expired = jobs.claim()
        conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [expired.id]
        )
        put(expired, "ship", "expired")
        STEP_HINTS.expect(
            _stored(conn, expired.id, "ship") is None,
            "lease",
            f"job {expired.id} is still 'running' with this fence, but its lease ran out a "
            "second ago, and the step was stored",
            "AND lease_until > clock_timestamp()",
        )
        # 6. The lease runs out during a transaction begun before: now() is its start.
        slow = jobs.claim()
        conn.execute(
            "UPDATE jobs SET lease_until = clock_timestamp() + interval '0.3 seconds' "
            "WHERE id = %s",
            [slow.id],
        )
        with psycopg.connect(dsn) as tx:
            tx.execute("SELECT now()")  # the transaction (and its now()) begins here
            time.sleep(0.45)  # the lease runs out
            put(slow, "ship", "after its lease", on=tx)
            tx.commit()
        STEP_HINTS.expect(
            _stored(conn, slow.id, "ship") is None,
            "now",
            f"in a transaction begun while job {slow.id}'s lease still ran, a step written "
            "after the lease ran out was stored",
            "now() is the time the transaction began; compare with clock_timestamp()",
        )
        # 7. The check holds the job row until the write's transaction ends.
        locked = jobs.claim()
        with psycopg.connect(dsn) as tx, psycopg.connect(dsn, autocommit=True) as other:
            put(locked, "charge", "held", on=tx)
            other.execute("SET lock_timeout = '300ms'")
            try:
                other.execute(
                    "UPDATE jobs SET status = 'cancelled', fence = fence + 1 WHERE id = %s",
                    [locked.id],
                )
                slipped = True
            except psycopg.errors.LockNotAvailable:
                slipped = False
            tx.commit()
        key_share = "key share" in " ".join(statement.lower().split())
        STEP_HINTS.expect(
            not slipped,
            "key-share" if key_share else "lock",
            f"while your step write's transaction was still open, a cancel of job {locked.id} "
            "went through: the claim could end between your check and the commit",
            "FOR KEY SHARE lets an UPDATE of non-key columns (a cancel, a fail, a reap) "
            "through: lock the row FOR SHARE"
            if key_share
            else "lock the job row in the check: ... FROM jobs WHERE ... FOR SHARE",
        )
    finally:
        jobs.close()
    passed(
        "your step write stored the holder's output with its fence and kept it on a second "
        "write; refused a stale holder, a done job and a lease run out (inside an older "
        "transaction too); and held the job row until its transaction ended"
    )


def check_finish(finish: Callable[[Queue, Job, int], Any], dsn: str) -> None:
    """Run the reader's ``finish(q, job, cents)``: the holder's invoice and completion both
    commit; a stale holder leaves neither (and is told: ``False`` or ``LeaseLost``); an
    invoice that fails to insert leaves the job running, not done without its invoice."""
    expect(callable(finish), "finish should be a function finish(q, job, cents)")
    jobs = _Jobs(dsn)
    q = jobs.q
    q.conn.execute(INVOICES)

    def invoice(job: Job) -> Any:
        return q.conn.execute("SELECT cents FROM invoices WHERE job_id = %s", [job.id]).fetchone()

    def status(job: Job) -> str:
        state = q.get(job.id)
        assert state is not None
        return state.status

    try:
        # 1. The holder: both commit.
        holder = jobs.claim()
        outcome = finish(q, holder, 500)
        FINISH_HINTS.expect(
            invoice(holder) == (500,),
            "no-invoice",
            f"after finish(q, job, 500) the invoices table has {invoice(holder)} for job "
            f"{holder.id}, not (500,)",
            "q.conn.execute('INSERT INTO invoices (job_id, cents) VALUES (%s, %s)', "
            "[job.id, cents])",
        )
        FINISH_HINTS.expect(
            status(holder) == "done",
            "not-done",
            f"after finish the job is {status(holder)!r}, not 'done'",
            "q.complete(job) inside the same transaction as the insert",
        )
        expect(
            q.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE,
            "finish left a transaction open on q.conn: end it (a with q.conn.transaction(): "
            "block commits at its end)",
        )
        expect(outcome is not False, "finish returned False for the current holder")
        # 2. A stale holder: neither.
        stale = jobs.claim()
        jobs.take_over(stale)
        try:
            told = finish(q, stale, 700) is False
        except LeaseLost:
            told = True
        FINISH_HINTS.expect(
            invoice(stale) is None,
            "stale-invoice",
            f"a stale holder's finish (job {stale.id} taken over, its complete refused) left "
            f"its invoice {invoice(stale)} behind",
            "one transaction for both, `with q.conn.transaction():`, and raise inside it "
            "(e.g. pgqueue.LeaseLost) when q.complete(job) returns False: the raise rolls the "
            "insert back",
        )
        FINISH_HINTS.expect(
            told,
            "not-told",
            "a stale holder's finish wrote nothing but did not say so",
            "return False, or let pgqueue.LeaseLost out, when q.complete(job) returns False",
        )
        expect(
            status(stale) == "running",
            f"after the stale holder's finish job {stale.id} is {status(stale)!r}; its new "
            "holder still runs it",
        )
        # 3. The invoice fails (cents < 0 breaks a CHECK): the job must not end done.
        broken = jobs.claim()
        with contextlib.suppress(psycopg.errors.CheckViolation):
            finish(q, broken, -1)
        if q.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            q.conn.rollback()
        FINISH_HINTS.expect(
            status(broken) == "running" and invoice(broken) is None,
            "split",
            f"the invoice insert of job {broken.id} failed, and the job is "
            f"{status(broken)!r}: a crash between the two writes would leave a done job with "
            "no invoice",
            "put the insert and q.complete(job) in one `with q.conn.transaction():` block",
        )
    finally:
        q.conn.execute(
            "DELETE FROM invoices WHERE job_id IN (SELECT id FROM jobs WHERE queue = %s)",
            [jobs.queue],
        )
        jobs.close()
    passed(
        "the holder's invoice and completion committed together; a stale holder left neither "
        "and was told; a failed insert left the job running for a retry"
    )


def with_now(statement: object) -> str:
    """The reader's STEP_PUT with its lease check on ``now()`` instead of
    ``clock_timestamp()``."""
    import re

    expect(isinstance(statement, str), "STEP_PUT should be the statement, as text")
    assert isinstance(statement, str)
    out, n = re.subn(
        r"lease_until\s*>\s*clock_timestamp\(\)|clock_timestamp\(\)\s*<\s*lease_until",
        "lease_until > now()",
        statement,
        flags=re.I,
    )
    expect(n == 1, f"your STEP_PUT should compare lease_until with clock_timestamp() once; {n}")
    return out


def _late_in_transaction(dsn: str, statement: str) -> dict[str, object]:
    """A transaction begins; then a job is claimed with a 1 s lease (so its lease_until is
    later than the transaction's now()); the transaction idles past that lease, then writes
    a step with ``statement``. Whether the step was stored."""
    jobs = _Jobs(dsn)
    try:
        with psycopg.connect(dsn) as conn:  # not autocommit: one transaction from here
            conn.execute("SELECT now()")  # the transaction's now() is fixed here
            job = jobs.claim(lease=1.0)
            (left,) = jobs.q.conn.execute(
                "SELECT extract(epoch FROM lease_until - clock_timestamp())::float8"
                " FROM jobs WHERE id = %s",
                [job.id],
            ).fetchone() or (1.0,)
            time.sleep(max(0.0, float(left)) + 0.3)  # idle in the transaction past the lease
            params = {"job": job.id, "fence": job.fence, "name": "late", "output": Jsonb(1)}
            try:
                conn.execute(statement, params)  # type: ignore[arg-type]
            except psycopg.Error as exc:
                expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
            conn.commit()
        return {"stored": _stored(jobs.q.conn, job.id, "late") is not None}
    finally:
        jobs.close()


def check_step_put_with_now(dsn: str, statement: object, prediction: object) -> None:
    """The reader's STEP_PUT with ``now()`` in its lease check, written from a transaction
    that idled past the lease; the reader's prediction of whether it stores the step, and
    the statement as written run beside it."""
    broken = _late_in_transaction(dsn, with_now(statement))
    compare_prediction(
        prediction,
        broken,
        {
            "stored": "now() is the moment the transaction began, when the lease still had "
            "a second to run, however long the transaction has idled since",
        },
    )
    real = _late_in_transaction(dsn, str(statement))
    expect(
        real == {"stored": False},
        f"with clock_timestamp() the late step should be refused, but the run gave {real}",
    )
    passed(
        "right: with now() the lease check looked at the transaction's start, so a step "
        "written after the lease ran out was stored; clock_timestamp() (run too) refused it"
    )
