"""A PgBouncer in transaction mode for a notebook, and what to watch through it.

``start_pgbouncer`` runs PgBouncer (if it is installed) in front of a database's server, on a
unix socket in a private temporary directory, with a small pool: the pooler the lesson's
workers and statements go through. Where PgBouncer is missing or cannot start, it returns
``None`` and the reason, and the notebook skips its demos. ``peak_sessions`` samples the
server's sessions in one database while a block runs, ``warnings_of`` keeps the warning
lines a logger emits, and ``drain_through`` runs burst workers through the pooler with
both watching. Teaching aids, not the queue (``--pgbouncer`` is the library's own).
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..worker import Worker

__all__ = [
    "Bouncer",
    "PooledRun",
    "drain_through",
    "peak_sessions",
    "start_pgbouncer",
    "warnings_of",
]

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
PORT = 6432


@dataclass
class Bouncer:
    """A running PgBouncer: its process, private directory and configuration."""

    process: subprocess.Popen[bytes]
    directory: Path
    config: str
    user: str
    server_socket: str

    def dsn(self, dbname: str) -> str:
        """A DSN for ``dbname`` through this PgBouncer."""
        return f"host={self.directory} port={PORT} user={self.user} dbname={dbname}"

    def shown_config(self) -> str:
        """The configuration with this machine's directories named, not spelled out."""
        shown = self.config.replace(str(self.directory), "<private directory>")
        return shown.replace(self.server_socket, "<the server's socket directory>")

    def stop(self) -> None:
        """End PgBouncer and remove its directory."""
        self.process.terminate()
        self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _version() -> tuple[int, int] | None:
    out = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def start_pgbouncer(target: str, pool_size: int) -> tuple[Bouncer | None, str]:
    """PgBouncer in transaction mode in front of the server of ``target``, ``pool_size``
    server connections per database, listening on a unix socket only; returns the bouncer
    and ``""``, or ``None`` and why it is not running here."""
    if not os.access(PGBOUNCER, os.X_OK):
        return None, "PgBouncer is not installed here (apt-get install pgbouncer)"
    where = Path(tempfile.mkdtemp(prefix="pgqueue-bouncer-"))
    try:
        return _start(target, pool_size, where), ""
    except (OSError, KeyError, RuntimeError) as exc:
        shutil.rmtree(where, ignore_errors=True)
        return None, f"PgBouncer could not start here ({exc})"


def _start(target: str, pool_size: int, where: Path) -> Bouncer:
    server = conninfo_to_dict(target)
    owner: tuple[int, int] | None = None
    if os.geteuid() == 0:  # PgBouncer refuses root: run it as the embedded server's user
        entry = pwd.getpwnam("pgqueue")
        owner = (entry.pw_uid, entry.pw_gid)
        os.chown(where, *owner)
    connect = " ".join(
        f"{k}={server[k]}" for k in ("host", "port", "user", "password") if k in server
    )
    config = (
        f"[databases]\n* = {connect}\n\n[pgbouncer]\n"
        f"listen_addr =\nlisten_port = {PORT}\nunix_socket_dir = {where}\nunix_socket_mode = 0600\n"
        f"pool_mode = transaction\ndefault_pool_size = {pool_size}\nmax_client_conn = 200\n"
        f"auth_type = any\nlogfile = {where}/pgbouncer.log\n"
    )
    version = _version()
    if version and version >= (1, 21):
        config += "max_prepared_statements = 0\n"  # as 1.18: no tracking of prepared statements
    (where / "pgbouncer.ini").write_text(config)
    if owner:
        os.chown(where / "pgbouncer.ini", *owner)
    process = subprocess.Popen(
        [PGBOUNCER, str(where / "pgbouncer.ini")],
        user=owner[0] if owner else None,
        group=owner[1] if owner else None,
        extra_groups=[] if owner else None,
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not (where / f".s.PGSQL.{PORT}").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            log = where / "pgbouncer.log"
            process.kill()
            raise RuntimeError(
                f"PgBouncer did not start: {log.read_text() if log.exists() else ''}"
            )
        time.sleep(0.05)
    user = str(server.get("user", "postgres"))
    return Bouncer(process, where, config, user, str(server.get("host", "")))


@dataclass
class Peak:
    """The most sessions seen so far (read it after the block)."""

    sessions: int = 0


@contextmanager
def peak_sessions(dsn: str, dbname: str, every: float = 0.01) -> Iterator[Peak]:
    """Sample, on a connection of its own to the server of ``dsn``, how many server
    sessions database ``dbname`` has, every ``every`` seconds while the block runs; the
    yielded ``Peak`` holds the largest count seen."""
    peak, done = Peak(), threading.Event()
    count = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"

    def watch() -> None:
        with psycopg.connect(make_conninfo(dsn, dbname="postgres"), autocommit=True) as conn:
            while not done.is_set():
                row = conn.execute(count, (dbname,)).fetchone()
                peak.sessions = max(peak.sessions, row[0] if row else 0)
                time.sleep(every)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def warnings_of(logger: str) -> Iterator[list[str]]:
    """The warning lines (and worse) that ``logger`` emits while the block runs."""
    kept = _Kept()
    logging.getLogger(logger).addHandler(kept)
    try:
        yield kept.lines
    finally:
        logging.getLogger(logger).removeHandler(kept)


@dataclass
class PooledRun:
    """What burst workers did through a pooler: the queue's jobs by (status, attempts,
    fence, count), the most server sessions its database had, the warnings logged."""

    outcome: list[tuple[str, int, int, int]]
    peak: int
    logged: list[str]


def drain_through(
    workers: Sequence[Worker], pool_dsn: str, dbname: str, queue: str, timeout: float = 120
) -> PooledRun:
    """Start ``workers`` (burst ones), wait for each to run dry and stop them, sampling the
    server sessions of database ``dbname`` and keeping the workers' warnings meanwhile;
    then read ``queue``'s jobs directly from the server (``pool_dsn``)."""
    with warnings_of("pgqueue.worker") as logged, peak_sessions(pool_dsn, dbname) as peak:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout)
            worker.stop()
    with psycopg.connect(pool_dsn, autocommit=True) as check:
        outcome = check.execute(
            "SELECT status, attempts, fence, count(*) FROM jobs WHERE queue = %s GROUP BY 1, 2, 3",
            [queue],
        ).fetchall()
    return PooledRun(outcome, peak.sessions, list(logged))
