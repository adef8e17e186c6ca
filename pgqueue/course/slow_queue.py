"""Notebook 09's diagnosis: a queue that got slow while autovacuum kept running.

``SlowQueue`` starts a throwaway PostgreSQL of its own (autovacuum wakes every second there,
a setting of the whole server, so not on the course's shared one), gives its ``jobs`` table
autovacuum settings a busy queue should have, and opens the sessions of a small shop: an
admin console left idle in a transaction that read, a nightly report left idle in one that
wrote, and a worker that drains a burst of orders. What is wrong is for the reader to find.
Teaching aids, not the queue."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from ..queue import Queue
from ..server import EmbeddedServer
from ..worker import Worker

QUEUE = "orders"
# The claim's own SELECT (sql/queries.sql, claim): what a slow claim spends its time on.
CLAIM_SELECT = """SELECT id FROM jobs
WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
ORDER BY priority DESC, run_at, id
LIMIT 10
FOR UPDATE SKIP LOCKED"""
# The shop's sessions besides the worker: name -> the statements it ran and left open.
SESSIONS = {
    "admin console": ["BEGIN", "SELECT count(*) FROM jobs"],
    "nightly report": ["BEGIN", "SELECT txid_current()"],
}


class SlowQueue:
    """A throwaway server whose ``jobs`` table autovacuum visits after 500 dead versions,
    with the shop's sessions open and ``churn`` jobs drained (``dsn``: its database)."""

    def __init__(self, churn: int = 5000) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="pgqueue-slow-"))
        self.home.chmod(0o755)  # as root the server runs as another user, who must reach it
        self.server = EmbeddedServer(self.home, durable=False)
        self.sessions: dict[str, psycopg.Connection] = {}
        try:
            admin = self.server.start()
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET autovacuum_naptime = '1s'")
                conn.execute("SELECT pg_reload_conf()")
                conn.execute("CREATE DATABASE shop")
            self.dsn = self.server.dsn("shop")
            with Queue(self.dsn) as q:
                q.install()
                q.conn.execute(
                    "ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0,"
                    " autovacuum_vacuum_threshold = 500)"
                )
            for name, statements in SESSIONS.items():
                conn = psycopg.connect(self.dsn, application_name=name, autocommit=True)
                for statement in statements:
                    conn.execute(statement)  # type: ignore[arg-type]
                self.sessions[name] = conn
            self._drain(churn)
        except BaseException:
            self.close()
            raise

    def _drain(self, jobs: int) -> None:
        """A burst of ``jobs`` orders drained by a worker, then 20 fresh ones waiting."""
        with Queue(self.dsn) as q:
            q.enqueue_many([{"order": n} for n in range(jobs)], queue=QUEUE)
            worker = Worker(
                lambda job: None,
                queue=QUEUE,
                dsn=self.dsn,
                burst=True,
                listen=False,
                name="worker",
                concurrency=2,
            ).start()
            worker.join(timeout=120)
            worker.stop(grace=1)
            q.enqueue_many([{"order": jobs + n} for n in range(20)], queue=QUEUE)

    def table(self) -> dict[str, Any]:
        """``jobs`` in ``pg_stat_user_tables``: live and dead versions, autovacuum runs."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(
                "SELECT n_live_tup, n_dead_tup, autovacuum_count, last_autovacuum"
                " FROM pg_stat_user_tables WHERE relname = 'jobs'"
            )
            names = [c.name for c in cur.description or []]
            row = cur.fetchone()
        assert row is not None
        return dict(zip(names, row, strict=True))

    def wait_for_autovacuum(self, runs: int = 1, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until autovacuum has visited ``jobs`` ``runs`` more times; its stats then."""
        target = self.table()["autovacuum_count"] + runs
        deadline = time.monotonic() + timeout
        while (now := self.table())["autovacuum_count"] < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"autovacuum did not visit jobs within {timeout:g} s")
            time.sleep(0.2)
        return now

    def claim_buffers(self) -> int:
        """Pages (8 kB buffers) the claim's SELECT touched to find its jobs, from ``EXPLAIN
        (ANALYZE, BUFFERS)`` run in a transaction rolled back (it locks what it finds)."""
        with psycopg.connect(self.dsn) as conn:
            [[plan]] = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + CLAIM_SELECT,  # type: ignore[operator]
                {"queue": QUEUE},
            ).fetchall()
            conn.rollback()
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
        return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])

    def pid(self, name: str) -> int | None:
        """The server pid of the shop's session ``name`` (None if it has none open)."""
        conn = self.sessions.get(name)
        return None if conn is None or conn.closed else conn.info.backend_pid

    def close(self) -> None:
        """Close the sessions, stop the server and remove its files."""
        for conn in self.sessions.values():
            conn.close()
        self.server.stop()
        shutil.rmtree(self.home, ignore_errors=True)


__all__ = ["CLAIM_SELECT", "QUEUE", "SESSIONS", "SlowQueue"]
