"""A claimed job: what the claim returned, and whether this worker has since lost it."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from . import statements, steps
from .db import own_cursor
from .errors import BadInput, LeaseLost, PgQueueError
from .fencing import MISSING, STALE, WRITTEN, write_answer

# Guards the lazy creation of ``Job.lost_event`` against a concurrent ``mark_lost``.
_LOST_LOCK = threading.Lock()


@dataclass
class Job:
    """One claim of a job. ``fence`` is this holder's token: every later write carries it."""

    id: int
    queue: str
    payload: dict[str, Any]
    fence: int
    attempts: int
    max_attempts: int
    lease_until: datetime | None
    # Seconds the job had been due (since its run_at: its enqueue, unless delayed or
    # retried) when this claim took it, by the server's clock. A float: the claim's reply
    # parses it for a tenth of what a timestamp costs.
    waited: float | None = field(default=None, repr=False, compare=False)
    # Set by whoever claimed the job: the connection to write with, and an event recorder.
    conn: psycopg.Connection | None = field(default=None, repr=False, compare=False)
    on_event: Callable[[str, Job], None] | None = field(default=None, repr=False, compare=False)
    # This holder's own view of its lease, on its monotonic clock: set from the moment the
    # claim was sent, pushed on by each heartbeat that took effect. Past it the job is lost
    # even if no statement said so (a keeper that cannot reach the server cannot learn it).
    deadline: float = field(default=math.inf, repr=False, compare=False)
    # What the last fenced write of the job itself left: 'done', 'ready' (retry in
    # ``retry_in`` seconds), 'dead'; 'running' while held.
    status: str = field(default="running", compare=False)
    retry_in: float | None = field(default=None, repr=False, compare=False)
    # A plain flag, and a threading.Event made only if someone asks for one: building an
    # Event per claimed job was the largest client cost of a Worker draining small jobs.
    _lost: bool = field(default=False, init=False, repr=False, compare=False)
    _lost_event: threading.Event | None = field(default=None, init=False, repr=False, compare=False)
    # Inside ``job.transaction()``: its commit checks and holds the claim, so a step there
    # takes no lock of its own (one held to COMMIT would starve the job's heartbeats).
    _holding: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def lost(self) -> bool:
        """True once a heartbeat or write found that someone else holds the job now, or
        once the lease ran out on this holder's clock with no heartbeat taking effect."""
        return self._lost or time.monotonic() >= self.deadline

    @property
    def lost_event(self) -> threading.Event:
        """A ``threading.Event`` set when the job is lost, for handlers that wait on it."""
        with _LOST_LOCK:
            if self._lost_event is None:
                self._lost_event = threading.Event()
                if self.lost:
                    self._lost_event.set()
            return self._lost_event

    def mark_lost(self) -> None:
        """Record that this holder's fence is stale (set by the worker, read by handlers)."""
        with _LOST_LOCK:
            self._lost = True
            if self._lost_event is not None:
                self._lost_event.set()

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLost`` if the job was taken over; call it between steps of long work."""
        if self._lost:
            raise LeaseLost(f"job {self.id}: fence {self.fence} is stale; discard this work")
        if self.lost:
            raise LeaseLost(
                f"job {self.id}: the lease ran out here before a heartbeat renewed it "
                "(another worker may hold it now); discard this work"
            )

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
        if self.conn is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        # Known stale here (failed, timed out, told by a heartbeat): refused without a
        # round trip. Otherwise the statement itself checks the row's fence and the job's.
        answer = (
            STALE
            if self._lost
            else write_answer(
                self.conn,
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
        transaction shorter than the lease, or use ``job.transaction()``."""
        name = steps.step_name(self.id, name)
        if self.conn is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        conn = self.conn
        if self._lost:  # known stale here: no round trip, and fn is not run
            raise steps.stale(self.id, self.fence, name)
        done = self._step_run(conn, "step_get", {"job": self.id, "name": name})
        if done is not None:
            return done[0]
        output, answer = steps.encode(self.id, name, fn())
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
            return own_cursor(conn).execute(statements.query(name), params).fetchone()
        except psycopg.errors.UndefinedTable as exc:
            mapped = steps.missing(exc)
            if mapped is None:
                raise
            raise mapped from None

    @contextmanager
    def transaction(self, *, lock_timeout: float = 5.0) -> Iterator[psycopg.Connection]:
        """A transaction on the job's connection that commits only while this claim holds:
        ``with job.transaction() as conn:`` yields the connection for the handler's own
        writes (plain SQL, ``job.fenced_write``, ``Queue.enqueue(..., conn=conn)``).

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
        if self.conn is None:
            raise LeaseLost(f"job {self.id} has no connection to write with; claim it first")
        conn = self.conn
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
                    row = cur.execute(statements.query("hold_for_commit"), params).fetchone()
                except psycopg.errors.LockNotAvailable as exc:
                    raise self._locked(lock_timeout) from exc
                held = row is not None
            self._committed(held)

    def _hold_params(self, lock_timeout: float) -> dict[str, Any]:
        """The parameters of ``transaction()``'s statements; raise if it cannot start."""
        if self._lost:
            raise LeaseLost(f"job {self.id}: fence {self.fence} is stale; no transaction opened")
        if isinstance(lock_timeout, bool) or not (
            isinstance(lock_timeout, int | float) and 0 < lock_timeout <= 86400
        ):
            raise BadInput(
                f"lock_timeout must be more than 0 and at most 86400 seconds, not {lock_timeout!r}"
            )
        # lock_timeout is set in whole milliseconds, as text (set_config takes text).
        return {"job": self.id, "fence": self.fence, "ms": str(max(1, round(lock_timeout * 1000)))}

    def _check_idle(self, status: TransactionStatus) -> None:
        """``transaction()`` commits its own transaction: it cannot be nested in another."""
        if status != TransactionStatus.IDLE:
            raise BadInput(
                f"job {self.id}: job.transaction() needs a connection with no transaction "
                "open (commit or roll back first, or write inside the one block)"
            )

    def _locked(self, lock_timeout: float) -> PgQueueError:
        """What a ``hold_for_commit`` that ran out of ``lock_timeout`` raises."""
        return PgQueueError(
            f"job {self.id}: its row stayed locked by another session for {lock_timeout:g} s, "
            "so the claim could not be checked before commit; the transaction was rolled back"
        )

    def _committed(self, held: bool) -> None:
        """After ``hold_for_commit`` (Job's or AsyncJob's): if the claim is over, mark the
        job lost and raise ``LeaseLost`` (inside the transaction, which rolls back)."""
        self._wrote(held)
        if not held:
            raise LeaseLost(
                f"job {self.id}: the claim with fence {self.fence} was over at commit "
                "(cancelled, failed, reaped or its lease ran out); the transaction was rolled back"
            )

    def _wrote(self, took_effect: bool, *, missing: bool = False) -> bool:
        """After a fenced write (Job's or AsyncJob's): a refusal means this holder's fence
        is stale, so the job is lost, unless the write found no row to update (``missing``),
        which says nothing about the claim; record how it went."""
        if not took_effect and not missing:
            self.mark_lost()
        if self.on_event:
            kind = "fenced-write" if took_effect else "fenced-write-rejected"
            self.on_event("fenced-write-missing" if missing else kind, self)
        return took_effect
