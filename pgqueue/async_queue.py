"""``AsyncQueue``: ``Queue`` on psycopg's ``AsyncConnection``, method by method.

The same statements (``sql/queries.sql``), the same validation and errors, the same
replies: each method builds its parameters and reads its reply with the helpers of
``queue.py``; only the waiting is different. This is the face the worker runs (under
``Worker`` as well as ``AsyncWorker``: the engine is one event loop); the notebooks drive
the sync ``Queue``.

>>> async with pgqueue.AsyncQueue(dsn) as q:
...     await q.enqueue({"to": "a@example.com"}, queue="emails")
...     async with conn.transaction():                 # your own AsyncConnection
...         await q.enqueue({"order": 42}, queue="invoices", conn=conn)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from . import defaults, statements
from .async_job import AsyncJob
from .db import async_own_cursor, connecting, pgbouncer_mode, resolve_dsn
from .errors import KeyRace, PgQueueError, SlotRace
from .install import (
    DEFAULT_LOCK_TIMEOUT,
    Catalog,
    Installation,
    Step,
    bad_statuses,
    block,
    blocked,
    brief_steps,
    catalog,
    lock_timeout_setting,
    not_outside_a_transaction,
    slow_steps,
)
from .params import (
    COPY_TYPES,
    KEY_TRIES,
    RESULT_POLL,
    SLOT_TRIES,
    ClaimRoute,
    Keyed,
    Pruning,
    Retried,
    beat,
    beat_many,
    checked_job_id,
    checked_lease,
    claim_args,
    complete_many_params,
    complete_params,
    completed_many,
    copy_rows,
    end_reply,
    enqueue_many_params,
    enqueue_many_route,
    enqueue_params,
    fail_params,
    fail_reply,
    finished_estimate,
    held_params,
    key_race,
    limit_params,
    pgqueue_error,
    prune_args,
    reserved,
    result_args,
    result_of,
    result_wait,
    retried_reply,
    retry_dead_plan,
    schedule_clock_reply,
    stats_reply,
    your_async_conn,
)
from .periodic import Schedule, tick_params
from .queue import JobState, Limit, Reaped, ScheduleState
from .steps import StepState

AsyncCursor = psycopg.AsyncCursor[Any]
# Planned afresh at each call, never prepared: the AsyncWorker completes whatever finished
# while its last statement was in flight, so its arrays run to thousands of ids, and a
# prepared statement's generic plan (chosen after five calls) cannot see their length.
# Measured: complete_many of 3,000 ids, 3.3 s with the generic plan, 33 ms planned.
_PLANNED_EACH_CALL = frozenset({"complete_many", "complete_many_results", "heartbeat_many"})

_NOT_PREPARED = frozenset({"listen_done", "unlisten_done"})  # utility statements


async def async_connect(
    dsn: str | None = None,
    *,
    autocommit: bool = True,
    application_name: str = "pgqueue",
    pgbouncer: bool = False,
) -> psycopg.AsyncConnection:
    """``pgqueue.connect`` for asyncio: the same DSN order, keepalives and one-line errors.
    Finding the DSN may start the embedded server: that runs in a thread, not the loop."""
    target = dsn or await asyncio.to_thread(resolve_dsn, dsn)
    with connecting(target, autocommit=autocommit, application_name=application_name) as kw:
        conn = await psycopg.AsyncConnection.connect(target, **kw)
    if pgbouncer:
        conn.prepare_threshold = None
    return conn


class AsyncQueue:
    """The jobs table behind one ``AsyncConnection`` (opened from a DSN, or yours).

    ``async with AsyncQueue(dsn) as q:`` opens it (or ``await q.open()``); every method of
    ``Queue`` is here with the same name and arguments, awaited. Pass ``conn=`` (an
    ``AsyncConnection``, or SQLAlchemy's ``AsyncConnection`` or ``AsyncSession`` on psycopg
    3) to ``enqueue``/``enqueue_many`` to write inside your own transaction: the job
    commits or rolls back with your data.
    """

    def __init__(
        self,
        target: str | psycopg.AsyncConnection | None = None,
        *,
        application_name: str = "pgqueue",
        pgbouncer: bool | None = None,
    ) -> None:
        self._owned = not isinstance(target, psycopg.AsyncConnection)
        self._dsn = None if isinstance(target, psycopg.AsyncConnection) else target
        self._application_name = application_name
        self.pgbouncer = pgbouncer_mode(pgbouncer)
        self._prepare = not self.pgbouncer  # False: never, even on a connection of yours
        self._route = ClaimRoute()  # which claim statement each queue needs (a guess)
        self._conn = target if isinstance(target, psycopg.AsyncConnection) else None

    @property
    def conn(self) -> psycopg.AsyncConnection:
        """The connection (``PgQueueError`` until ``open()`` or ``async with``)."""
        if self._conn is None:
            raise PgQueueError("AsyncQueue is not open: use `async with AsyncQueue(...) as q`")
        return self._conn

    # -- lifecycle -------------------------------------------------------------------
    async def open(self) -> AsyncQueue:
        """Connect, if this queue opens its own connection and has not yet."""
        if self._conn is None:
            self._conn = await async_connect(
                self._dsn, application_name=self._application_name, pgbouncer=self.pgbouncer
            )
        return self

    async def close(self) -> None:
        """Close the connection if this queue opened it."""
        if self._owned and self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def __aenter__(self) -> AsyncQueue:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def install(
        self, *, notify: bool | None = None, lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    ) -> Installation:
        """``Queue.install``: add what is missing, and on a current table lock nothing."""
        timeout = lock_timeout_setting(lock_timeout)
        conn, changed = self.conn, list[str]()
        step: Step | None = None  # what it was about to do, for InstallBlocked
        try:
            found = await self._catalog()
            if brief_steps(found, notify):
                async with conn.transaction():
                    await async_own_cursor(conn).execute(
                        block("lock_timeout"), {"timeout": timeout, "local": True}
                    )
                    await async_own_cursor(conn).execute(block("install_lock"), prepare=False)
                    for step in brief_steps(await self._catalog(), notify):
                        await async_own_cursor(conn).execute(step.statement, prepare=False)
                        changed.append(step.what)
                step, found = None, await self._catalog()
            if slow_steps(found):
                if not conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE:
                    raise not_outside_a_transaction()
                async with self._one_upgrade(timeout):
                    for step in slow_steps(await self._catalog()):
                        if step.concurrent:
                            await async_own_cursor(conn).execute(step.statement, prepare=False)
                        else:
                            async with conn.transaction():
                                await async_own_cursor(conn).execute(
                                    block("lock_timeout"), {"timeout": timeout, "local": True}
                                )
                                await async_own_cursor(conn).execute(step.statement, prepare=False)
                        changed.append(step.what)
                step, found = None, await self._catalog()
        except psycopg.errors.LockNotAvailable:
            cur = await async_own_cursor(conn).execute(block("lock_holders"), prepare=False)
            raise blocked(step, lock_timeout, await cur.fetchone()) from None
        except psycopg.errors.CheckViolation:
            raise bad_statuses() from None
        return Installation(changed, found.notify_trigger)

    @asynccontextmanager
    async def _one_upgrade(self, timeout: str) -> AsyncIterator[None]:
        """``Queue._one_upgrade``: one upgrade at a time, under the lock timeout."""
        if self.pgbouncer:
            yield
            return
        conn = self.conn
        [previous] = await (
            await async_own_cursor(conn).execute(block("current_lock_timeout"))
        ).fetchone() or ["0"]
        await async_own_cursor(conn).execute(
            block("lock_timeout"), {"timeout": timeout, "local": False}
        )
        try:
            await async_own_cursor(conn).execute(block("install_lock_session"), prepare=False)
            try:
                yield
            finally:
                await async_own_cursor(conn).execute(block("install_unlock_session"), prepare=False)
        finally:
            await async_own_cursor(conn).execute(
                block("lock_timeout"), {"timeout": previous, "local": False}
            )

    async def _catalog(self) -> Catalog:
        """What is installed, read from the catalog in one snapshot."""
        async with self.conn.transaction():
            found = await (
                await async_own_cursor(self.conn).execute(block("installed"), prepare=False)
            ).fetchone()
            cur = await async_own_cursor(self.conn).execute(
                block("installed_indexes"), prepare=False
            )
            indexes = await cur.fetchall()
        assert found is not None  # one row, always
        return catalog(found, indexes)

    async def check(self) -> None:
        """Raise ``NotInstalled`` unless the jobs table exists (cheap: reads no rows)."""
        await self._run("check", {})

    # -- producing -------------------------------------------------------------------
    async def enqueue(
        self,
        payload: dict[str, Any],
        *,
        queue: str = "default",
        delay: float = 0.0,
        run_at: datetime | None = None,
        max_attempts: int = defaults.MAX_ATTEMPTS,
        priority: int = 0,
        key: str | None = None,
        group: str | None = None,
        conn: psycopg.AsyncConnection | Any = None,
    ) -> int:
        """``Queue.enqueue``: add one job and return its id (inside ``conn``'s transaction
        if given); a live job holding ``key`` is returned instead of adding one."""
        params = enqueue_params(payload, queue, delay, run_at, max_attempts, priority, key, group)
        conn = await your_async_conn(conn)
        for _ in range(KEY_TRIES):
            row = await self._one("enqueue", params, conn)
            if row is not None:
                return int(row[0])
        raise key_race(key)

    async def enqueue_many(
        self,
        payloads: Iterable[dict[str, Any]],
        *,
        queue: str = "default",
        delay: float = 0.0,
        run_at: datetime | None = None,
        max_attempts: int = defaults.MAX_ATTEMPTS,
        priority: int = 0,
        keys: Sequence[str | None] | None = None,
        group: str | None = None,
        conn: psycopg.AsyncConnection | Any = None,
    ) -> list[int]:
        """``Queue.enqueue_many``: many jobs in one write, all or none; their ids in order."""
        params = enqueue_many_params(
            payloads, queue, delay, run_at, max_attempts, priority, keys, group
        )
        how = enqueue_many_route(params)
        if how == "none":
            return []
        conn = await your_async_conn(conn)
        if how == "insert":
            return [int(r[0]) for r in await self._all("enqueue_many", params, conn)]
        reserve = params | {"n": len(params["payloads"])}
        ids, run_at = reserved(await self._one("enqueue_reserve", reserve, conn))
        if how == "copy":
            async with (
                (conn or self.conn).cursor() as cursor,
                cursor.copy(statements.query("enqueue_copy")) as copy,
            ):
                copy.set_types(COPY_TYPES)
                for row in copy_rows(params, ids, run_at):
                    await copy.write_row(row)
            return ids
        keyed_params = params | {"ids": ids, "run_at": run_at}
        found = await self._all("enqueue_keyed", keyed_params, conn)
        keyed = Keyed(params["keys"], ids, found)
        if keyed.missing:  # held by a racing enqueue that committed after the statement began
            ask = {"queue": params["queue"], "keys": keyed.missing}
            keyed.add_holders(await self._all("key_holders", ask, conn))
        return keyed.ids()

    # -- consuming -------------------------------------------------------------------
    async def claim(
        self,
        queue: str | Sequence[str] = "default",
        *,
        limit: int = 1,
        lease: float = defaults.LEASE,
    ) -> list[AsyncJob]:
        """``Queue.claim``: up to ``limit`` runnable jobs for ``lease`` seconds, as
        ``AsyncJob``s writing with this queue's connection."""
        names, limit, lease = claim_args(queue, limit, lease)
        jobs: list[AsyncJob] = []
        for name in names:
            params = {"queue": name, "limit": limit - len(jobs), "lease": lease}
            deadline = time.monotonic() + lease  # counted from before the claim was sent
            rows = await self._claim_rows(name, params)
            jobs += [AsyncJob(*row, conn=self.conn, deadline=deadline) for row in rows]
            if len(jobs) == limit:
                break
        return jobs

    async def _claim_rows(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """``Queue._claim_rows``: the statement the queue needs, again after a slot race."""
        for _ in range(SLOT_TRIES):
            try:
                rows = await self._all(self._route.statement(name), params)
            except SlotRace:
                if self.conn.info.transaction_status != TransactionStatus.IDLE:
                    raise  # inside a transaction of yours, which is now aborted
                continue
            if not self._route.wrong(name, rows):
                return rows
        return []

    async def heartbeat(self, job: AsyncJob, *, lease: float = defaults.LEASE) -> bool:
        """Extend the job's lease; False (and ``job.lost``) if someone else holds it now."""
        params = {"id": job.id, "fence": job.fence, "lease": checked_lease(lease)}
        deadline = time.monotonic() + params["lease"]
        return beat(job, await (await self._run("heartbeat", params)).fetchone(), deadline)

    async def heartbeat_many(
        self, jobs: Sequence[AsyncJob], *, lease: float = defaults.LEASE
    ) -> list[AsyncJob]:
        """Extend many leases in one statement; return the jobs that were lost (marked)."""
        if not jobs:
            return []
        params = {**held_params(jobs), "lease": checked_lease(lease)}
        deadline = time.monotonic() + params["lease"]
        kept = await self._all("heartbeat_many", params)
        return beat_many(jobs, kept, deadline)  # type: ignore[return-value]

    async def complete(self, job: AsyncJob, result: object = None) -> bool:
        """``Queue.complete``: mark the job done, storing ``result`` in the same fenced
        statement; False (and ``job.lost``) if its fence is stale."""
        name, params = complete_params(job, result)
        return end_reply(job, (await self._run(name, params)).rowcount == 1, "done")

    async def complete_many(
        self, jobs: Sequence[AsyncJob], results: Sequence[object] | None = None
    ) -> list[AsyncJob]:
        """Mark many jobs done in one fenced statement, with their ``results`` if given;
        return the ones rejected (marked)."""
        if not jobs:
            return []
        name, params = complete_many_params(jobs, results)
        done = await self._all(name, params)
        return completed_many(jobs, done)  # type: ignore[return-value]

    async def fail(
        self,
        job: AsyncJob,
        error: str,
        *,
        backoff: float = defaults.BACKOFF,
        delay: float | None = None,
        give_up: bool = False,
    ) -> bool:
        """``Queue.fail``: record ``error`` and retry with backoff (or after ``delay``), or
        go dead; the fence rises either way. False (and ``job.lost``) if it was stale."""
        params = fail_params(job, error, backoff, delay, give_up)
        return fail_reply(job, await self._one("fail", params))

    async def release(self, job: AsyncJob) -> bool:
        """Give back a claimed job that was not started (its attempt too, not its fence)."""
        params = {"id": job.id, "fence": job.fence}
        return end_reply(job, (await self._run("release", params)).rowcount == 1, "ready")

    async def cancel(self, job_id: int) -> bool:
        """``Queue.cancel``: cancel a ready or running job (a running one is fenced out)."""
        return await self._one("cancel", {"id": checked_job_id(job_id)}) is not None

    # -- per-group limits ------------------------------------------------------------
    async def limit(self, queue: str, *, per_group: int | None) -> None:
        """``Queue.limit``: at most ``per_group`` running jobs of one group of ``queue``, on
        every worker (None removes the limit)."""
        params = limit_params(queue, per_group)
        await self._run("set_limit" if per_group is not None else "remove_limit", params)

    async def limits(self) -> list[Limit]:
        """``Queue.limits``: every queue's per-group limit, with its jobs running under it."""
        return [Limit(*row) for row in await self._all("limits", {})]

    # -- housekeeping ----------------------------------------------------------------
    async def reap(self) -> list[Reaped]:
        """Return jobs with expired leases to ``ready`` (or ``dead``); safe to run anywhere."""
        return [Reaped(*row[:4]) for row in await self._all("reap", {})]

    async def retry_dead(
        self, queue: str | None = None, *, ids: Sequence[int] | None = None, extra: int = 1
    ) -> Retried:
        """``Queue.retry_dead``: dead jobs of ``queue`` (or among ``ids``) ready again, but
        those whose key is taken (listed in the result's ``skipped``)."""
        plan = retry_dead_plan(queue, ids, extra)
        if plan is None:
            return Retried()  # no ids: retry none (not "no filter")
        name, params = plan
        for _ in range(KEY_TRIES):
            try:
                return retried_reply(name, await self._all(name, params))
            except KeyRace as exc:
                race = exc  # a key taken after the statement began; a new one sees it
                if self.conn.info.transaction_status != TransactionStatus.IDLE:
                    raise  # inside a transaction of yours, which is now aborted
        raise race

    async def result(
        self,
        job_id: int,
        *,
        timeout: float | None = None,
        poll_interval: float = RESULT_POLL,
        listen: bool = True,
    ) -> Any:
        """``Queue.result``: wait for the job to finish (a notification wakes it, polling
        is the fallback) and return its stored result; ``JobFailed`` for a dead or cancelled
        job, ``TimeoutError`` past ``timeout`` seconds."""
        job_id, deadline, poll = result_args(job_id, timeout, poll_interval)
        conn = self.conn
        hear = listen and not self.pgbouncer and conn.autocommit
        hear = hear and conn.info.transaction_status == TransactionStatus.IDLE
        if hear:
            await self._run("listen_done", {})
        try:
            if hear:  # the job's end is notified only while someone waits for it
                await self._run("wait_for", {"id": job_id})
            mine = str(job_id)
            while True:
                row = await self._one("result", {"id": job_id})
                done, value = result_of(job_id, row)
                if done:
                    return value
                wait = result_wait(job_id, deadline, poll, value)
                if not hear:
                    await asyncio.sleep(wait)
                    continue
                async for note in conn.notifies(timeout=wait):
                    if note.payload == mine:
                        break
        finally:
            if hear and not conn.closed:
                await self._run("wait_done", {"id": job_id})
                await self._run("unlisten_done", {})

    async def get(self, job_id: int) -> JobState | None:
        """The job with this id as it is now, or None if there is none."""
        row = await self._one("get", {"id": checked_job_id(job_id)})
        return None if row is None else JobState(*row)

    async def steps(self, job_id: int) -> list[StepState]:
        """``Queue.steps``: the durable steps job ``job_id`` has stored, oldest first."""
        return [
            StepState(*row) for row in await self._all("steps", {"job": checked_job_id(job_id)})
        ]

    async def stats(self, *, exact: bool = False) -> list[dict[str, Any]]:
        """``Queue.stats``: counts by queue and status (finished ones estimated)."""
        cur = await self._run("stats_exact" if exact else "stats", {})
        rows = stats_reply(cur.description, await cur.fetchall())
        if not exact:
            total = await self._one("stats_rows", {})
            rows.append(finished_estimate(rows, total))
        return rows

    async def schedules(self) -> list[ScheduleState]:
        """``Queue.schedules``: every periodic schedule, with its last and next slot."""
        return [ScheduleState(*row) for row in await self._all("schedules", {})]

    # -- periodic jobs: what a worker's tick sends (pgqueue/periodic.py) ------------------
    async def schedule_clock(self, names: Sequence[str]) -> tuple[datetime, dict[str, datetime]]:
        """The server's clock, and the last slot of each named schedule that has a row."""
        return schedule_clock_reply(await self._all("schedule_clock", {"names": list(names)}))

    async def schedule_add(self, schedule: Schedule, slots: Sequence[datetime]) -> bool:
        """Add a schedule's row, starting at its newest slot of ``slots`` not after the
        server's clock; False if another worker added it first."""
        cur = await self._run("schedule_add", tick_params(schedule, slots))
        return cur.rowcount == 1

    async def schedule_tick(self, schedule: Schedule, slots: Sequence[datetime]) -> int:
        """Make the jobs of the due slots among ``slots`` that no worker made yet (the
        database decides which are due, and the slot's key that one job exists); how many."""
        row = await self._one("schedule_tick", tick_params(schedule, slots))
        return int(row[0]) if row else 0

    async def prune(
        self,
        older_than: float | timedelta = 0.0,
        *,
        archive: bool = False,
        batch: int = 10_000,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """``Queue.prune``: delete (or archive) finished jobs, ``batch`` jobs a transaction."""
        run = Pruning(await self._one("id_span", {}), batch, prune_args(older_than, batch))
        while (params := run.params()) is not None:
            run.took(await self._one("prune_archive" if archive else "prune", params))
            if progress is not None:
                progress(*run.progress)
        return run.removed

    # -- internals -------------------------------------------------------------------
    async def _one(
        self, name: str, params: dict[str, Any], conn: psycopg.AsyncConnection | None = None
    ) -> tuple[Any, ...] | None:
        return await (await self._run(name, params, conn)).fetchone()

    async def _all(
        self, name: str, params: dict[str, Any], conn: psycopg.AsyncConnection | None = None
    ) -> list[tuple[Any, ...]]:
        return await (await self._run(name, params, conn)).fetchall()

    async def _run(
        self, name: str, params: dict[str, Any], conn: psycopg.AsyncConnection | None = None
    ) -> AsyncCursor:
        prepare = False if name in _PLANNED_EACH_CALL or name in _NOT_PREPARED else self._prepare
        try:
            query = statements.query(name)
            return await async_own_cursor(conn or self.conn).execute(query, params, prepare=prepare)
        except psycopg.Error as exc:
            mapped = pgqueue_error(exc, name)
            if mapped is None:
                raise
            raise mapped from None
