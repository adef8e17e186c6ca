"""Dead row versions and the vacuum horizon, measured: live and dead row versions of ``jobs``
from the statistics views, bursts of jobs drained by a worker, the idle sessions that do and
do not hold VACUUM back, a job crashing a transaction-per-job worker again and again, and
the figures of all of these (notebook 09, dead rows and the vacuum horizon).

``production.vacuum_verbose`` reads what VACUUM removed and kept, ``production.horizon_case``
runs one idle session's statements beside a VACUUM; this module gathers and draws them.
Teaching aids, not the queue."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from ..queue import Queue
from ..worker import Worker
from . import lab
from .production import horizon_case, vacuum_verbose

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

_COUNTS = "SELECT n_live_tup, n_dead_tup, n_tup_upd FROM pg_stat_user_tables WHERE relname = 'jobs'"


def table_rows(conn: psycopg.Connection) -> dict[str, int]:
    """Live and dead row versions of ``jobs`` (``n_live_tup``, ``n_dead_tup`` of
    ``pg_stat_user_tables``), after publishing this session's own counters."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(_COUNTS).fetchone()
    assert row is not None, "no table jobs"
    return {"live": int(row[0]), "dead": int(row[1])}


def burst(q: Queue, dsn: str, n: int, queue: str = "flow") -> float:
    """Enqueue ``n`` no-op jobs on ``q`` and let a worker with two lanes (database ``dsn``)
    drain them; return jobs per second. Returns once the statistics views count the two
    updates (claim, complete) of every job: a session publishes its counters as it closes."""
    row = q.conn.execute(_COUNTS).fetchone()
    assert row is not None, "no table jobs"
    updates_before = int(row[2])
    q.enqueue_many([{"n": i} for i in range(n)], queue=queue)
    start = time.perf_counter()
    worker = Worker(
        lambda job: None,
        queue=queue,
        dsn=dsn,
        concurrency=2,
        batch=50,
        complete_in_batches=True,
        burst=True,
        listen=False,
    )
    worker.start()
    worker.join(timeout=60)
    worker.stop(grace=1)
    rate = n / (time.perf_counter() - start)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        row = q.conn.execute(_COUNTS).fetchone()
        if row is not None and int(row[2]) - updates_before >= 2 * n:
            break
        time.sleep(0.05)
    return rate


