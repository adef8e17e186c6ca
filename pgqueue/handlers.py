"""How the engine runs handlers, which are user code: what a handler raised becomes a
``Failure``; plain functions run on lane threads, each lane with a connection of its own;
coroutines borrow from a small pool; and every connection a handler had is checked and
reset before the next job gets it. The engine's own connections are never lent."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.pq import TransactionStatus

from .db import async_own_cursor, first_line, own_cursor
from .errors import BadInput, GiveUp, RetryAfter, retry_delay
from .inputs import JsonText, printable, result_text
from .job import Job


@dataclass(frozen=True)
class Failure:
    """How a handler failed: the error text for ``last_error``, and what it asked for."""

    error: str
    delay: float | None = None  # RetryAfter
    give_up: bool = False  # GiveUp
    traceback: str | None = None  # where it was raised, from the handler's own frame on


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
    """What a handler's exception (``BaseException`` included) does to its job, with the
    traceback that says where it was raised."""
    trace = traceback_of(exc)
    if isinstance(exc, GiveUp):
        return Failure(describe(exc), give_up=True, traceback=trace)
    if isinstance(exc, RetryAfter):
        try:
            return Failure(describe(exc), delay=retry_delay(exc), traceback=trace)
        except BaseException as bad:  # a delay the fail statement would refuse
            return Failure(describe(bad), traceback=trace)
    return Failure(describe(exc), traceback=trace)


_OURS = Path(__file__).resolve().parent  # pgqueue's own frames: not the user's story


def traceback_of(exc: BaseException) -> str | None:
    """The traceback of a handler's exception from the handler's own frame on (the engine's
    frames that called it are left out), as Python prints it; None if it cannot be read
    (a user's exception can break even that)."""
    try:
        tb = exc.__traceback__
        while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().parent == _OURS:
            tb = tb.tb_next
        return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    except BaseException:  # a __str__ or __repr__ of the user's that raises
        return None


# DISCARD ALL without DEALLOCATE ALL: psycopg answers a DISCARD ALL by sending DEALLOCATE
# ALL later, which then drops a statement it has prepared again meanwhile ("prepared
# statement _pg3_0 does not exist" in the next job, seen in the chaos run). So the handler's
# own PREPAREs (from_sql) are deallocated one by one, psycopg's left alone. RESET ALL does
# not undo SET SESSION AUTHORIZATION: that has its own RESET, first (it also ends a SET ROLE).
RESET_SESSION = (
    "RESET SESSION AUTHORIZATION; RESET ALL; CLOSE ALL; UNLISTEN *; "
    "SELECT pg_advisory_unlock_all(); DISCARD TEMP; DISCARD SEQUENCES; "
    "DO $$DECLARE s text; BEGIN FOR s IN SELECT name FROM pg_prepared_statements "
    "WHERE from_sql LOOP EXECUTE format('DEALLOCATE %I', s); END LOOP; END$$"
)

# psycopg's client-side settings of a connection, which no statement to the server resets.
_SETTINGS = (
    "read_only",
    "isolation_level",
    "deferrable",
    "row_factory",
    "cursor_factory",
    "prepare_threshold",
    "prepared_max",
)


@dataclass(frozen=True)
class ClientState:
    """A connection's client-side state as psycopg keeps it: its settings (put back after
    a job that changed them) and what cannot be put back, only seen (adapters registered
    on the connection, notice and notify handlers added): a connection whose state of that
    kind changed is closed instead of lent again."""

    settings: tuple[object, ...]
    sealed: tuple[object, ...]

    @classmethod
    def of(cls, conn: psycopg.Connection | psycopg.AsyncConnection) -> ClientState:
        return cls(tuple(getattr(conn, name) for name in _SETTINGS), _sealed(conn))

    def changed(self, conn: psycopg.Connection | psycopg.AsyncConnection) -> list[str]:
        """The names of the settings ``conn`` has changed since (its sealed part is
        ``restorable``'s: not read again here)."""
        return [
            name
            for name, was in zip(_SETTINGS, self.settings, strict=True)
            if getattr(conn, name) != was
        ]

    def restorable(self, conn: psycopg.Connection | psycopg.AsyncConnection) -> bool:
        return _sealed(conn) == self.sealed

    def restore(self, conn: psycopg.Connection) -> None:
        """Put the settings back (the connection is idle: after any rollback)."""
        for name, was in zip(_SETTINGS, self.settings, strict=True):
            if getattr(conn, name) != was:
                setattr(conn, name, was)

    async def async_restore(self, conn: psycopg.AsyncConnection) -> None:
        """``restore`` for an ``AsyncConnection``, whose transaction settings are set by
        coroutines."""
        for name, was in zip(_SETTINGS, self.settings, strict=True):
            if getattr(conn, name) == was:
                continue
            setter = getattr(conn, f"set_{name}", None) if name in _SETTINGS[:3] else None
            if setter is not None:
                await setter(was)
            else:
                setattr(conn, name, was)


def _sealed(conn: psycopg.Connection | psycopg.AsyncConnection) -> tuple[object, ...]:
    """What a handler may have added to a connection and pgqueue cannot take back: adapters
    registered on it (psycopg copies the global map on write: an owned part means one was)
    and notice or notify handlers. psycopg's private fields, read defensively: a future
    psycopg without them only makes this see less, never fail."""
    adapters = getattr(conn, "_adapters", None)
    owned = (
        any(getattr(adapters, "_own_dumpers", {}).values())
        or any(getattr(adapters, "_own_dumpers_by_oid", ()))
        or any(getattr(adapters, "_own_loaders", ()))
    )
    notices = len(getattr(conn, "_notice_handlers", ()))
    notifies = len(getattr(conn, "_notify_handlers", ()))
    return (owned, notices, notifies)


LEFT_OPEN = Failure("the handler left a transaction open; it was rolled back")


def is_coroutine_function(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


# -- the connections handlers get --------------------------------------------------------
def reset_steps(
    conn: psycopg.Connection | psycopg.AsyncConnection, pgbouncer: bool, state: ClientState
) -> list[str]:
    """What to do with a connection a handler had before the next job gets it, decided
    from its state alone: ``drop`` (closed, broken, autocommit turned off, or adapters or
    handlers added on it: no reset undoes those), ``rollback`` (a transaction left open or
    failed: the job fails too), ``restore`` (client settings such as ``read_only`` or
    ``row_factory`` changed: put back as ``state`` has them), ``discard``
    (``RESET_SESSION`` undoes its SETs, session authorization, cursors, LISTENs, advisory
    locks, temp tables and PREPAREs; behind PgBouncer session state does not stick, so
    nothing to undo)."""
    if conn.closed or conn.broken:
        return ["drop"]
    steps = []
    if conn.info.transaction_status != TransactionStatus.IDLE:
        steps.append("rollback")
    if not conn.autocommit or not state.restorable(conn):
        steps.append("drop")
    elif state.changed(conn):
        steps.append("restore")
    if "drop" not in steps and not pgbouncer:
        steps.append("discard")
    return steps


def reset(conn: psycopg.Connection, pgbouncer: bool, state: ClientState) -> tuple[bool, bool]:
    """Reset a plain handler's connection to ``state``, its state when it was opened:
    (keep it, a transaction was left open)."""
    steps = reset_steps(conn, pgbouncer, state)
    try:
        if "drop" not in steps and "rollback" in steps:
            conn.rollback()
        if "restore" in steps:
            state.restore(conn)
        if "discard" in steps:
            own_cursor(conn).execute(RESET_SESSION, prepare=False)
    except psycopg.Error:
        steps.append("drop")
    return "drop" not in steps, "rollback" in steps


async def async_reset(
    conn: psycopg.AsyncConnection, pgbouncer: bool, state: ClientState
) -> tuple[bool, bool]:
    """``reset`` for an async handler's connection."""
    steps = reset_steps(conn, pgbouncer, state)
    try:
        if "drop" not in steps and "rollback" in steps:
            await conn.rollback()
        if "restore" in steps:
            await state.async_restore(conn)
        if "discard" in steps:
            await async_own_cursor(conn).execute(RESET_SESSION, prepare=False)
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
        self._states: dict[int, ClientState] = {}  # each connection's as it was opened
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
                self._states.pop(id(conn), None)
            conn = await self._connect()
            self._states[id(conn)] = ClientState.of(conn)
            return conn
        except BaseException:
            self._slots.release()
            raise

    async def put(self, conn: psycopg.AsyncConnection) -> bool:
        """Take a connection back, reset; True if it was left in a transaction."""
        keep = left_open = False
        state = self._states.get(id(conn))
        try:
            if state is not None:  # (never None: only the pool's own come back)
                keep, left_open = await async_reset(conn, self._pgbouncer, state)
        finally:
            self._slots.release()
        if keep and not self.closed:
            self._idle.append(conn)
        else:
            self._states.pop(id(conn), None)
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
