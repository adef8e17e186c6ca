"""Leases as the database held them (lesson 03): the lease left over time, and two reapers.

Both figures read what ``stories.watch`` recorded (every new ``lease_until`` a statement
wrote, stamped with the database's ``now()``), never the workers' own guesses.
``plain_reapers`` runs two reapers without ``SKIP LOCKED`` on one expired job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
import psycopg
from matplotlib.figure import Figure

from ..queue import Queue
from .stories import ReaperRace

# The reaper without SKIP LOCKED (a teaching variant, one queue only): it waits for a row
# another session has locked, then checks its WHERE again on the row's newest version.
PLAIN_REAP = """
UPDATE jobs SET status = 'ready', lease_until = NULL, run_at = now()
WHERE queue = %s AND status = 'running' AND lease_until < now()
RETURNING id
"""


def lease_left(held: pd.DataFrame, start: float, end: float) -> pd.DataFrame:
    """The lease left of one claim over time, from its lease rows (``set_t``, ``until_t``,
    oldest first, as ``stories.leases`` gives them) up to ``end``: at each row's ``set_t``
    a full lease, falling until the next row (or ``end``). Columns ``t`` (seconds since
    ``start``) and ``left`` (seconds)."""
    times: list[float] = []
    left: list[float] = []
    for (_, row), nxt in zip(held.iterrows(), [*held.set_t[1:], end], strict=True):
        times += [row.set_t - start, nxt - start]
        left += [row.until_t - row.set_t, row.until_t - nxt]
    return pd.DataFrame({"t": times, "left": left})


def draw_lease_left(left: pd.DataFrame, lease: float, who: str = "A") -> Figure:
    """The saw-tooth of the lease left, with the line where it would run out and the model's
    lowest point for a heartbeat every third of the lease."""
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.plot(left.t, left.left, color="tab:red", label="lease left: lease_until - time (database)")
    ax.axhline(0, color="black", linestyle=":", label="lease runs out")
    ax.axhline(
        lease * 2 / 3,
        color="0.5",
        linestyle="--",
        label="model: lowest point, a beat every lease/3",
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("lease left (s)")
    ax.set_ylim(-0.1, lease * 1.15)
    ax.set_title(f"Heartbeats keep {who}'s lease from ever running low")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def draw_reaper_race(race: ReaperRace) -> Figure:
    """One dot per claim's batch of jobs (they share one ``lease_until``): when its lease ran
    out, how long after that a reaper returned it, coloured by the reaper; area: jobs."""
    returns = race.returns().merge(race.leases.groupby("job_id").until_t.max().reset_index())
    origin = race.calls.start.min()
    batches = returns.groupby(["reaper", "until_t", "t"]).size().rename("jobs").reset_index()
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for name, mine in batches.groupby("reaper"):
        ax.scatter(
            mine.until_t - origin,
            (mine.t - mine.until_t) * 1000,
            s=4 * mine.jobs,
            label=f"returned by {name} (area: jobs)",
        )
    ax.set_xlabel("lease ran out (s since the reapers started; the database's lease_until)")
    ax.set_ylabel("returned after the lease ran out (ms)")
    ax.set_title(f"Two reapers, {len(race.jobs)} leases running out: each job returned once")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


@dataclass
class PlainReapers:
    """Two plain reapers on one expired job: the ids each returned, whether B waited for
    A's row lock, and the job's row afterwards (status, attempts, fence)."""

    job_id: int
    a: list[int]
    b: list[int]
    b_waited: bool
    after: tuple[str, int, int]


def plain_reapers(dsn: str, queue: str = "plain-reapers") -> PlainReapers:
    """A job's lease runs out; reaper A runs ``PLAIN_REAP`` in a transaction it keeps open
    (it holds the row's lock); reaper B runs the same statement meanwhile, on a thread. Once
    B is seen waiting for a lock (``pg_stat_activity``), A commits; then B finishes."""
    with Queue(dsn) as q:
        job_id = q.enqueue({}, queue=queue)
        (job,) = q.claim(queue, lease=0.05)
        time.sleep(0.1)  # the lease runs out
        with psycopg.connect(dsn) as a, psycopg.connect(dsn, autocommit=True) as b:
            a_ids = [row[0] for row in a.execute(PLAIN_REAP, [queue]).fetchall()]
            b_pid, b_ids = b.info.backend_pid, []
            reaper_b = threading.Thread(
                target=lambda: b_ids.extend(r[0] for r in b.execute(PLAIN_REAP, [queue]))
            )
            reaper_b.start()
            waited, deadline = False, time.monotonic() + 5
            while not waited and time.monotonic() < deadline:
                row = q.conn.execute(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                    [b_pid],
                ).fetchone()
                waited = bool(row and row[0])
                time.sleep(0.01)
            a.commit()
            reaper_b.join(5)
        after = q.get(job_id)
        assert after is not None and job.id == job_id
        return PlainReapers(
            job_id, a_ids, b_ids, waited, (after.status, after.attempts, after.fence)
        )