class Stages:
    """The live and dead row versions of ``jobs`` after each step of an experiment."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.rows: list[dict[str, Any]] = []

    def note(self, stage: str) -> dict[str, Any]:
        """Count the row versions now, under the label ``stage``; return that row."""
        self.rows.append({"stage": stage, **table_rows(self.conn)})
        return self.rows[-1]


def plot_stages(
    stages: Sequence[Mapping[str, Any]], title: str = "Dead rows in the jobs table"
) -> Figure:
    """Live rows and dead row versions after each step, the steps taken while an idle
    session held the horizon shaded."""
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd

    frame = pd.DataFrame(list(stages))
    x = np.arange(len(frame))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    live = ax.bar(x - 0.2, frame.live, 0.4, color="C0", label="live rows (n_live_tup)")
    dead = ax.bar(x + 0.2, frame.dead, 0.4, color="C3", label="dead row versions (n_dead_tup)")
    ax.bar_label(live, fontsize=8)
    ax.bar_label(dead, fontsize=8)
    ax.set_ylim(0, 1.35 * max(frame.live.max(), frame.dead.max(), 1))
    held = [i for i, s in enumerate(frame.stage) if "session open" in s or "blocked" in s]
    if held:
        ax.axvspan(
            min(held) - 0.5,
            max(held) + 0.5,
            color="0.85",
            zorder=0,
            label="idle-in-transaction session open",
        )
    ax.set_xticks(x, frame.stage)
    ax.set_xlabel("after each step")
    ax.set_ylabel("row versions (rows)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=9, ncol=3)
    fig.tight_layout()
    return fig


# -- which idle sessions hold the horizon ---------------------------------------------------
def horizon_cases(
    dsn: str, q: Queue, cases: Mapping[str, Sequence[str]], jobs: int
) -> pd.DataFrame:
    """For each named list of statements, a session that runs them and sits idle while
    ``jobs`` jobs churn through ``q`` and VACUUM runs (``production.horizon_case``). One row
    per case: the session's ``state``, ``backend_xid``, ``backend_xmin``, what VACUUM removed
    and kept (``not_removable``), and ``holds``: an xid or a snapshot."""
    import pandas as pd

    frame = pd.DataFrame(
        [{"session": name, **horizon_case(dsn, q, sql, jobs=jobs)} for name, sql in cases.items()]
    ).set_index("session")
    frame["holds"] = frame.backend_xid.notna() | frame.backend_xmin.notna()
    return frame


def plot_horizon_cases(cases: pd.DataFrame) -> Figure:
    """The dead versions VACUUM had to keep beside each idle session, red where the session
    holds an xid or a snapshot."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    bars = ax.barh(
        cases.index, cases.not_removable, color=["C3" if h else "C2" for h in cases.holds]
    )
    ax.bar_label(bars, fontsize=8, padding=3)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max(cases.not_removable.max(), 1))
    ax.set_xlabel("dead row versions VACUUM had to keep (rows)")
    ax.set_ylabel("idle session")
    ax.set_title("Only a session holding an xid or a snapshot holds VACUUM back")
    ax.legend(
        handles=[
            plt.Rectangle((0, 0), 1, 1, color="C3", label="holds backend_xid or backend_xmin"),
            plt.Rectangle((0, 0), 1, 1, color="C2", label="holds neither"),
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout()
    return fig


# -- a transaction for the whole job, crashed -----------------------------------------------
# One row per crash: what each pattern's job shows afterwards.
CRASH_COLUMNS = [
    "crash",
    "one transaction: attempts",
    "one transaction: status",
    "short claim: attempts",
    "short claim: status",
]


def claim_when_free(
    conn: psycopg.Connection,
    claim: Callable[[psycopg.Connection, str], int | None],
    queue: str,
    timeout: float = 5.0,
) -> int:
    """``claim(conn, queue)`` until it returns a job id, rolling back between tries: the
    backend of a connection just closed may still hold the job's row lock for a moment."""
    deadline = time.monotonic() + timeout
    while (job_id := claim(conn, queue)) is None:
        conn.rollback()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no job of queue {queue!r} came back within {timeout:g} s")
        time.sleep(0.01)
    return job_id


def plot_crashes(crashes: pd.DataFrame, max_attempts: int) -> Figure:
    """The attempts each pattern recorded after each crash of its worker."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = crashes.index
    ax.step(
        x,
        crashes["short claim: attempts"],
        where="mid",
        color="C0",
        marker="o",
        label="pgqueue: short claim, lease, reaper",
    )
    ax.step(
        x,
        crashes["one transaction: attempts"],
        where="mid",
        color="C3",
        marker="s",
        label="transaction for the whole job",
    )
    ax.axhline(max_attempts, color="0.4", ls=":", label=f"max_attempts = {max_attempts}")
    first_dead = crashes.index[crashes["short claim: status"] == "dead"][0]
    ax.annotate(
        "dead: no more\nworkers lost",
        (first_dead, max_attempts),
        xytext=(0, -34),
        textcoords="offset points",
        ha="center",
        fontsize=8,
        color="C0",
    )
    ax.set_xticks(x)
    ax.set_ylim(-0.4, max_attempts + 1.6)
    ax.set_xlabel("worker crashes while running the job (count)")
    ax.set_ylabel("attempts recorded (count)")
    ax.set_title("A crash rolls back the attempt of a transaction held for the whole job")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


# -- the controls at the end of the notebook --------------------------------------------------
def vacuum_experiment(jobs: int = 2000, forgotten_session: bool = True) -> None:
    """In a scratch database of its own (``course_09_try``, autovacuum off for ``jobs``,
    dropped afterwards): a burst of ``jobs`` jobs, with or without a forgotten session
    holding an xid, then VACUUM (and, if there was one, VACUUM again once it ended); draw
    the row versions after each step."""
    import matplotlib.pyplot as plt

    with lab.scratch_database("course_09_try") as scratch, Queue(scratch) as fresh:
        fresh.conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")
        stages = Stages(fresh.conn)
        blocker = None
        if forgotten_session:
            blocker = psycopg.connect(scratch, application_name="forgotten session")
            blocker.execute("SELECT txid_current()")
        try:
            burst(fresh, scratch, jobs, queue="try")
            stages.note(f"{jobs} jobs" + ("\nsession open" if blocker else ""))
            result = vacuum_verbose(fresh.conn)
            stages.note("VACUUM" + ("\n(blocked)" if blocker else ""))
        finally:
            if blocker:
                blocker.close()
        if blocker:
            vacuum_verbose(fresh.conn)
            stages.note("session ended,\nVACUUM")
    plot_stages(
        stages.rows,
        f"VACUUM removed {result['removed']} dead versions, kept {result['not_removable']}",
    )
    plt.show()


__all__ = [
    "CRASH_COLUMNS",
    "Stages",
    "burst",
    "claim_when_free",
    "horizon_cases",
    "plot_crashes",
    "plot_horizon_cases",
    "plot_stages",
    "table_rows",
    "vacuum_experiment",
]
