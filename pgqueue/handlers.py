"""How the engine runs handlers, which are user code: what a handler raised becomes a
``Failure``; plain functions run on lane threads, each lane with a connection of its own;
coroutines borrow from a small pool; and every connection a handler had is checked and
reset before the next job gets it. The engine's own connections are never lent."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psycopg
from psycopg.pq import TransactionStatus

from .db import first_line
from .errors import BadInput, GiveUp, RetryAfter, retry_delay
from .job import Job
from .params import JsonText, printable, result_text


@dataclass(frozen=True)
class Failure:
    """How a handler failed: the error text for ``last_error``, and what it asked for."""

    error: str
    delay: float | None = None  # RetryAfter
    give_up: bool = False  # GiveUp


@dataclass(frozen=True)
class Done:
    """A handler that returned a value to store with its job: that value's JSON text."""

    result: JsonText


Outcome = Failure | Done | None  # how a handler ended; None: it returned None


def outcome_of(value: object) -> Outcome:
    """What a handler's return value does to its job: None stores nothing, else its JSON
    text is stored (encoded here, on the handler's lane thread or in its task). A value
    that cannot be stored (not JSON, over ``MAX_RESULT_BYTES``) sends the job dead at once:
    the handler would return it again, and its side effects would run again for nothing."""
    if value is None:
        return None
    try:
        text = result_text(value)
    except BadInput as exc:
        return Failure(describe(exc), give_up=True)
    assert text is not None
    return Done(text)


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``: what a job's ``last_error`` and logs say. Never
    raises: an exception whose ``__str__`` itself fails is still named."""
    try:
        text = first_line(exc) if str(exc).strip() else ""
    except BaseException:  # a user's __str__ can raise anything
        text = "(its message could not be read: its __str__ raised)"
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    # Printable as well as storable: a lone surrogate would make the log line itself fail.
    return printable(line)


def failure_of(exc: BaseException) -> Failure:
    """What a handler's exception (``BaseException`` included) does to its job."""
    if isinstance(exc, GiveUp):
        return Failure(describe(exc), give_up=True)
    if isinstance(exc, RetryAfter):
        try:
            return Failure(describe(exc), delay=retry_delay(exc))
        except BaseException as bad:  # a delay the fail statement would refuse
            return Failure(describe(bad))
    return Failure(describe(exc))


# DISCARD ALL without DEALLOCATE ALL: psycopg answers a DISCARD ALL by sending DEALLOCATE
# ALL later, which then drops a statement it has prepared again meanwhile ("prepared
# statement _pg3_0 does not exist" in the next job, seen in the chaos run).
RESET_SESSION = (
    "RESET ALL; CLOSE ALL; UNLISTEN *; SELECT pg_advisory_unlock_all(); "
    "DISCARD TEMP; DISCARD SEQUENCES"
)

LEFT_OPEN = Failure("the handler left a transaction open; it was rolled back")


def is_coroutine_function(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


# -- the connections handlers get --------------------------------------------------------
def reset_steps(conn: psycopg.Connection | psycopg.AsyncConnection, pgbouncer: bool) -> list[str]:
    """What to do with a connection a handler had before the next job gets it, decided
    from its state alone: ``drop`` (closed, broken, or autocommit turned off: no reset
    undoes that), ``rollback`` (a transaction left open or failed: the job fails too),
    ``discard`` (``RESET_SESSION`` undoes its SETs, cursors, LISTENs, advisory locks and
    temp tables; behind PgBouncer session state does not stick, so nothing to undo)."""
    if conn.closed or conn.broken:
        return ["drop"]
    steps = []
    if conn.info.transaction_status != TransactionStatus.IDLE:
        steps.append("rollback")
    if not conn.autocommit:
        steps.append("drop")
    elif not pgbouncer:
        steps.append("discard")
    return steps


def reset(conn: psycopg.Connection, pgbouncer: bool) -> tuple[bool, bool]:
    """Reset a plain handler's connection: (keep it, a transaction was left open)."""
    steps = reset_steps(conn, pgbouncer)
    try:
        if "drop" not in steps and "rollback" in steps:
            conn.rollback()
        if "discard" in steps:
            conn.execute(RESET_SESSION)
    except psycopg.Error:
        steps.append("drop")
    return "drop" not in steps, "rollback" in steps


async def async_reset(conn: psycopg.AsyncConnection, pgbouncer: bool) -> tuple[bool, bool]:
    """``reset`` for an async handler's connection."""
    steps = reset_steps(conn, pgbouncer)
    try:
        if "drop" not in steps and "rollback" in steps:
            await conn.rollback()
        if "discard" in steps:
            await conn.execute(RESET_SESSION)
    except psycopg.Error:
        steps.append("drop")
    return "drop" not in steps, "rollback" in steps


class ConnectionPool:
    """The connections lent to async handlers: at most ``size`` at once, opened on first
    use, reset when given back and kept for the next handler; one a handler broke or
    changed past resetting is closed. (A minimal pool: psycopg_pool is not a dependency.)"""

    def __init__(
        self, size: int, connect: Callable[[], Awaitable[psycopg.AsyncConnection]], pgbouncer: bool
    ) -> None:
        self._connect = connect
        self._pgbouncer = pgbouncer
        self._idle: list[psycopg.AsyncConnection] = []
        self._slots = asyncio.Semaphore(size)
        self.closed = False

    async def get(self) -> psycopg.AsyncConnection:
        """A connection of the pool's, waiting while ``size`` are lent."""
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if not (conn.closed or conn.broken):
                    return conn
            return await self._connect()
        except BaseException:
            self._slots.release()
            raise

    async def put(self, conn: psycopg.AsyncConnection) -> bool:
        """Take a connection back, reset; True if it was left in a transaction."""
        keep = left_open = False
        try:
            keep, left_open = await async_reset(conn, self._pgbouncer)
        finally:
            self._slots.release()
        if keep and not self.closed:
            self._idle.append(conn)
        else:
            with contextlib.suppress(Exception):
                await conn.close()
        return left_open

    async def close(self) -> None:
        """Close the idle connections; those still lent are closed when given back."""
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                await conn.close()


class LaneJob(Job):
    """The ``Job`` a plain handler gets: ``job.conn`` is its lane's connection, opened the
    first time the handler asks for it, so a handler that never writes costs none."""

    _open: Callable[[], psycopg.Connection] | None = None
    _lane_conn: psycopg.Connection | None = None

    @property  # type: ignore[override]
    def conn(self) -> psycopg.Connection | None:
        if self._lane_conn is None and self._open is not None:
            self._lane_conn = self._open()
        return self._lane_conn

    @conn.setter
    def conn(self, value: psycopg.Connection | None) -> None:
        self._lane_conn = value
