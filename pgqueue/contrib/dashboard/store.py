"""What the dashboard reads, and the connections it reads through.

Every request borrows a connection from a small pool (``psycopg_pool``) and runs its
statements in one transaction that begins with a statement timeout (``SET LOCAL``, here
``set_config(..., true)``), so no page can hog the database. What the library can read
already goes through ``pgqueue.AsyncQueue`` on that connection (``stats``, ``get``,
``steps``, ``schedules``, ``limits``); the rest is in ``dashboard.sql``, loaded once.

The overview reads nothing that grows with the finished jobs: the counts and the oldest
ready job through the partial indexes (``Queue.stats``), the running jobs through
``jobs_lease_idx``, the seats of limits through ``jobs_slot_idx``, the jobs added since the
last look through a range of the primary key. Throughput follows from two looks, as in
``pgqueue.monitor``: a job that left the ready, running and dead ones and was not added
since has finished. The looks are this process's own (``Looks``), one every
``LOOK_EVERY`` seconds at most while someone watches, kept for ``KEEP`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from ... import statements
from ...async_queue import AsyncQueue
from ...db import connecting, resolve_dsn
from ...errors import NotInstalled
from .filters import Filter, Refused

APP_NAME = "pgqueue dashboard"  # in pg_stat_activity
LOOK_EVERY = 2.0  # seconds: looks closer than this share one (many pages, one look)
KEEP = 15 * 60.0  # seconds of looks kept for the throughput and wait history
BARS = 100  # running jobs shown as lease bars, those whose leases end first
WAIT_ALERT = 60.0  # seconds the oldest ready job may wait before its queue needs attention
LATE_SLOT = 60.0  # seconds past a schedule's next slot before it needs attention


@cache
def sql() -> dict[str, str]:
    """The named statements of ``dashboard.sql``."""
    text = resources.files(__package__).joinpath("dashboard.sql").read_text(encoding="utf-8")
    return statements.parse(text)


@dataclass
class Look:
    """One look at the live jobs: the database's clock, and per queue ready, running, dead,
    the oldest ready job's wait, and the jobs finished since the look before."""

    at: datetime
    newest: int
    queues: dict[str, dict[str, Any]]
    seconds: float = 0.0  # since the look before (0: the first)
    finished_estimate: int | None = None  # done and cancelled, whole table (planner)
    finished: dict[str, int] = field(default_factory=dict)


class Looks:
    """This process's looks, newest last, and how finished jobs follow from two of them."""

    def __init__(self) -> None:
        self.kept: deque[Look] = deque()
        self.lock = asyncio.Lock()
        self.taken = -float("inf")  # time.monotonic() of the last look

    def add(self, look: Look, added: dict[str, int]) -> None:
        if self.kept:
            before = self.kept[-1]
            look.seconds = (look.at - before.at).total_seconds()
            for queue in look.queues.keys() | before.queues.keys() | added.keys():
                gone = (
                    _kept(before.queues.get(queue))
                    - _kept(look.queues.get(queue))
                    + added.get(queue, 0)
                )
                if gone > 0:  # never negative: see docs/monitor.md for the two rare misreads
                    look.finished[queue] = gone
        self.kept.append(look)
        while (look.at - self.kept[0].at).total_seconds() > KEEP:
            self.kept.popleft()

    def rate(self, queue: str) -> float | None:
        """Jobs of ``queue`` finished a second over the looks kept (None: one look only)."""
        span = sum(look.seconds for look in list(self.kept)[1:])
        if span <= 0:
            return None
        return sum(look.finished.get(queue, 0) for look in self.kept) / span

    def history(self) -> list[dict[str, Any]]:
        """Per look: seconds before the newest, finished per queue, oldest wait per queue."""
        if not self.kept:
            return []
        last = self.kept[-1].at
        return [
            {
                "ago": round((last - look.at).total_seconds(), 3),
                "seconds": round(look.seconds, 3),
                "finished": look.finished,
                "oldest_ready_s": {
                    q: c["oldest_ready_s"] for q, c in look.queues.items() if c["oldest_ready_s"]
                },
            }
            for look in self.kept
        ]


def _kept(counts: dict[str, Any] | None) -> int:
    return 0 if counts is None else counts["ready"] + counts["running"] + counts["dead"]


