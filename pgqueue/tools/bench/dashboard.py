"""Benchmark: the web dashboard's pages and API at a million finished jobs (``--quick``:
100,000).

The table is made by one ``INSERT ... SELECT generate_series`` over five queues: 99.7 %
done jobs, 0.1 % dead, the newest 0.2 % ready and running (half each); one job in a hundred
has ``"color": "blue"`` in its payload; then ``VACUUM ANALYZE``, as autovacuum would have
left it. The dashboard runs as ``pgqueue dashboard`` would, in uvicorn on a loopback port
(a thread of this process), with its statement timeout raised to ``TIMEOUT`` seconds so the
slow requests are measured rather than cut off; each request is sent ``repeats`` times over
HTTP (``http.client``, one connection), interleaved, and timed from send to the last byte.
Last, once each, on that table: a bulk retry of every dead job (1,000 at a million rows),
then a bulk cancel of every ready job. The dashboard's overview reads through the partial
indexes, so it should cost the same at any number of finished jobs; the text search and
``exact`` counts read the table, and say so.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...db import connect
from .runner import Bench, _progress, _spread

TOKEN = "bench-token-not-secret"
TIMEOUT = 60.0  # seconds: the dashboard's statement timeout here (its default is 5)
QUEUES = 5

DASHBOARD_COLUMNS = [
    "request",
    "rows_in_table",
    "runs",
    "ms_median",
    "ms_min",
    "ms_max",
    "bytes",
    "note",
]

FILL = """
INSERT INTO jobs (queue, payload, status, run_at, attempts, fence, lease_until,
                  started_at, finished_at, last_error)
SELECT 'q' || (i %% %(queues)s), jsonb_build_object('n', i, 'color',
         CASE WHEN i %% 100 = 7 THEN 'blue' ELSE 'red' END),
       s.status, s.t - interval '1 second', 1, 1,
       CASE WHEN s.status = 'running' THEN now() + interval '30 seconds' END,
       CASE WHEN s.status <> 'ready' THEN s.t - interval '10 milliseconds' END,
       CASE WHEN s.status IN ('done', 'dead') THEN s.t END,
       CASE WHEN s.status = 'dead' THEN 'RuntimeError: boom ' || i END
FROM (SELECT i, now() - make_interval(secs => 86400.0 * (1 - i::float8 / %(n)s)) AS t,
             CASE WHEN i > %(n)s - %(n)s / 500 THEN
                    CASE WHEN i %% 2 = 0 THEN 'ready' ELSE 'running' END
                  WHEN i %% 1000 = 2 THEN 'dead' ELSE 'done' END AS status
      FROM generate_series(1, %(n)s) AS i) AS s
"""


def fill(dsn: str, n: int) -> int:
    """Fill an empty jobs table as described above; return the id of its middle job."""
    with connect(dsn) as conn:
        conn.execute(FILL, {"n": n, "queues": QUEUES})
        conn.execute("VACUUM ANALYZE jobs")
        row = conn.execute("SELECT max(id) / 2 FROM jobs").fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def serving(dsn: str) -> Iterator[int]:
    """The dashboard in uvicorn on a free loopback port (a thread); yields the port."""
    from ...contrib.dashboard.background import Background

    with Background(dsn, token=TOKEN, statement_timeout=TIMEOUT) as served:
        yield served.port


def _send(conn: http.client.HTTPConnection, method: str, path: str) -> tuple[float, int]:
    headers = {"Authorization": f"Bearer {TOKEN}"} if method == "POST" else {}
    started = time.perf_counter()
    conn.request(method, path, headers=headers)
    answer = conn.getresponse()
    body = answer.read()
    took = time.perf_counter() - started
    if answer.status != 200:
        raise RuntimeError(f"{method} {path}: {answer.status} {body[:200]!r}")
    return took * 1000, len(body)


def requests(middle: int, a_job: int) -> list[tuple[str, str, str]]:
    """(name, path, what it reads) of every GET measured."""
    return [
        ("overview page", "/", "partial indexes, jobs_lease_idx, a primary-key range"),
        ("GET /api/overview", "/api/overview", "the same, as JSON"),
        ("GET /api/queues", "/api/queues", "Queue.stats(): partial indexes, finished estimated"),
        ("GET /api/queues?exact=1", "/api/queues?exact=1", "Queue.stats(exact=True): every row"),
        ("jobs page", "/jobs", "the newest 50 jobs: the primary key backwards"),
        ("GET /api/jobs", "/api/jobs", "the same, as JSON"),
        ("GET /api/jobs?status=dead", "/api/jobs?status=dead", "1 job in 1,000 is dead"),
        ("GET /api/jobs?queue=q1&status=done", "/api/jobs?queue=q1&status=done", "common"),
        (
            "GET /api/jobs?before=<middle id>",
            f"/api/jobs?before={middle}",
            "a page half way down (keyset)",
        ),
        ("GET /api/jobs?q=blue", "/api/jobs?q=blue", "text in 1 payload in 100"),
        (
            "GET /api/jobs?q=<no match>",
            "/api/jobs?q=no-such-text",
            "text found nowhere: every payload read (bounded by the statement timeout)",
        ),
        ("job page", f"/jobs/{a_job}", "one job and its steps: primary key"),
        ("GET /api/jobs/<id>", f"/api/jobs/{a_job}", "the same, as JSON"),
    ]


def bench_dashboard(
    bench: Bench, *, n_rows: int | None = None, repeats: int | None = None
) -> list[dict[str, Any]]:
    """Each dashboard request's time on a table of ``n_rows`` mostly finished jobs."""
    n_rows = n_rows or (100_000 if bench.quick else 1_000_000)
    repeats = repeats or (5 if bench.quick else 20)
    dsn = bench.database("bench_dashboard")
    bar = _progress(repeats + 2, "dashboard", bench.progress)
    try:
        bar.set_postfix_str(f"filling {n_rows:,} rows")
        middle = fill(dsn, n_rows)
        bar.update()
        measured = requests(middle, a_job=middle)
        times: dict[str, list[float]] = {name: [] for name, _, _ in measured}
        sizes: dict[str, int] = {}
        with serving(dsn) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT + 10)
            for _name, path, _ in measured:  # once first: connections opened, plans cached
                _send(conn, "GET", path)
            for rep in range(repeats):
                order = measured[rep % len(measured) :] + measured[: rep % len(measured)]
                for name, path, _ in order:
                    took, size = _send(conn, "GET", path)
                    times[name].append(took)
                    sizes[name] = size
                bar.update()
            bar.set_postfix_str("bulk actions")
            once = [
                ("POST /api/bulk/retry?status=dead", "every dead job, batches of 1,000 ids"),
                ("POST /api/bulk/cancel?status=ready", "every ready job, batches of 1,000 ids"),
            ]
            for name, _ in once:
                took, size = _send(conn, "POST", name.split(" ", 1)[1])
                times[name], sizes[name] = [took], size
            conn.close()
            bar.update()
    finally:
        bar.close()
    notes = {name: note for name, _, note in measured} | dict(once)
    rows = []
    for name, samples in times.items():
        med, lo, hi = _spread(samples)
        rows.append(
            {
                "request": name,
                "rows_in_table": n_rows,
                "runs": len(samples),
                "ms_median": round(med, 2),
                "ms_min": round(lo, 2),
                "ms_max": round(hi, 2),
                "bytes": sizes[name],
                "note": notes[name],
            }
        )
    return rows
