# Generated from async_queue.py by `python pgqueue/tools/async_to_sync.py`: edit that file,
# then run the command again (make lint fails while the two differ).
"""The jobs table behind one connection: one method per statement of ``sql/queries.sql``,
no hidden state but the connection, written once for both faces. ``AsyncQueue`` in
``async_queue.py`` is the source (methods awaited, on an ``AsyncConnection``); ``Queue`` in
``queue.py`` is the same code without ``await``, generated from it by
``python pgqueue/tools/async_to_sync.py`` (``make lint`` fails while the two differ). Each
method builds its parameters and reads its reply with the helpers of ``params.py``.

Every write after a claim carries the job's fence and returns whether it took effect:
``False`` means another worker holds the job now, and the caller must discard its work.

Which face runs which path: the notebooks and your scripts drive the sync ``Queue``; the
worker (``Worker`` too, not only ``AsyncWorker``) runs the engine on an event loop and sends
these statements through ``AsyncQueue``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from . import defaults, statements
from .adapters import from_sqlalchemy, your_conn
from .db import connect, own_cursor, pgbouncer_mode
from .errormap import key_race, pgqueue_error
from .errors import KeyRace, PgQueueError, SlotRace
from .inputs import (
    checked_job_id,
    checked_lease,
    checked_queue_name,
    claim_args,
    prune_args,
    result_args,
)
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
from .job import Job
from .params import (
    COPY_TYPES,
    KEY_TRIES,
    RESULT_POLL,
    SLOT_TRIES,
    ClaimRoute,
    JobState,
    Keyed,
    Limit,
    Pruning,
    Reaped,
    Retried,
    ScheduleState,
    beat,
    beat_many,
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
    limit_params,
    prepare_many,
    reserved,
    result_of,
    result_wait,
    retried_reply,
    retry_dead_plan,
    schedule_clock_reply,
    stats_reply,
)
from .periodic import Schedule, tick_params
from .steps import StepState

Cursor = psycopg.Cursor[Any]
_NOT_PREPARED = frozenset({"listen_done", "unlisten_done"})  # utility statements


class Queue:
    """The jobs table behind one connection (opened from a DSN, or yours).

    The sync face connects when made; the async face when opened (``open()``, or its context).
    Pass ``conn=`` to ``enqueue``/``enqueue_many`` to write the job
    inside your own transaction: it then commits or rolls back with your data. ``conn``
    (and, for the sync face, ``target``) may be a psycopg connection, or a SQLAlchemy
    connection or session (of SQLAlchemy's async kind for the async face) on psycopg 3
    (``postgresql+psycopg://``), whose transaction the job joins (docs/sqlalchemy.md).
    """

    def __init__(
        self,
        target: str | psycopg.Connection | None = None,
        *,
        application_name: str = "pgqueue",
        pgbouncer: bool | None = None,
    ) -> None:
        if from_sqlalchemy(target):  # Queue(session): the psycopg connection under it
            target = your_conn(target)
        self._owned = not isinstance(target, psycopg.Connection)
        self._dsn = None if isinstance(target, psycopg.Connection) else target
        self._application_name = application_name
        # Behind PgBouncer in transaction mode (``pgbouncer=True`` or PGQUEUE_PGBOUNCER=1)
        # nothing is prepared on the server; otherwise every statement is, once.
        self.pgbouncer = pgbouncer_mode(pgbouncer)
        self._prepare = not self.pgbouncer  # False: never, even on a connection of yours
        self._route = ClaimRoute()  # which claim statement each queue needs (a guess)
        self._conn = target if isinstance(target, psycopg.Connection) else None
        self.open()  # a sync Queue connects at once

    @property
    def conn(self) -> psycopg.Connection:
        """The connection (an ``Queue``'s: ``PgQueueError`` until ``with``)."""
        if self._conn is None:
            raise PgQueueError("Queue is not open: use `with Queue(...) as q`")
        return self._conn

    @property
    def closed(self) -> bool:
        """Whether the queue has no open connection (closed, or an async one not opened)."""
        return self._conn is None or self._conn.closed

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> Queue:
        """Connect, if this queue opens its own connection and has not yet."""
        if self._conn is None:
            self._conn = connect(
                self._dsn, application_name=self._application_name, pgbouncer=self.pgbouncer
            )
        return self

    def close(self) -> None:
        """Close the connection if this queue opened it."""
        if self._owned and self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Queue:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install(
        self, *, notify: bool | None = None, lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    ) -> Installation:
        """Create the jobs table, its indexes and trigger, or add what a table of an earlier
        pgqueue lacks; on a current table change nothing and lock nothing (it reads the
        catalog). ``notify``: True installs the NOTIFY trigger, False drops it (enqueues get
        cheaper under many producers; workers find jobs by polling), None keeps what is
        installed (a new table gets the trigger). A statement that needs a lock on jobs
        waits at most ``lock_timeout`` seconds, then ``InstallBlocked`` says who holds it.
        An upgrade builds indexes CONCURRENTLY, so it needs an autocommit connection."""
        timeout = lock_timeout_setting(lock_timeout)
        conn, changed = self.conn, list[str]()
        step: Step | None = None  # what it was about to do, for InstallBlocked
        try:
            found = self._catalog()
            if brief_steps(found, notify):
                with conn.transaction():
                    own_cursor(conn).execute(
                        block("lock_timeout"), {"timeout": timeout, "local": True}
                    )
                    own_cursor(conn).execute(block("install_lock"), prepare=False)
                    for step in brief_steps(self._catalog(), notify):
                        own_cursor(conn).execute(step.statement, prepare=False)
                        changed.append(step.what)
                step, found = None, self._catalog()
            if slow_steps(found):
                if not conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE:
                    raise not_outside_a_transaction()
                with self._one_upgrade(timeout):
                    for step in slow_steps(self._catalog()):
                        if step.concurrent:
                            own_cursor(conn).execute(step.statement, prepare=False)
                        else:
                            with conn.transaction():
                                own_cursor(conn).execute(
                                    block("lock_timeout"), {"timeout": timeout, "local": True}
                                )
                                own_cursor(conn).execute(step.statement, prepare=False)
                        changed.append(step.what)
                step, found = None, self._catalog()
        except psycopg.errors.LockNotAvailable:
            cur = own_cursor(conn).execute(block("lock_holders"), prepare=False)
            raise blocked(step, lock_timeout, cur.fetchone()) from None
        except psycopg.errors.CheckViolation:
            raise bad_statuses() from None
        return Installation(changed, found.notify_trigger)

    @contextmanager
    def _one_upgrade(self, timeout: str) -> Iterator[None]:
        """One upgrade at a time, its statements under the lock timeout, the session's own
        setting put back after. Behind PgBouncer a session's setting or lock would stay on a
        server connection another client gets next: there the index builds wait without a
        timeout (they stop no writes) and nothing keeps two upgrades apart."""
        if self.pgbouncer:
            yield
            return
        conn = self.conn
        [previous] = (own_cursor(conn).execute(block("current_lock_timeout"))).fetchone() or ["0"]
        own_cursor(conn).execute(block("lock_timeout"), {"timeout": timeout, "local": False})
        try:
            own_cursor(conn).execute(block("install_lock_session"), prepare=False)
            try:
                yield
            finally:
                own_cursor(conn).execute(block("install_unlock_session"), prepare=False)
        finally:
            own_cursor(conn).execute(block("lock_timeout"), {"timeout": previous, "local": False})

    def _catalog(self) -> Catalog:
        """What is installed, read from the catalog in one snapshot."""
        with self.conn.transaction():
            found = (own_cursor(self.conn).execute(block("installed"), prepare=False)).fetchone()
            cur = own_cursor(self.conn).execute(block("installed_indexes"), prepare=False)
            indexes = cur.fetchall()
        assert found is not None  # one row, always
        return catalog(found, indexes)

    def check(self) -> None:
        """Raise ``NotInstalled`` unless the jobs table exists (cheap: reads no rows)."""
        self._run("check", {})

    def check_claims(self) -> None:
        """Raise ``NotInstalled`` unless every table a claim reads exists (a worker asks at
        start: an older pgqueue's database lacks ``pgqueue_paused`` until ``pgqueue init``)."""
        self._run("check_claim", {})

    # -- pausing -----------------------------------------------------------------------
    def pause(self, queue: str) -> bool:
        """Pause ``queue``: from their next claim on, no worker on any host claims from it
        (the claim statement reads ``pgqueue_paused``; no restart). Running jobs go on and
        enqueues go on. True if it was not paused already."""
        return self._one("pause", {"queue": checked_queue_name(queue)}) is not None

    def resume(self, queue: str) -> bool:
        """Let workers claim from ``queue`` again, and wake the idle ones listening (a
        notification, as an enqueue sends). True if it was paused."""
        return self._one("resume", {"queue": checked_queue_name(queue)}) is not None

    def paused(self) -> dict[str, datetime]:
        """The paused queues, with when each was paused (oldest first)."""
        return dict(self._all("paused", {}))

    # -- producing -------------------------------------------------------------------
    def enqueue(
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
        conn: psycopg.Connection | Any = None,
    ) -> int:
        """Add one job and return its id (inside ``conn``'s transaction if given). Higher
        ``priority`` runs first; among equals, the oldest ``run_at``, then the first in.
        With a ``key`` that a ready or running job of the queue holds, nothing is added and
        that job's id is returned; once it is done, dead or cancelled the key is free. Jobs
        of one ``group`` (a tenant, say) run at most ``per_group`` at a time when their
        queue has a limit (``Queue.limit``); without a limit a group changes nothing."""
        params = enqueue_params(payload, queue, delay, run_at, max_attempts, priority, key, group)
        conn = your_conn(conn)
        for _ in range(KEY_TRIES):
            row = self._one("enqueue", params, conn)
            if row is not None:
                return int(row[0])
        raise key_race(key)

    def enqueue_many(
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
        conn: psycopg.Connection | Any = None,
    ) -> list[int]:
        """Add many jobs in one write (an INSERT, or a COPY from ``COPY_FROM`` jobs on), all or
        none; return their ids in order (the order they will be claimed in, among equals).
        With ``keys`` (one per payload, None for none), a key already held by a live job of
        the queue adds nothing and gives that job's id; inside the batch the first one wins.
        Every job of the batch is in ``group`` (see ``enqueue``)."""
        params = enqueue_many_params(
            payloads, queue, delay, run_at, max_attempts, priority, keys, group
        )
        how = enqueue_many_route(params)
        if how == "none":
            return []
        conn = your_conn(conn)
        if how == "insert":
            return [int(r[0]) for r in self._all("enqueue_many", params, conn)]
        reserve = params | {"n": len(params["payloads"])}
        ids, run_at = reserved(self._one("enqueue_reserve", reserve, conn))
        if how == "copy":
            with (
                (conn or self.conn).cursor() as cursor,
                cursor.copy(statements.query("enqueue_copy")) as copy,
            ):
                copy.set_types(COPY_TYPES)
                for row in copy_rows(params, ids, run_at):
                    copy.write_row(row)
            return ids
        keyed_params = params | {"ids": ids, "run_at": run_at}
        found = self._all("enqueue_keyed", keyed_params, conn)
        keyed = Keyed(params["keys"], ids, found)
        if keyed.missing:  # held by a racing enqueue that committed after the statement began
            ask = {"queue": params["queue"], "keys": keyed.missing}
            keyed.add_holders(self._all("key_holders", ask, conn))
        return keyed.ids()

    # -- consuming -------------------------------------------------------------------
    def claim(
        self,
        queue: str | Sequence[str] = "default",
        *,
        limit: int = 1,
        lease: float = defaults.LEASE,
    ) -> list[Job]:
        """Claim up to ``limit`` runnable jobs for ``lease`` seconds (fence and attempts + 1).
        Given several queues, they are a preference: the first one's jobs are taken first,
        and the next queue fills what is left of ``limit`` (one statement per queue asked).
        In a queue with a per-group limit, a group running its ``per_group`` jobs is passed
        over for the next job of another group."""
        names, limit, lease = claim_args(queue, limit, lease)
        jobs: list[Job] = []
        for name in names:
            params = {"queue": name, "limit": limit - len(jobs), "lease": lease}
            deadline = time.monotonic() + lease  # counted from before the claim was sent
            rows = self._claim_rows(name, params)
            jobs += [Job(*row, conn=self.conn, deadline=deadline) for row in rows]
            if len(jobs) == limit:
                break
        return jobs

    def _claim_rows(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """One queue's claim: the statement it needs (the route's guess, flipped when the
        statement refuses the queue), again after a slot race; nothing after ``SLOT_TRIES``
        races (a claim soon after sees the slots taken)."""
        for _ in range(SLOT_TRIES):
            try:
                rows = self._all(self._route.statement(name), params)
            except SlotRace:
                if self.conn.info.transaction_status != TransactionStatus.IDLE:
                    raise  # inside a transaction of yours, which is now aborted
                continue
            if not self._route.wrong(name, rows):
                return rows
        return []

    def heartbeat(self, job: Job, *, lease: float = defaults.LEASE) -> bool:
        """Extend the job's lease; False (and ``job.lost``) if someone else holds it now."""
        params = {"id": job.id, "fence": job.fence, "lease": checked_lease(lease)}
        deadline = time.monotonic() + params["lease"]
        return beat(job, (self._run("heartbeat", params)).fetchone(), deadline)

    def heartbeat_many(self, jobs: Sequence[Job], *, lease: float = defaults.LEASE) -> list[Job]:
        """Extend many leases in one statement; return the jobs that were lost (marked)."""
        if not jobs:
            return []
        params = {**held_params(jobs), "lease": checked_lease(lease)}
        deadline = time.monotonic() + params["lease"]
        many = prepare_many(self._prepare, jobs)
        kept = self._all("heartbeat_many", params, prepare=many)
        return beat_many(jobs, kept, deadline)  # type: ignore[return-value]

    def complete(self, job: Job, result: object = None) -> bool:
        """Mark the job done, storing ``result`` (JSON, at most ``MAX_RESULT_BYTES``; None
        stores nothing) in the same fenced statement; False (and ``job.lost``) if its fence
        is stale, and then nothing is stored. ``BadInput`` for a result it cannot store."""
        name, params = complete_params(job, result)
        return end_reply(job, (self._run(name, params)).rowcount == 1, "done")

    def complete_many(
        self, jobs: Sequence[Job], results: Sequence[object] | None = None
    ) -> list[Job]:
        """Mark many jobs done in one fenced statement, with their ``results`` if given;
        return the ones rejected (marked)."""
        if not jobs:
            return []
        name, params = complete_many_params(jobs, results)
        done = self._all(name, params, prepare=prepare_many(self._prepare, jobs))
        return completed_many(jobs, done)  # type: ignore[return-value]

    def fail(
        self,
        job: Job,
        error: str,
        *,
        backoff: float = defaults.BACKOFF,
        delay: float | None = None,
        give_up: bool = False,
        traceback: str | None = None,
    ) -> bool:
        """Record ``error``; the job retries after ``backoff * 2**attempts`` seconds, or goes
        dead at max_attempts. False (and ``job.lost``) if its fence is stale. Either way
        this holder is done with the job: the fence rises, so its later writes are refused.
        ``job.status`` tells which way it went ('ready' or 'dead'), ``job.retry_in`` when.
        ``delay`` retries after that many seconds instead of the backoff (it still counts as
        an attempt); ``give_up`` sends the job dead at once. ``traceback`` is kept with the
        job (its last ``MAX_TRACEBACK`` characters: ``pgqueue show``, the dashboard); a
        worker passes the handler's."""
        params = fail_params(job, error, backoff, delay, give_up, traceback)
        return fail_reply(job, self._one("fail", params))

    def release(self, job: Job) -> bool:
        """Give back a claimed job that was not started (its attempt too, not its fence)."""
        params = {"id": job.id, "fence": job.fence}
        return end_reply(job, (self._run("release", params)).rowcount == 1, "ready")

    def cancel(self, job_id: int) -> bool:
        """Cancel a ready or running job; True if it was. A ready job never runs; a running
        one's fence rises, so its holder's heartbeat, completion and fenced writes are
        refused and its handler sees ``job.lost``. Done, dead or cancelled jobs: False."""
        return self._one("cancel", {"id": checked_job_id(job_id)}) is not None

    def cancel_many(self, job_ids: Sequence[int]) -> list[int]:
        """``cancel`` for many jobs in one statement; the ids that were ready or running,
        now cancelled (their running holders fenced out)."""
        ids = [checked_job_id(job_id) for job_id in job_ids]
        return [row[0] for row in self._all("cancel_many", {"ids": ids})] if ids else []

    # -- per-group limits ------------------------------------------------------------
    def limit(self, queue: str, *, per_group: int | None) -> None:
        """Let at most ``per_group`` jobs of one group (``enqueue(group=...)``) of ``queue``
        run at once, on every worker, from their next claim on; ``per_group=None`` removes
        the limit. Jobs without a group are not limited. Stored in ``pgqueue_limits``."""
        params = limit_params(queue, per_group)
        self._run("set_limit" if per_group is not None else "remove_limit", params)

    def limits(self) -> list[Limit]:
        """Every queue's per-group limit, with how many of its jobs run under it now."""
        return [Limit(*row) for row in self._all("limits", {})]

    # -- housekeeping ----------------------------------------------------------------
    def reap(self) -> list[Reaped]:
        """Return jobs with expired leases to ``ready`` (or ``dead``); safe to run anywhere."""
        return [Reaped(*row[:4]) for row in self._all("reap", {})]

    def retry_dead(
        self, queue: str | None = None, *, ids: Sequence[int] | None = None, extra: int = 1
    ) -> Retried:
        """Make dead jobs ready again with ``extra`` attempts and return their ids: every dead
        job of ``queue`` (default ``"default"``), or, with ``ids``, the dead jobs among those
        ids, looked up by id (with ``queue`` too, only those of that queue). Ids that are not
        dead are left as they are: compare the result with what you asked for. A dead job
        whose key a ready or running job holds again stays dead, and the others are retried:
        the result's ``skipped`` lists those (``LeftDead``: id, key, the job holding it)."""
        plan = retry_dead_plan(queue, ids, extra)
        if plan is None:
            return Retried()  # no ids: retry none (not "no filter")
        name, params = plan
        for _ in range(KEY_TRIES):
            try:
                return retried_reply(name, self._all(name, params))
            except KeyRace as exc:
                race = exc  # a key taken after the statement began; a new one sees it
                if self.conn.info.transaction_status != TransactionStatus.IDLE:
                    raise  # inside a transaction of yours, which is now aborted
        raise race

    def result(
        self,
        job_id: int,
        *,
        timeout: float | None = None,
        poll_interval: float = RESULT_POLL,
        listen: bool = True,
    ) -> Any:
        """Wait for the job to finish and return what its handler returned (None if it
        returned nothing). ``JobFailed`` (with ``last_error``) if it went dead or was
        cancelled; ``TimeoutError`` after ``timeout`` seconds (None: wait for ever). It
        hears the job end through a notification (LISTEN pgqueue_done, sent only for jobs
        someone waits for: a row in pgqueue_waiters while it waits), within milliseconds,
        and reads the row every ``poll_interval`` seconds as well; behind PgBouncer, inside
        a transaction of yours or with ``listen=False`` it polls only."""
        job_id, deadline, poll = result_args(job_id, timeout, poll_interval)
        conn = self.conn
        hear = listen and not self.pgbouncer and conn.autocommit
        hear = hear and conn.info.transaction_status == TransactionStatus.IDLE
        if hear:
            self._run("listen_done", {})
        try:
            if hear:  # the job's end is notified only while someone waits for it
                self._run("wait_for", {"id": job_id})
            mine = str(job_id)
            while True:
                row = self._one("result", {"id": job_id})
                done, value = result_of(job_id, row)
                if done:
                    return value
                wait = result_wait(job_id, deadline, poll, value)
                if not hear:
                    time.sleep(wait)
                    continue
                for note in conn.notifies(timeout=wait):
                    if note.payload == mine:
                        break
        finally:
            if hear and not conn.closed:
                self._run("wait_done", {"id": job_id})
                self._run("unlisten_done", {})

    def get(self, job_id: int) -> JobState | None:
        """The job with this id as it is now, or None if there is none."""
        row = self._one("get", {"id": checked_job_id(job_id)})
        return None if row is None else JobState(*row)

    def steps(self, job_id: int) -> list[StepState]:
        """The durable steps job ``job_id`` has stored (``Job.step``), oldest first: name,
        fence of the claim that wrote it, when, and output."""
        return [StepState(*row) for row in self._all("steps", {"job": checked_job_id(job_id)})]

    def stats(self, *, exact: bool = False) -> list[dict[str, Any]]:
        """Job counts by queue and status, with the oldest runnable job's wait in seconds and
        the latest error. By default only ready, running and dead jobs are counted, through
        their partial indexes, plus one row (queue None, status 'finished', ``estimated``)
        estimating the done and cancelled ones from the planner's statistics: cheap at
        millions of rows. Before the table was first analyzed, a table of at most 8 MB has
        them counted (``counted`` True); a larger one gives None. ``exact=True`` counts
        every status by reading the whole table."""
        cur = self._run("stats_exact" if exact else "stats", {})
        rows = stats_reply(cur.description, cur.fetchall())
        if not exact:
            total = self._one("stats_rows", {})
            rows.append(finished_estimate(rows, total))
        return rows

    def schedules(self) -> list[ScheduleState]:
        """Every periodic schedule some worker ticked, by name, with its last and next slot;
        ``NotInstalled`` if the periodic tables are missing (``pgqueue init`` adds them)."""
        return [ScheduleState(*row) for row in self._all("schedules", {})]

    # -- periodic jobs: what a worker's tick sends (pgqueue/periodic.py) ------------------
    def schedule_clock(self, names: Sequence[str]) -> tuple[datetime, dict[str, datetime]]:
        """The server's clock, and the last slot of each named schedule that has a row."""
        return schedule_clock_reply(self._all("schedule_clock", {"names": list(names)}))

    def schedule_add(self, schedule: Schedule, slots: Sequence[datetime]) -> bool:
        """Add a schedule's row, starting at its newest slot of ``slots`` not after the
        server's clock; False if another worker added it first."""
        cur = self._run("schedule_add", tick_params(schedule, slots))
        return cur.rowcount == 1

    def schedule_tick(self, schedule: Schedule, slots: Sequence[datetime]) -> int:
        """Make the jobs of the due slots among ``slots`` that no worker made yet (the
        database decides which are due, and the slot's key that one job exists); how many."""
        row = self._one("schedule_tick", tick_params(schedule, slots))
        return int(row[0]) if row else 0

    def prune(
        self,
        older_than: float | timedelta = 0.0,
        *,
        archive: bool = False,
        batch: int = 10_000,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Delete (or move to ``jobs_archive``) the jobs that finished (done or cancelled)
        more than ``older_than`` seconds ago; return how many. It walks the primary key
        ``batch`` jobs at a time, one short transaction each (never one long DELETE that
        holds back vacuum), however far apart their ids are; ``progress(ids_done,
        ids_total)`` is called after each batch. Dead jobs are kept: they wait for a person."""
        run = Pruning(self._one("id_span", {}), batch, prune_args(older_than, batch))
        while (params := run.params()) is not None:
            run.took(self._one("prune_archive" if archive else "prune", params))
            if progress is not None:
                progress(*run.progress)
        return run.removed

    # -- internals -------------------------------------------------------------------
    def _one(
        self,
        name: str,
        params: dict[str, Any],
        conn: psycopg.Connection | None = None,
        *,
        prepare: bool | None = None,
    ) -> tuple[Any, ...] | None:
        return (self._run(name, params, conn, prepare=prepare)).fetchone()

    def _all(
        self,
        name: str,
        params: dict[str, Any],
        conn: psycopg.Connection | None = None,
        *,
        prepare: bool | None = None,
    ) -> list[tuple[Any, ...]]:
        return (self._run(name, params, conn, prepare=prepare)).fetchall()

    def _run(
        self,
        name: str,
        params: dict[str, Any],
        conn: psycopg.Connection | None = None,
        *,
        prepare: bool | None = None,
    ) -> Cursor:
        """Send statement ``name``: prepared unless behind PgBouncer, a utility statement,
        or told (``prepare_many``); a driver error mapped to pgqueue's one-line errors."""
        if prepare is None:
            prepare = self._prepare and name not in _NOT_PREPARED
        try:
            query = statements.query(name)
            return own_cursor(conn or self.conn).execute(query, params, prepare=prepare)
        except psycopg.Error as exc:
            mapped = pgqueue_error(exc, name)
            if mapped is None:
                raise
            raise mapped from None