class Store:
    """The dashboard's connections (a pool, opened at the first request) and its reads."""

    def __init__(
        self, dsn: str | None, *, timeout_ms: int, hide_payload: bool, pool_size: int = 4
    ) -> None:
        self.dsn = dsn
        self.timeout_ms = timeout_ms
        self.hide_payload = hide_payload
        self.pool_size = pool_size
        self.looks = Looks()
        self._pool: AsyncConnectionPool | None = None
        self._opening = asyncio.Lock()

    async def resolved_dsn(self) -> str:
        """The DSN (``resolve_dsn`` may start the embedded server: in a thread)."""
        if self.dsn is None:
            self.dsn = await asyncio.to_thread(resolve_dsn, None)
        return self.dsn

    async def pool(self) -> AsyncConnectionPool:
        async with self._opening:
            if self._pool is None:
                dsn = await self.resolved_dsn()
                # pgqueue's connect arguments (keepalives, a connect timeout), as a Queue's.
                with connecting(dsn, autocommit=True, application_name=APP_NAME) as kwargs:
                    pass
                pool = AsyncConnectionPool(
                    dsn,
                    min_size=1,
                    max_size=self.pool_size,
                    kwargs=kwargs,
                    open=False,
                    timeout=10.0,
                )
                await pool.open()
                self._pool = pool
            return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @asynccontextmanager
    async def transaction(self, *, snapshot: bool = False) -> AsyncIterator[Conn]:
        """A connection in a transaction under the statement timeout; ``snapshot``: one
        REPEATABLE READ READ ONLY snapshot for all its reads. Errors become ``Refused``."""
        pool = await self.pool()
        try:
            async with pool.connection() as conn, conn.transaction():
                if snapshot:
                    await conn.execute(sql()["snapshot"], prepare=False)
                await conn.execute(sql()["timeout"], {"ms": str(self.timeout_ms)}, prepare=False)
                yield Conn(conn, self.hide_payload)
        except psycopg.errors.QueryCanceled:
            raise Refused(
                503,
                f"the database took longer than the dashboard's statement timeout "
                f"({self.timeout_ms} ms): narrow the filter, or raise --statement-timeout",
            ) from None
        except (psycopg.errors.UndefinedTable, NotInstalled):
            raise Refused(503, "no jobs table in this database: run `pgqueue init`") from None

    # -- reads ----------------------------------------------------------------------------
    async def overview(self) -> dict[str, Any]:
        """Everything the overview page shows, in one snapshot (the counts from the latest
        look, taken now unless one was taken less than ``LOOK_EVERY`` seconds ago)."""
        await self.look()
        async with self.transaction(snapshot=True) as c:
            at, statement_at, _ = await c.one("clock", {})
            running = await c.rows("running", {"limit": BARS})
            expired = dict(await c.rows("expired", {}))
            schedules = await c.schedules()
            limits = await c.limits()
            paused = await c.queue.paused()
        look = self.looks.kept[-1]
        queues = []
        idle = dict.fromkeys(("ready", "running", "dead"), 0) | {
            "oldest_ready_s": None,
            "latest_error": None,
        }
        counted = look.queues | {name: idle for name in paused if name not in look.queues}
        for name, counts in sorted(counted.items()):
            rate = self.looks.rate(name)
            queues.append(
                counts
                | {
                    "queue": name,
                    "finished_per_s": None if rate is None else round(rate, 3),
                    "expired": expired.get(name, 0),
                    "paused_since": paused[name].isoformat() if name in paused else None,
                    "attention": _attention(counts, expired.get(name, 0))
                    + (
                        [f"paused: its {counts['ready']} ready job(s) wait for a resume"]
                        if name in paused and counts["ready"]
                        else []
                    ),
                }
            )
        late = [
            s
            | {
                "attention": f"its next slot passed {s['late_s']:.0f} s ago: no worker ticks "
                f"queue {s['queue']!r}"
            }
            for s in schedules
            if s["late_s"] is not None and s["late_s"] > LATE_SLOT
        ]
        return {
            "at": at.isoformat(),
            "statement_at": statement_at.isoformat(),
            "looked_at": look.at.isoformat(),
            "queues": queues,
            "finished_estimate": look.finished_estimate,
            "history": self.looks.history(),
            "running": [_lease(row) for row in running],
            "running_shown": BARS,
            "schedules": schedules,
            "late_schedules": late,
            "limits": limits,
            "holder_recorded": False,
            "refused_writes_recorded": False,
        }

    async def look(self) -> Look:
        """Take a look at the live jobs (or return the last, if it is recent)."""
        async with self.looks.lock:
            if time.monotonic() - self.looks.taken < LOOK_EVERY and self.looks.kept:
                return self.looks.kept[-1]
            before = self.looks.kept[-1].newest if self.looks.kept else None
            async with self.transaction(snapshot=True) as c:
                at, _, newest = await c.one("clock", {})
                stats = await c.queue.stats()
                added = {} if before is None else dict(await c.rows("added", {"after": before}))
            estimate = next((r["jobs"] for r in stats if r["estimated"]), None)
            look = Look(at, int(newest), _counts(stats), finished_estimate=estimate)
            self.looks.add(look, added)
            self.looks.taken = time.monotonic()
            return look

    async def queues(self, *, exact: bool = False) -> list[dict[str, Any]]:
        """Jobs by queue and status: live and dead through the partial indexes (finished
        estimated for the whole table), or with ``exact`` every status counted (reads the
        whole table, under the statement timeout)."""
        async with self.transaction(snapshot=True) as c:
            rows = await c.queue.stats(exact=exact)
        return [r for r in rows if r["queue"] is not None] if exact else rows

    async def known_queue(self, name: str) -> bool:
        """Whether any job has queue ``name``: a live or dead one (the last look knows),
        or any other (one statement, bounded by the timeout)."""
        if self.looks.kept and name in self.looks.kept[-1].queues:
            return True
        async with self.transaction() as c:
            (found,) = await c.one("queue_exists", {"queue": name})
        return bool(found)

    async def jobs(self, chosen: Filter, before: int, limit: int) -> list[dict[str, Any]]:
        """One page of jobs matching ``chosen``, newest first, with ids below ``before``."""
        params = chosen.params(self.hide_payload) | {"before": before, "limit": limit}
        async with self.transaction() as c:
            cur = await c.conn.execute(sql()["jobs"], params, prepare=False)
            names = [d.name for d in cur.description or []]
            return [_jsonable(dict(zip(names, row, strict=True))) for row in await cur.fetchall()]

    async def job(self, job_id: int) -> dict[str, Any]:
        """One job with its durable steps (a 404 if there is none)."""
        async with self.transaction(snapshot=True) as c:
            at, statement_at, _ = await c.one("clock", {})
            state = await c.queue.get(job_id)
            steps = await c.queue.steps(job_id) if state is not None else []
        if state is None:
            raise Refused(404, f"no job {job_id}: it never existed, or was deleted or pruned")
        job = _jsonable(state._asdict())
        if state.lease_until is not None:
            job["left_s"] = (state.lease_until - statement_at).total_seconds()
        job["steps"] = [_jsonable(step._asdict()) for step in steps]
        if self.hide_payload:
            job["payload"] = job["result"] = None
            for step in job["steps"]:
                step["output"] = None
        job["at"] = at.isoformat()
        return job


