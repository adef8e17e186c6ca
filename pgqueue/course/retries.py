"""Watching a job fail and retry, for the failures lesson (06).

``install_history`` adds a trigger that keeps every status change of a job with the
database's ``now()`` of the change (only in the lesson's own databases; pgqueue itself keeps
no history), and ``history`` reads one job's back with the retry delay each failure was
given. ``run_flaky`` lets a real worker retry one job with a handler of the notebook's, and
``plot_schedule`` draws the delays and the attempts. ``Walk`` takes jobs along the arrows of
the lifecycle map, one ``Queue`` method at a time, and records how each moved; ``misbehave``
feeds a worker the jobs whose handlers give up, ask for a delay, hang or exit.
Teaching aids, not the queue.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..job import Job
from ..queue import Queue
from ..worker import Handler, Worker

if TYPE_CHECKING:
    import pandas as pd
    import psycopg
    from matplotlib.figure import Figure

__all__ = [
    "HISTORY",
    "Misbehaved",
    "Walk",
    "history",
    "install_history",
    "misbehave",
    "plot_schedule",
    "run_flaky",
    "sql_frame",
    "wait_for_status",
]

# An audit trigger: each time a job's status changes, copy the new attempts, status, run_at
# and last_error with the time of the change. now() in a trigger is the time of the
# transaction that made the change, the same now() the fail statement used for run_at, so
# run_at - at is exactly the delay the queue chose.
HISTORY = """
CREATE TABLE job_history (
  job_id     bigint,
  attempts   int,
  status     text,
  run_at     timestamptz,
  at         timestamptz,
  last_error text
);
CREATE FUNCTION record_job_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO job_history
  VALUES (NEW.id, NEW.attempts, NEW.status, NEW.run_at, now(), NEW.last_error);
  RETURN NULL;
END $$;
CREATE TRIGGER jobs_history AFTER UPDATE OF status ON jobs
  FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
  EXECUTE FUNCTION record_job_history();
"""


def install_history(conn: psycopg.Connection) -> None:
    """Add the ``job_history`` table and its trigger (``HISTORY``) to ``conn``'s database."""
    conn.execute(HISTORY)  # type: ignore[arg-type]


def sql_frame(
    conn: psycopg.Connection, query: str, params: Collection[object] | None = None
) -> pd.DataFrame:
    """Run a query on ``conn`` and return the rows as a DataFrame."""
    import pandas as pd

    cur = conn.execute(query, params)  # type: ignore[arg-type]
    return pd.DataFrame(cur.fetchall(), columns=[c.name for c in cur.description or []])


def history(conn: psycopg.Connection, job_id: int) -> pd.DataFrame:
    """Every status change of one job: ``attempts``, ``status``, ``retry_in_s`` (after a
    failure, the delay it was given), ``last_error`` and ``at_s`` (seconds since the first)."""
    return sql_frame(
        conn,
        """
        SELECT attempts, status,
               CASE WHEN status = 'ready' AND last_error IS NOT NULL
                    THEN extract(epoch FROM run_at - at)::float END AS retry_in_s,
               CASE WHEN status IN ('ready', 'dead') THEN last_error END AS last_error,
               extract(epoch FROM at - min(at) OVER ())::float AS at_s
        FROM job_history WHERE job_id = %s ORDER BY at, attempts
        """,
        (job_id,),
    )


def wait_for_status(
    conn: psycopg.Connection, job_id: int, statuses: Collection[str], timeout: float
) -> str:
    """Poll the job's status until it is one of ``statuses`` (or ``timeout`` seconds
    pass); return the last status seen."""
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,)).fetchone()
        assert row is not None, f"job {job_id} is gone"
        if row[0] in statuses or time.monotonic() >= deadline:
            return str(row[0])
        time.sleep(0.02)


_runs = itertools.count(1)


