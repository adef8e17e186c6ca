"""Notebook 15's per-group limit experiments: a count-then-claim limit broken by two
claims in flight (pgqueuer's issue #761), pgqueue's slots in the same interleaving, and real
worker threads under a limit, sampled from the table. Teaching aids, not the queue.

``NAIVE_CLAIM`` is WRONG ON PURPOSE: never use it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import psycopg

from ..queue import Queue
from ..worker import Worker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# NEVER USE: count the group's running jobs, then claim, in one statement. The count is of
# this statement's snapshot, which cannot see a claim that has not committed yet, and SKIP
# LOCKED passes over the row that claim holds, to the next job of the same group.
NAIVE_CLAIM = """
UPDATE jobs
SET status = 'running', attempts = attempts + 1, fence = fence + 1,
    lease_until = now() + interval '30 seconds', started_at = now()
WHERE id IN (
  SELECT id FROM jobs AS j
  WHERE queue = %(queue)s AND status = 'ready'
    AND (SELECT count(*) FROM jobs AS r
         WHERE r.queue = j.queue AND r.group_key = j.group_key
           AND r.status = 'running') < %(per_group)s
  ORDER BY id
  LIMIT 1
  FOR UPDATE SKIP LOCKED
)
RETURNING id, group_key
"""


def _running(conn: psycopg.Connection, queue: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM jobs WHERE queue = %s AND status = 'running'", [queue]
    ).fetchone()
    return int(row[0]) if row else 0


def two_claims_in_flight(dsn: str, *, per_group: int = 1) -> pd.DataFrame:
    """Two workers claim from one group at the same moment: A's claim is sent and its
    transaction not yet committed when B's is sent. Once with ``NAIVE_CLAIM`` (limit
    ``per_group``), once with ``Queue.claim`` under ``Queue.limit(per_group=...)``. One row
    per way: which of tenant-a's three jobs A and B got, and how many of them run once both
    committed."""
    rows = []
    for way, queue in (("count, then claim", "naive"), ("pgqueue's slots", "slots")):
        with Queue(dsn) as setup:
            ids = setup.enqueue_many([{"n": n} for n in range(3)], queue=queue, group="tenant-a")
            if way == "pgqueue's slots":
                setup.limit(queue, per_group=per_group)
        nth = {job_id: f"job {n + 1}" for n, job_id in enumerate(ids)}  # of tenant-a's three
        with psycopg.connect(dsn) as a_conn, psycopg.connect(dsn, autocommit=True) as b_conn:

            def claim(
                conn: psycopg.Connection,
                way: str = way,
                queue: str = queue,
                nth: dict[int, str] = nth,
            ) -> list[str]:
                if way == "count, then claim":
                    params = {"queue": queue, "per_group": per_group}
                    got = [r[0] for r in conn.execute(NAIVE_CLAIM, params).fetchall()]
                else:
                    got = [job.id for job in Queue(conn).claim(queue)]
                return [nth[job_id] for job_id in got]

            with a_conn.transaction():  # A's claim, in flight
                a = claim(a_conn)
                b = claim(b_conn)
            after = claim(b_conn)  # B again, once A committed
            rows.append(
                {
                    "claim": way,
                    "A got": a,
                    "B got (A in flight)": b,
                    "B again (A committed)": after,
                    f"running of tenant-a (limit {per_group})": _running(b_conn, queue),
                }
            )
    return pd.DataFrame(rows).set_index("claim")


class Sampler:
    """Counts the running jobs of each group of a queue from a connection of its own, in
    a loop, while workers run: one row per group per sample (seconds, group, running)."""

    def __init__(self, dsn: str, queue: str) -> None:
        self.dsn, self.queue = dsn, queue
        self.rows: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                found = dict(
                    conn.execute(
                        "SELECT group_key, count(*) FROM jobs "
                        "WHERE queue = %s AND status = 'running' GROUP BY 1",
                        [self.queue],
                    ).fetchall()
                )
                t = time.monotonic()
                self.rows += [(t, g, int(found.get(g, 0))) for g in self.groups]
                time.sleep(0.005)

    def start(self, groups: list[str]) -> Sampler:
        self.groups = groups
        self._thread.start()
        return self

    def stop(self) -> pd.DataFrame:
        self._stop.set()
        self._thread.join(10)
        frame = pd.DataFrame(self.rows, columns=["t", "group", "running"])
        frame["t"] -= frame["t"].min()
        return frame


GROUPS = {"tenant-a": 24, "tenant-b": 6, "tenant-c": 6, "tenant-d": 6}


def run_groups(
    dsn: str,
    *,
    per_group: int | None,
    queue: str = "reports",
    workers: int = 2,
    lanes: int = 4,
    work: float = 0.1,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``workers`` Workers of ``lanes`` threads each drain jobs of ``work`` seconds: tenant-a's
    24 enqueued first, then 6 each of three other tenants, under a limit of ``per_group``
    (None: no limit). Returns the sampler's counts and one row per job (group, started,
    finished: seconds on the database clock, from the first start)."""
    with Queue(dsn) as q:
        q.conn.execute("DELETE FROM jobs WHERE queue = %s", [queue])
        q.limit(queue, per_group=per_group)
        for group, n in GROUPS.items():
            q.enqueue_many([{"n": i} for i in range(n)], queue=queue, group=group)
    sampler = Sampler(dsn, queue).start(list(GROUPS))
    options: dict[str, Any] = {"poll_interval": 0.02, "listen": False, "burst": False}
    pool = [
        Worker(lambda job: time.sleep(work), queue=queue, dsn=dsn, concurrency=lanes,
               name=f"w{i + 1}", **options).start()
        for i in range(workers)
    ]  # fmt: skip
    with Queue(dsn) as q:
        deadline = time.monotonic() + 60
        while q.conn.execute(
            "SELECT count(*) FROM jobs WHERE queue = %s AND status <> 'done'", [queue]
        ).fetchone() != (0,):
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not drain the queue in 60 s")
            time.sleep(0.02)
        for worker in pool:
            worker.stop(grace=2)
        samples = sampler.stop()
        rows = q.conn.execute(
            "SELECT group_key, extract(epoch FROM started_at)::float8,"
            " extract(epoch FROM finished_at)::float8 FROM jobs WHERE queue = %s ORDER BY id",
            [queue],
        ).fetchall()
        q.limit(queue, per_group=None)
    jobs = pd.DataFrame(rows, columns=["group", "started", "finished"])
    origin = jobs["started"].min()
    jobs[["started", "finished"]] -= origin
    return samples, jobs