class Conn:
    """A connection in a dashboard transaction: the library's queue on it, and the
    dashboard's own statements."""

    def __init__(self, conn: psycopg.AsyncConnection, hide_payload: bool) -> None:
        self.conn = conn
        self.queue = AsyncQueue(conn)
        self.hide_payload = hide_payload

    async def rows(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        cur = await self.conn.execute(sql()[name], params, prepare=False)
        return await cur.fetchall()

    async def one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...]:
        cur = await self.conn.execute(sql()[name], params, prepare=False)
        row = await cur.fetchone()
        assert row is not None
        return row

    async def schedules(self) -> list[dict[str, Any]]:
        try:
            async with self.conn.transaction():  # a savepoint: a missing table is no error
                found = await self.queue.schedules()
        except NotInstalled:
            return []
        _, clock, _ = await self.one("clock", {})
        return [
            _jsonable(s._asdict())
            | {
                "late_s": None
                if s.next_slot is None
                else round((clock - s.next_slot).total_seconds(), 3),
            }
            for s in found
        ]

    async def limits(self) -> list[dict[str, Any]]:
        try:
            async with self.conn.transaction():
                found = await self.queue.limits()
                holders = await self.rows("slot_holders", {"limit": 1000})
        except (NotInstalled, psycopg.errors.UndefinedTable):
            return []
        seats: dict[str, list[dict[str, Any]]] = {}
        for queue, group, slot, job_id, fence, left in holders:
            seats.setdefault(queue, []).append(
                {"group": group, "seat": slot, "id": job_id, "fence": fence, "left_s": left}
            )
        return [lim._asdict() | {"holders": seats.get(lim.queue, [])} for lim in found]


def _counts(stats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for row in stats:
        if row["estimated"]:
            continue
        counts = found.setdefault(
            row["queue"],
            {"ready": 0, "running": 0, "dead": 0, "oldest_ready_s": None, "latest_error": None},
        )
        counts[row["status"]] = row["jobs"]
        if row["status"] == "ready":
            counts["oldest_ready_s"] = row["oldest_ready_seconds"]
        if row["latest_error"] and (row["status"] == "dead" or not counts["latest_error"]):
            counts["latest_error"] = row["latest_error"][:300]
    return found


def _attention(counts: dict[str, Any], expired: int) -> list[str]:
    """Why a queue needs a person now (nothing: it does not)."""
    why = []
    if counts["dead"]:
        why.append(f"{counts['dead']} dead job(s) wait for a person: retry or delete them")
    oldest = counts["oldest_ready_s"]
    if oldest is not None and oldest > WAIT_ALERT:
        why.append(f"the oldest ready job has waited {oldest:.0f} s: is a worker running?")
    if expired:
        why.append(f"{expired} running job(s) past their lease: no reaper has taken them back")
    return why


def _lease(row: tuple[Any, ...]) -> dict[str, Any]:
    names = ("id", "queue", "fence", "attempts", "max_attempts", "group", "seat", "key")
    lease = dict(zip(names, row[:8], strict=True))
    left, running, waited = row[8:]
    return lease | {"left_s": left, "running_s": running, "waited_s": waited}


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}
