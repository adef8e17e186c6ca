"""Where the benchmarks run, and what they share: the ``Bench``, progress bars, medians.

By default the benchmarks start a throwaway embedded PostgreSQL of their own, with the
server's default durability (fsync and synchronous_commit on, as a production server
would have them), so results do not depend on whatever server the user runs; ``--dsn``
points them at another server (the user must be allowed to create databases).

The machine is assumed shared and noisy: configurations are interleaved, each one is
repeated, and results carry the median with the min-max spread. Ratios between systems
are taken within one repetition, then their median is reported.

From a notebook::

    from pgqueue.tools import bench
    with bench.bench_server() as b:          # or bench.Bench(admin_dsn)
        rows = bench.bench_polling(b, intervals=[0.1, 1.0])
    print(bench.table(rows))
"""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg import sql
from psycopg.conninfo import make_conninfo

from ...db import connect
from ...job import Job
from ...server import EmbeddedServer, package_bin_dir
from ..databases import drop_database, fresh_database

QUEUE = "bench"


# -- where the benchmarks run ---------------------------------------------------------
@dataclass
class Bench:
    """A server to benchmark on: its admin DSN, and (when ours) the embedded server."""

    admin_dsn: str
    server: EmbeddedServer | None = None
    quick: bool = False
    repeats: int = 3
    progress: bool = True
    databases: list[str] = field(default_factory=list)

    def database(self, name: str, *, schema: bool = True) -> str:
        """A fresh database ``name`` (with the pgqueue schema unless told otherwise)."""
        self.databases.append(name)
        if schema:
            return fresh_database(name, self.admin_dsn)
        with connect(self.admin_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return make_conninfo(self.admin_dsn, dbname=name)

    def cleanup(self) -> None:
        """Drop the databases the benchmarks made (on a server that is not ours)."""
        for name in self.databases:
            with contextlib.suppress(Exception):
                drop_database(name, self.admin_dsn)
        self.databases.clear()

    def pgbench(self) -> Path:
        """The pgbench program shipped with the embedded server's binaries."""
        found = shutil.which("pgbench")
        path = self.server.bin("pgbench") if self.server else package_bin_dir() / "pgbench"
        if path.exists():
            return path
        if found:
            return Path(found)
        raise FileNotFoundError("pgbench not found next to the embedded server's binaries")


@contextlib.contextmanager
def bench_server(dsn: str | None = None, *, durable: bool = True) -> Iterator[Bench]:
    """A ``Bench`` on ``dsn``, else on a throwaway embedded server removed afterwards."""
    if dsn:
        bench = Bench(dsn)
        try:
            yield bench
        finally:
            bench.cleanup()
        return
    home = Path(tempfile.mkdtemp(prefix="pgqueue-bench-"))
    home.chmod(0o755)  # as root the server runs as another user, which must reach it
    server = EmbeddedServer(home, durable=durable)
    try:
        yield Bench(server.start(), server)
    finally:
        with contextlib.suppress(Exception):
            server.stop()
        shutil.rmtree(home, ignore_errors=True)


# -- small helpers ---------------------------------------------------------------------
def _progress(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar if tqdm is installed and wanted, else an object that ignores updates."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
        except ImportError:
            pass
    return _NoBar()


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[rank]


def _noop(job: Job) -> None:
    """The benchmark handler: does nothing, so the queue's own cost is all that is measured."""


def prefill(dsn: str, n: int, *, queue: str = QUEUE) -> None:
    """Empty the jobs table and fill it with ``n`` ready no-op jobs (server-side, fast)."""
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs RESTART IDENTITY")
        conn.execute(
            "INSERT INTO jobs (queue, payload) SELECT %s, '{}'::jsonb FROM generate_series(1, %s)",
            [queue, n],
        )
        conn.execute("VACUUM ANALYZE jobs")


def _count(dsn: str, status: str) -> int:
    with connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE status = %s", [status]).fetchone()
    return int(row[0]) if row else 0