def plot_groups(runs: dict[str, pd.DataFrame], per_group: int) -> Figure:
    """For each run (title -> sampler counts): the running jobs of each group over time,
    as the sampler read them from the table; the last run's limit dashed."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(11, 3.2), sharey=True, squeeze=False)
    for ax, (title, samples) in zip(axes[0], runs.items(), strict=True):
        for group in GROUPS:
            mine = samples[samples["group"] == group]
            ax.step(mine["t"], mine["running"], where="post", label=group, lw=1.4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds (sampled from the jobs table)")
    last = axes[0][-1]  # the limited run
    last.axhline(per_group, color="red", ls="--", lw=1)
    last.annotate(
        f"limit {per_group}", (0, per_group), xytext=(2, 3), textcoords="offset points",
        color="red", fontsize=8,
    )  # fmt: skip
    axes[0][0].set_ylabel("running jobs of the group")
    axes[0][-1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def limit_cost(path: Path) -> tuple[pd.DataFrame, str]:
    """``data/bench_limit.csv``: throughput of each case against the same jobs without
    groups, by batch size, and the run's stamp (date, machine)."""
    frame = pd.read_csv(path)
    first = frame.iloc[0]
    stamp = (
        f"pgqueue bench --only limit, {first.date_utc} UTC, {first.cores}-core {first.cpu_model}, "
        f"PostgreSQL {first.postgres}, {first.n_jobs:,} jobs, {first.concurrency} lanes, "
        f"median of {first.runs} runs"
    )
    table = frame.pivot(index="case", columns="batch", values="ratio_to_no_groups")
    table = table.loc[list(dict.fromkeys(frame["case"]))]
    table.columns = [f"batch {b}" for b in table.columns]
    return table, stamp


def plot_limit_cost(table: pd.DataFrame, stamp: str) -> Figure:
    """Bars: each case's throughput against no groups, one bar per batch size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    width = 0.8 / len(table.columns)
    for i, column in enumerate(table.columns):
        xs = [x + (i - (len(table.columns) - 1) / 2) * width for x in range(len(table))]
        ax.bar(xs, table[column], width, label=column)
    ax.axhline(1.0, color="0.4", lw=1, ls=":")
    ax.set_xticks(range(len(table)), table.index, fontsize=8)
    ax.set_ylabel("throughput / no groups")
    ax.set_title("What a per-group limit costs: the same no-op jobs, 4 lanes")
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, stamp, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig
