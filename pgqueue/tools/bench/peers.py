"""Benchmark 3, peers: procrastinate and pgqueuer beside pgqueue, same server, same N."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .drain import DrainConfig, drain_once
from .enqueue import _payloads, enqueue_once
from .report import _version
from .runner import QUEUE, Bench, _progress, _spread

PEER_SETTINGS = {
    "pgqueue": "Worker(concurrency=4, batch=10, complete_in_batches=True, listen=False, "
    "burst=True); enqueue: Queue.enqueue per job, Queue.enqueue_many(chunk)",
    "procrastinate": "PsycopgConnector (async pool), async no-op task, "
    "run_worker_async(concurrency=4, wait=False, listen_notify=False, delete_jobs=never); "
    "enqueue: defer_async per job, batch_defer_async(chunk)",
    "pgqueuer": "AsyncpgDriver (its recommended driver; PsycopgDriver if asyncpg is missing), "
    "one connection, async no-op entrypoint, "
    "QueueManager.run(batch_size=10, mode=drain), other settings default; "
    "enqueue: Queries.enqueue per job, Queries.enqueue(lists of chunk)",
}


def _peer_pgqueue(dsn: str, operation: str, n: int, chunk: int) -> float:
    if operation == "drain":
        return drain_once(dsn, DrainConfig("pgqueue", 4, 10, "batched"), n)
    method = "enqueue" if operation == "enqueue_single" else "enqueue_many"
    return enqueue_once(dsn, method, _payloads(n), chunk)


def _peer_procrastinate(dsn: str, operation: str, n: int, chunk: int) -> float:
    import asyncio
    import logging

    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop", queue=QUEUE)
    async def noop(i: int = 0) -> None:
        """Does nothing."""

    async def run() -> float:
        async with app.open_async():
            async with app.connector.pool.connection() as conn:  # type: ignore[attr-defined]
                await conn.execute("TRUNCATE procrastinate_jobs CASCADE")
            if operation == "drain":
                for i in range(0, n, 1000):
                    await noop.batch_defer_async(*({"i": k} for k in range(i, min(n, i + 1000))))
            started = time.perf_counter()
            if operation == "enqueue_single":
                for k in range(n):
                    await noop.defer_async(i=k)
            elif operation == "enqueue_bulk":
                for i in range(0, n, chunk):
                    await noop.batch_defer_async(*({"i": k} for k in range(i, min(n, i + chunk))))
            else:
                await app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=4,
                    wait=False,
                    listen_notify=False,
                    install_signal_handlers=False,
                )
            elapsed = time.perf_counter() - started
            async with app.connector.pool.connection() as conn:  # type: ignore[attr-defined]
                want = "succeeded" if operation == "drain" else "todo"
                cur = await conn.execute(
                    "SELECT count(*) FROM procrastinate_jobs WHERE status = %s", [want]
                )
                row = await cur.fetchone()
                if not row or row[0] != n:
                    raise RuntimeError(f"procrastinate {operation}: {row} of {n} jobs {want}")
        return n / elapsed

    return asyncio.run(run())


def _peer_pgqueuer(dsn: str, operation: str, n: int, chunk: int) -> float:
    import asyncio
    import logging

    from pgqueuer.core.qm import QueueManager
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.queries import Queries

    logging.getLogger("pgqueuer").setLevel(logging.WARNING)

    async def enqueue(queries: Queries, count: int, size: int) -> None:
        for i in range(0, count, size):
            m = min(count, i + size) - i
            await queries.enqueue(["noop"] * m, [None] * m, [0] * m)

    async def run() -> float:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with conn, _pgqueuer_driver(dsn) as driver:
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
            queries = Queries(driver)
            if operation == "drain":
                await enqueue(queries, n, 1000)
            started = time.perf_counter()
            if operation == "enqueue_single":
                for _ in range(n):
                    await queries.enqueue("noop", None)
            elif operation == "enqueue_bulk":
                await enqueue(queries, n, chunk)
            else:
                qm = QueueManager(queries)

                @qm.entrypoint("noop")
                async def noop(job: Any) -> None:
                    """Does nothing."""

                await qm.run(batch_size=10, mode=QueueExecutionMode.drain)
            elapsed = time.perf_counter() - started
            cur = await conn.execute("SELECT count(*) FROM pgqueuer")
            row = await cur.fetchone()
            left = row[0] if row else -1
            if left != (0 if operation == "drain" else n):
                raise RuntimeError(f"pgqueuer {operation}: {left} jobs left in the queue of {n}")
        return n / elapsed

    return asyncio.run(run())


@contextlib.asynccontextmanager
async def _pgqueuer_driver(dsn: str) -> Any:
    """pgqueuer's asyncpg driver on its own connection (psycopg's if asyncpg is missing)."""
    try:
        import asyncpg
        from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver
    except ImportError:
        from pgqueuer.adapters.drivers.psycopg import PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with conn:
            yield PsycopgDriver(conn)
        return
    params = conninfo_to_dict(dsn)
    conn = await asyncpg.connect(
        host=params.get("host"),
        port=int(params.get("port", 5432)),
        user=params.get("user"),
        password=params.get("password"),
        database=params.get("dbname"),
    )
    try:
        yield AsyncpgDriver(conn)
    finally:
        await conn.close()


def _install_peer(system: str, dsn: str) -> None:
    import asyncio

    if system == "procrastinate":
        import procrastinate

        app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
        with app.open():
            app.schema_manager.apply_schema()
    elif system == "pgqueuer":
        from pgqueuer.adapters.drivers.psycopg import PsycopgDriver
        from pgqueuer.queries import Queries

        async def install() -> None:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            async with conn:
                await Queries(PsycopgDriver(conn)).install()

        asyncio.run(install())


PEERS: dict[str, Callable[[str, str, int, int], float]] = {
    "pgqueue": _peer_pgqueue,
    "procrastinate": _peer_procrastinate,
    "pgqueuer": _peer_pgqueuer,
}


def bench_peers(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    single_jobs: int | None = None,
    chunk: int = 1_000,
    repeats: int | None = None,
    systems: Sequence[str] = ("pgqueue", "procrastinate", "pgqueuer"),
    samples: dict[tuple[str, str], list[float]] | None = None,
) -> list[dict[str, Any]]:
    """Enqueue one by one, enqueue in bulk, and drain ``n_jobs`` no-op jobs with each system
    in a database of its own on the same server, interleaved; a system that cannot run
    gets one row saying why."""
    n_jobs = n_jobs or (500 if bench.quick else 2_000)
    single_jobs = single_jobs or (200 if bench.quick else 1_000)
    repeats = repeats or bench.repeats
    operations = ("enqueue_single", "enqueue_bulk", "drain")
    rows: list[dict[str, Any]] = []
    ready: dict[str, str] = {}
    for system in systems:
        try:
            dsn = bench.database(f"bench_peer_{system}", schema=system == "pgqueue")
            _install_peer(system, dsn)
            ready[system] = dsn
        except Exception as exc:  # e.g. not installed: say so in the results
            rows.append(_peer_row(system, "all", 0, [], f"cannot run: {exc}"))
    runs: dict[tuple[str, str], list[float]] = {(s, op): [] for s in ready for op in operations}
    errors: dict[tuple[str, str], str] = {}
    bar = _progress(len(runs) * repeats, "peers", bench.progress)
    try:
        for _ in range(repeats):
            for system, op in runs:
                if (system, op) in errors:
                    continue
                bar.set_postfix_str(f"{system} {op}")
                n = single_jobs if op == "enqueue_single" else n_jobs
                try:
                    runs[(system, op)].append(PEERS[system](ready[system], op, n, chunk))
                except Exception as exc:
                    errors[(system, op)] = f"failed: {type(exc).__name__}: {exc}"
                bar.update()
    finally:
        bar.close()
    if samples is not None:
        samples.update(runs)
    for (system, op), values in runs.items():
        n = single_jobs if op == "enqueue_single" else n_jobs
        note = errors.get((system, op), "")
        if op == "enqueue_bulk":
            note = note or f"chunks of {chunk}"
        rows.append(_peer_row(system, op, n, values, note))
    return rows


def _peer_row(
    system: str, operation: str, n: int, values: Sequence[float], note: str
) -> dict[str, Any]:
    med, lo, hi = _spread(values) if values else (float("nan"),) * 3
    return {
        "system": system,
        "version": _version(system),
        "operation": operation,
        "n_jobs": n,
        "jobs_per_s_median": round(med, 1),
        "jobs_per_s_min": round(lo, 1),
        "jobs_per_s_max": round(hi, 1),
        "runs": len(values),
        "settings": PEER_SETTINGS.get(system, ""),
        "note": note,
    }
