# Generated from async_job.py by `python pgqueue/tools/async_to_sync.py`: edit that file,
# then run the command again (make lint fails while the two differ).
"""A claimed job's writes, each checked against its claim, written once for both faces:
``AsyncJob`` in ``async_job.py`` (the source, for coroutine handlers: its writes are
awaited) and ``Job`` in ``job.py``, the same code without ``await``, generated from it by
``python pgqueue/tools/async_to_sync.py`` (``make lint`` fails while the two differ). The
module-level ``fenced_write`` / ``async_fenced_write`` send ``fencing.compose``'s
statements.

What a claim is (fields, the lost flag, the local lease deadline) is ``job_base.JobBase``.
An ``AsyncQueue`` claims jobs with its own connection as ``conn``. An ``AsyncWorker`` gives
a job no connection at first: ``await job.connection()`` lends it one from the worker's
small pool on first use, and the job keeps it until its handler returns. So five hundred
handlers awaiting I/O need no connection at all, and those that write each get one of their
own: an ``AsyncConnection`` runs one statement at a time. A plain ``Job`` from a ``Queue``
writes on the queue's connection; a ``Worker`` lends each lane's (``handlers.LaneJob``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from . import statements, steps
from .db import own_cursor
from .errors import LeaseLost
from .fencing import MISSING, STALE, WRITTEN, Answer, compose
from .job_base import JobBase

__all__ = ["Job", "fenced_write", "write_answer"]

Borrow = Callable[[], psycopg.Connection]


@dataclass
class Job(JobBase):
    """One claim of a job: ``fence`` is this holder's token, and every write below carries
    it and checks the claim (``job.fenced_write(...)``, ``job.step(...)``,
    ``with job.transaction()``)."""

    conn: psycopg.Connection | None = field(default=None, repr=False, compare=False)
    # Set by a worker that lends connections: lends the job one on first use (None: use
    # ``conn``).
    borrow: Borrow | None = field(default=None, repr=False, compare=False)
    # The connection ``borrow`` lent, given back when the handler returns (even if the
    # handler put another in ``conn``).
    lent: psycopg.Connection | None = field(default=None, repr=False, compare=False)
    _borrowing: threading.Lock | None = field(default=None, init=False, repr=False, compare=False)

    def connection(self) -> psycopg.Connection:
        """The connection to write with: the claimer's, or (in a worker that lends them)
        one lent to this job on first use and kept until its handler returns (autocommit;
        a transaction it leaves open is rolled back and the job failed)."""
        if self.conn is not None:
            return self.conn
        if self.borrow is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        if self._borrowing is None:  # two writes of one handler at once borrow once
            self._borrowing = threading.Lock()
        with self._borrowing:
            if self.conn is None:
                self.conn = self.lent = self.borrow()
        return self.conn

    def fenced_write(
        self,
        table: str,
        key: Mapping[str, Any],
        values: Mapping[str, Any],
        *,
        upsert: bool = True,
        job_column: str = "job_id",
    ) -> bool:
        """Write to another table with this job's fence and id (see ``pgqueue.fenced_write``;
        the table needs a ``job_column`` beside ``fence``); return whether it took effect.
        The same statement checks the job in ``jobs`` too (``check_lease``): it must still
        be running with this fence and an unexpired lease. A refused write means this
        holder's claim is over: the job is marked lost. With ``upsert=False`` and no such
        row, nothing is written and ``False`` is returned, but the claim holds (``job.lost``
        stays False): a missing row is not a lost claim. A row written by another job raises
        ``FenceConflict`` (the handler fails, so it is seen)."""
        if self.conn is None and self.borrow is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        # Known stale here (failed, timed out, told by a heartbeat): refused without a
        # round trip. Otherwise the statement itself checks the row's fence and the job's.
        answer = (
            STALE
            if self._lost
            else write_answer(
                self.connection(),
                table,
                key,
                values,
                self.fence,
                job_id=self.id,
                job_column=job_column,
                upsert=upsert,
                check_lease=True,
            )
        )
        return self._wrote(answer == WRITTEN, missing=answer == MISSING)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """The output of step ``name`` of this job: the stored JSON output if an earlier
        attempt (or this one) did the step, else ``fn()``'s, stored first under this claim.

        A done step costs one read and ``fn`` is not called: a job killed after two of three
        steps runs only the third on its next attempt. A new output is stored by one
        statement that checks the claim (running, this fence, a lease the server's clock has
        not passed) and locks the job row ``FOR SHARE``, so no takeover, cancel, reap or fail
        comes between the check and the write. If the claim is over, nothing is stored, the
        job is marked lost and ``LeaseLost`` is raised. What is returned is the output as
        stored (JSON: tuples come back as lists), the same on every attempt. An output that
        is not JSON raises ``BadInput`` naming the step (the job fails with it), and a name
        that is not one line of text raises ``BadInput`` before ``fn`` runs. Steps are kept
        with the job; ``prune`` removes them with it. Inside ``job.transaction()`` the step
        is part of that transaction, stored only if it commits: there it takes no lock of
        its own, since the commit's check holds the claim, so the job's heartbeats go on
        however long the block runs. Inside a transaction of your own the step's lock holds
        the claim to your commit, and heartbeats pass the job by meanwhile: keep such a
        transaction shorter than the lease, or use ``job.transaction()``. (Where ``fn()``
        returns an awaitable, the async face awaits it; a plain ``fn`` there runs on the
        event loop, so keep it short.)"""
        name = steps.step_name(self.id, name)
        if self.conn is None and self.borrow is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        if self._lost:  # known stale here: no round trip, and fn is not run
            raise steps.stale(self.id, self.fence, name)
        conn = self.connection()
        done = self._step_run(conn, "step_get", {"job": self.id, "name": name})
        if done is not None:
            return done[0]
        result = fn()
        output, answer = steps.encode(self.id, name, result)
        params = steps.put_params(self.id, self.fence, name, output)
        put = steps.put_statement(self._holding)
        held, stored = self._step_run(conn, put, params) or (False, False)
        if not self._wrote(held):
            raise steps.refused(self.id, self.fence, name)
        if stored:
            return answer
        # This claim had stored the step already (another call of it): that is the answer.
        again = self._step_run(conn, "step_get", {"job": self.id, "name": name})
        return answer if again is None else again[0]

    def _step_run(
        self, conn: psycopg.Connection, name: str, params: dict[str, Any]
    ) -> tuple[Any, ...] | None:
        try:
            cur = own_cursor(conn)
            return (cur.execute(statements.query(name), params)).fetchone()
        except psycopg.errors.UndefinedTable as exc:
            mapped = steps.missing(exc)
            if mapped is None:
                raise
            raise mapped from None

    @contextlib.contextmanager
    def transaction(self, *, lock_timeout: float = 5.0) -> Iterator[psycopg.Connection]:
        """A transaction on the job's connection that commits only while this claim holds:
        ``with job.transaction() as conn:`` yields the connection for the handler's
        own writes (plain SQL, ``job.fenced_write``, ``enqueue(..., conn=conn)``).

        As the block's last statement, right before COMMIT, the job row is checked in the
        same transaction (running, this fence, a lease the server's clock has not passed)
        and locked ``FOR SHARE``, so a cancel, fail or reap of the job waits for the commit:
        a write that commits was made while the claim was held. If the claim is over, the
        transaction is rolled back, the job is marked lost and ``LeaseLost`` is raised. An
        exception in the block rolls back and propagates, with no check. The outcome is
        recorded like a fenced write's (``fenced-write`` or ``fenced-write-rejected``).

        The lock is held for the one round trip from the check to COMMIT; a heartbeat of
        this job (an UPDATE of its row) waits that long too. The check waits at most
        ``lock_timeout`` seconds for a row another session holds locked; past it, it rolls
        back and raises ``PgQueueError``. Under REPEATABLE READ or SERIALIZABLE, a job row
        changed since the snapshot (by a heartbeat, say) makes the check raise psycopg's
        ``SerializationFailure``, also rolled back: run the block again. The connection
        must have no transaction open (``BadInput``)."""
        params = self._hold_params(lock_timeout)
        conn = self.connection()
        self._check_idle(conn.info.transaction_status)
        with conn.transaction():
            self._holding = True
            try:
                yield conn
            finally:
                self._holding = False
            held = False
            if not self._lost:  # known stale here (a heartbeat said so): no round trip
                cur = own_cursor(conn)
                cur.execute(statements.query("hold_for_commit_wait"), params)
                try:
                    cur.execute(statements.query("hold_for_commit"), params)
                    row = cur.fetchone()
                except psycopg.errors.LockNotAvailable as exc:
                    raise self._locked(lock_timeout) from exc
                held = row is not None
            self._committed(held)


# -- fenced writes to other tables: the statements of fencing.compose, sent and answered --
def fenced_write(
    conn: psycopg.Connection,
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    fence: int,
    *,
    job_id: int | None = None,
    fence_column: str = "fence",
    job_column: str = "job_id",
    upsert: bool = True,
    check_lease: bool = False,
) -> bool:
    """Write ``values`` to the row of ``table`` identified by ``key``, fenced by ``fence``;
    return whether the write took effect.

    With ``job_id`` (what ``Job.fenced_write`` passes) the table needs a ``job_column``
    (``bigint``) beside the fence column. The write takes effect if the row is missing
    (upsert inserts it with the job id and fence) or was written by the same job with a
    fence no newer than ``fence``: a claim may write its row again. An older fence of the
    same job is refused (``False``: a stale holder). A row written by another job, or
    without a job id, raises ``FenceConflict`` and is left as it was: fences of different
    jobs cannot be compared, so key such rows by job (the job column may be the key).

    Without ``job_id`` (tables with no job column) only a strictly newer fence is
    accepted: the same claim cannot write a row twice, and fences of different jobs are
    compared as if they were one counter, which they are not.

    With ``upsert`` (the default) a missing row is inserted (``key`` must be a unique key);
    without it, only an existing row is updated, and a missing one is ``False`` (nothing
    written; with a job id that is not a stale fence: ``write_answer`` tells them apart).

    With ``check_lease`` (needs ``job_id``; the table must be in the database of ``jobs``)
    the same statement also requires that job ``job_id`` is still running with this fence
    and a lease the server's clock has not passed; if not, nothing is written (``False``).

    pgqueue reads its replies as tuples whatever the connection's ``row_factory``.
    """
    answer = write_answer(
        conn, table, key, values, fence, job_id=job_id, fence_column=fence_column,
        job_column=job_column, upsert=upsert, check_lease=check_lease,
    )  # fmt: skip
    return answer == WRITTEN


def write_answer(
    conn: psycopg.Connection,
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    fence: int,
    *,
    job_id: int | None = None,
    fence_column: str = "fence",
    job_column: str = "job_id",
    upsert: bool = True,
    check_lease: bool = False,
) -> Answer:
    """``fenced_write``, answered in full: ``"written"``, ``"stale"`` (a newer fence of the
    job, or with ``check_lease`` a claim that is over) or ``"missing"`` (``upsert=False``
    and no such row: nothing to update, which says nothing about the claim)."""
    write = compose(
        table, key, values, fence, job_id, fence_column, job_column, upsert, check_lease
    )
    cur = own_cursor(conn)
    try:
        if (cur.execute(write.query, write.params)).rowcount == 1:
            return WRITTEN
    except psycopg.errors.UndefinedColumn as exc:
        if job_id is None:
            raise
        raise write.missing_column(exc) from exc
    if job_id is None:
        return STALE
    if write.holds is not None:
        held = (cur.execute(write.holds, write.params)).fetchone()
        if held is None:
            return STALE  # this holder's claim is over: stale, whatever the row holds
    return write.refused((cur.execute(write.lookup, write.key_params)).fetchone())