def run_flaky(
    q: Queue, dsn: str, handler: Handler, backoff: float, max_attempts: int
) -> tuple[int, pd.DataFrame]:
    """Enqueue one job on ``q`` (a queue on database ``dsn``, with ``install_history``) on a
    queue of its own, let a worker with this ``backoff`` run ``handler`` on it, polling every
    20 ms, until the job is done or dead; return its id and its ``history``."""
    queue = f"flaky-{next(_runs)}"
    job_id = q.enqueue({"task": "call the flaky service"}, queue=queue, max_attempts=max_attempts)
    worker = Worker(
        handler,
        queue=queue,
        dsn=dsn,
        backoff=backoff,
        poll_interval=0.02,
        listen=False,
        lease=1.5,
        name="flaky",
    )
    worker.start()
    try:
        longest = backoff * 2 ** (max_attempts + 1)
        wait_for_status(q.conn, job_id, {"done", "dead"}, timeout=min(5 + longest, 60))
    finally:
        worker.stop(grace=1)
    return job_id, history(q.conn, job_id)


def plot_schedule(hist: pd.DataFrame, backoff: float, title_suffix: str = "") -> Figure:
    """Two panels from a ``history``: left, the delay the database gave after each failed
    attempt against ``backoff · 2^attempts`` (log scale); right, when each attempt began,
    the waits for ``run_at`` shaded, and how the job ended."""
    import matplotlib.pyplot as plt
    import numpy as np

    retries = hist[hist.retry_in_s.notna()]
    claims = hist[hist.status == "running"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    n = np.arange(1, max(int(hist.attempts.max()), 1) + 1)
    left.plot(n, backoff * 2.0**n, "-", color="0.6", label="model: backoff · 2^attempts")
    left.plot(
        retries.attempts, retries.retry_in_s, "o", color="C3", label="run_at - time of failure (DB)"
    )
    left.set_yscale("log")
    left.yaxis.set_major_formatter(plt.FormatStrFormatter("%g"))
    left.set_xticks(n)
    left.set_xlabel("attempt that failed (attempts after the claim)")
    left.set_ylabel("delay before the next attempt (s)")
    left.set_title("Retry delay doubles with each attempt")
    left.legend()
    done, dead = hist[hist.status == "done"], hist[hist.status == "dead"]
    right.barh(
        0.5,
        retries.retry_in_s,
        left=retries.at_s,
        height=0.25,
        color="C3",
        alpha=0.25,
        label="waiting for run_at",
    )
    right.vlines(claims.at_s, 0, 1, color="C0", label="attempt starts (claim)")
    right.plot(
        retries.at_s, np.full(len(retries), 0.5), "x", color="C3", ms=9, label="handler fails"
    )
    if len(done):
        right.plot(done.at_s, np.full(len(done), 0.5), "*", color="C2", ms=14, label="done")
    if len(dead):
        right.plot(
            dead.at_s,
            np.full(len(dead), 0.5),
            linestyle="",
            marker=r"$\dagger$",
            color="black",
            ms=14,
            label="last attempt fails: dead",
        )
    for _, row in claims.iterrows():
        right.annotate(str(int(row.attempts)), (row.at_s, 1.02), ha="center", fontsize=9)
    right.set_ylim(-0.05, 1.12)
    right.set_yticks([])
    right.set_xlabel("time since the first attempt (s); numbers: attempts")
    right.set_title("Attempts of one job" + title_suffix)
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=4, frameon=False)
    fig.tight_layout()
    return fig


