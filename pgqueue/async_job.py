"""``AsyncJob``: a claimed job for coroutine handlers, whose writes are awaited.

It is a ``Job`` (same fields, fence, lost flag and local lease deadline) whose
``fenced_write`` is a coroutine and whose connection is an ``AsyncConnection``. An
``AsyncQueue`` claims jobs with its own connection as ``conn``. An ``AsyncWorker``
gives a job no connection at first: ``await job.connection()`` lends it one from the
worker's small pool on first use, and the job keeps it until its handler returns. So
five hundred handlers awaiting I/O need no connection at all, and those that write
each get one of their own: an ``AsyncConnection`` runs one statement at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from . import statements, steps
from .db import async_own_cursor
from .errors import LeaseLost
from .fencing import MISSING, STALE, WRITTEN, async_write_answer
from .job import Job

Borrow = Callable[[], Awaitable[psycopg.AsyncConnection]]


@dataclass
class AsyncJob(Job):
    """One claim of a job, for coroutine handlers (``await job.fenced_write(...)``)."""

    conn: psycopg.AsyncConnection | None = field(  # type: ignore[assignment]
        default=None, repr=False, compare=False
    )
    # Set by an AsyncWorker: lends the job a connection on first use (None: use ``conn``).
    borrow: Borrow | None = field(default=None, repr=False, compare=False)
    # The connection ``borrow`` lent, given back when the handler returns (even if the
    # handler put another in ``conn``).
    lent: psycopg.AsyncConnection | None = field(default=None, repr=False, compare=False)
    _borrowing: asyncio.Lock | None = field(default=None, init=False, repr=False, compare=False)

    async def connection(self) -> psycopg.AsyncConnection:
        """The connection to write with: the claimer's, or (in an ``AsyncWorker``) one lent
        to this job on first use and kept until its handler returns (autocommit; a
        transaction it leaves open is rolled back and the job failed)."""
        if self.conn is not None:
            return self.conn
        if self.borrow is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        if self._borrowing is None:  # two writes of one handler at once borrow once
            self._borrowing = asyncio.Lock()
        async with self._borrowing:
            if self.conn is None:
                self.conn = self.lent = await self.borrow()
        return self.conn

    async def fenced_write(  # type: ignore[override]
        self,
        table: str,
        key: Mapping[str, Any],
        values: Mapping[str, Any],
        *,
        upsert: bool = True,
        job_column: str = "job_id",
    ) -> bool:
        """Write to another table with this job's fence and id (see ``Job.fenced_write``
        and ``pgqueue.fenced_write``); return whether it took effect. The statement checks the
        job in ``jobs`` too (still running, this fence, lease not run out). A refused write
        marks the job lost; ``upsert=False`` on a missing row writes nothing and returns
        ``False`` with the claim still held; a row written by another job raises
        ``FenceConflict``."""
        if self.conn is None and self.borrow is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        # Known stale here (failed, timed out, told by a heartbeat): refused without a
        # round trip. Otherwise the statement itself checks the row's fence and the job's.
        answer = (
            STALE
            if self._lost
            else await async_write_answer(
                await self.connection(),
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

    async def step(self, name: str, fn: Callable[[], Any]) -> Any:  # type: ignore[override]
        """``Job.step``, awaited: ``await job.step("charge", fn)`` returns the stored output
        of a step done by an earlier attempt, else awaits ``fn()`` (a coroutine function,
        or a plain one, called on the event loop: keep it short) and stores its output under
        this claim, checked and locked ``FOR SHARE`` in the same statement. A claim that is
        over stores nothing, marks the job lost and raises ``LeaseLost``; an output that is
        not JSON raises ``BadInput`` naming the step."""
        name = steps.step_name(self.id, name)
        if self.conn is None and self.borrow is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        if self._lost:  # known stale here: no round trip, and fn is not run
            raise steps.stale(self.id, self.fence, name)
        conn = await self.connection()
        done = await self._async_step_run(conn, "step_get", {"job": self.id, "name": name})
        if done is not None:
            return done[0]
        result = fn()
        if inspect.isawaitable(result):
            result = await result
        output, answer = steps.encode(self.id, name, result)
        params = steps.put_params(self.id, self.fence, name, output)
        put = steps.put_statement(self._holding)
        held, stored = await self._async_step_run(conn, put, params) or (False, False)
        if not self._wrote(held):
            raise steps.refused(self.id, self.fence, name)
        if stored:
            return answer
        # This claim had stored the step already (another call of it): that is the answer.
        again = await self._async_step_run(conn, "step_get", {"job": self.id, "name": name})
        return answer if again is None else again[0]

    async def _async_step_run(
        self, conn: psycopg.AsyncConnection, name: str, params: dict[str, Any]
    ) -> tuple[Any, ...] | None:
        try:
            cur = async_own_cursor(conn)
            return await (await cur.execute(statements.query(name), params)).fetchone()
        except psycopg.errors.UndefinedTable as exc:
            mapped = steps.missing(exc)
            if mapped is None:
                raise
            raise mapped from None

    @contextlib.asynccontextmanager
    async def transaction(  # type: ignore[override]
        self, *, lock_timeout: float = 5.0
    ) -> AsyncIterator[psycopg.AsyncConnection]:
        """``Job.transaction()``, awaited: ``async with job.transaction() as conn:`` opens a
        transaction on ``await job.connection()`` and, as its last statement before COMMIT,
        checks the claim and locks the job row ``FOR SHARE``, so a cancel, fail or reap
        waits for the commit (a heartbeat of the job too, for that one round trip). A claim
        that is over rolls back, marks the job lost and raises ``LeaseLost``; an exception
        in the block rolls back and propagates. The same ``lock_timeout`` and isolation
        rules as ``Job.transaction()``."""
        params = self._hold_params(lock_timeout)
        conn = await self.connection()
        self._check_idle(conn.info.transaction_status)
        async with conn.transaction():
            self._holding = True
            try:
                yield conn
            finally:
                self._holding = False
            held = False
            if not self._lost:  # known stale here (a heartbeat said so): no round trip
                cur = async_own_cursor(conn)
                await cur.execute(statements.query("hold_for_commit_wait"), params)
                try:
                    await cur.execute(statements.query("hold_for_commit"), params)
                    row = await cur.fetchone()
                except psycopg.errors.LockNotAvailable as exc:
                    raise self._locked(lock_timeout) from exc
                held = row is not None
            self._committed(held)