class Walk:
    """Jobs taken along the lifecycle map by hand, each step one ``Queue`` method (one
    statement of ``queries.sql``); every step records, for each job it moved, the arrow
    (from, to, statement) and the job's ``attempts`` and ``fence`` after it."""

    def __init__(self, q: Queue) -> None:
        self.q = q
        self.rows: list[tuple[int, str, str | None, str, int, int, int, int]] = []

    def _state(self, job_id: int) -> Any:
        state = self.q.get(job_id)
        assert state is not None, f"job {job_id} is gone"
        return state

    def enqueue(self, name: str, max_attempts: int = 2) -> int:
        """A new job on a queue of its own, ``map-<name>``."""
        job_id = self.q.enqueue({"walk": name}, queue=f"map-{name}", max_attempts=max_attempts)
        new = self._state(job_id)
        self.rows.append((job_id, "enqueue", None, new.status, new.attempts, new.fence, 0, 0))
        return job_id

    def take(self, statement: str, action: Callable[[], Any], *job_ids: int) -> Any:
        """Run ``action`` (the Queue method that runs ``statement``) and record how each of
        ``job_ids`` moved; return what it returned."""
        before = {job_id: self._state(job_id) for job_id in job_ids}
        result = action()
        for job_id, old in before.items():
            new = self._state(job_id)
            self.rows.append(
                (
                    job_id,
                    statement,
                    old.status,
                    new.status,
                    new.attempts,
                    new.fence,
                    new.attempts - old.attempts,
                    new.fence - old.fence,
                )
            )
        return result

    def claim(self, job_id: int, lease: float = 30.0) -> Job:
        """Claim the job from its queue (the only job there)."""
        [job] = self.take(
            "claim", lambda: self.q.claim(self._state(job_id).queue, lease=lease), job_id
        )
        return job

    def arrows(self) -> set[tuple[str | None, str, str]]:
        """Every (from, to, statement) taken; ``from`` is None for an enqueue."""
        return {(source, target, statement) for _, statement, source, target, *_ in self.rows}

    def frame(self) -> pd.DataFrame:
        """The steps, one row per job moved."""
        import pandas as pd

        columns = ["job", "statement", "from", "to", "attempts", "fence", "Δ attempts", "Δ fence"]
        return pd.DataFrame(self.rows, columns=columns).fillna({"from": "(new)"})


class Misbehaved(NamedTuple):
    """What ``misbehave`` saw: the jobs by kind, the two slow ones, whether the hung
    handler was still asleep when all of them had ended, and each kind's outcome."""

    ids: dict[str, int]
    slow: list[int]
    hung_still_asleep: bool
    outcomes: pd.DataFrame


def misbehave(
    q: Queue,
    worker: Worker,
    due: Mapping[str, float],
    late: MutableMapping[str, Any],
    queue: str = "kinds",
    max_attempts: Mapping[str, int] | None = None,
) -> Misbehaved:
    """Enqueue one job ``{"kind": kind}`` per kind of ``due``, due that many seconds from
    now (with ``max_attempts[kind]`` attempts where given, else the default), and start
    ``worker`` (on ``queue``, with a ``timeout``). Once it has timed out a handler, enqueue
    two ``slow`` jobs; wait until every job is done or dead, then for the hung handler to put
    its late write in ``late["write"]`` (5 s at most), and stop the worker. The outcomes:
    each kind's status, attempts, fence, its first ending (the error, or the status) and the
    retry delay that ending was given."""
    import pandas as pd

    most = dict(max_attempts or {})
    ids = {
        kind: q.enqueue({"kind": kind}, queue=queue, delay=s, **_attempts(most, kind))
        for kind, s in due.items()
    }
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not any(
            e.kind == "fail" and e.detail.startswith("TimeoutError") for e in worker.events.events()
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("no handler timed out within 10 s")
            time.sleep(0.01)
        slow = q.enqueue_many([{"kind": "slow"}] * 2, queue=queue)  # are two lanes still there?
        for job_id in [*ids.values(), *slow]:
            wait_for_status(q.conn, job_id, {"done", "dead"}, timeout=10)
        hung_still_asleep = "write" not in late
        deadline = time.monotonic() + 5
        while "write" not in late and time.monotonic() < deadline:  # the hung handler wakes
            time.sleep(0.02)
    finally:
        worker.stop(grace=1)
    rows = []
    for kind, job_id in ids.items():
        state = q.get(job_id)
        assert state is not None
        first = history(q.conn, job_id).query("status != 'running'").iloc[0]
        rows.append(
            {
                "job": job_id,
                "kind": kind,
                "status": state.status,
                "attempts": state.attempts,
                "fence": state.fence,
                "first ending": first.last_error or first.status,
                "retry in (s)": first.retry_in_s,
            }
        )
    return Misbehaved(ids, slow, hung_still_asleep, pd.DataFrame(rows).set_index("kind"))


def _attempts(most: Mapping[str, int], kind: str) -> dict[str, int]:
    """``max_attempts`` for one kind's enqueue, if one was given."""
    return {"max_attempts": most[kind]} if kind in most else {}
