"""Notebook 16's experiments and figures: a three-step job killed after its second step, the
two-statement step write (wrong on purpose) that the notebook races against ``job.step``,
its timelines, the result waits drawn, and a handler's transaction held to its commit.
Teaching aids, not the queue."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import pandas as pd
import psycopg

from ..errors import LeaseLost
from ..job import Job
from ..queue import Queue
from ..worker import Worker
from .faults import FaultyWorker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STEPS = ("reserve", "charge", "ship")
FAST = {"poll_interval": 0.05, "listen": False, "reap_interval": 0.1}


def killed_after_two(dsn: str, *, lease: float = 0.5) -> tuple[pd.DataFrame, int]:
    """A three-step job (reserve, charge, ship, each a ``job.step``): worker A runs it and
    dies right after storing the second step, before the third (``FaultyWorker.crash``:
    it writes nothing more, like SIGKILL); worker B, started then, gets the job back from the
    reaper once A's lease runs out. One row per step function that ran (attempt, worker,
    step), and the job's id."""
    ran: list[dict[str, Any]] = []
    crashed = threading.Event()

    def order(name: str, worker: list[Worker]) -> Any:
        def handler(job: Job) -> None:
            for step in STEPS:

                def do(step: str = step) -> dict[str, Any]:
                    ran.append({"attempt": job.attempts, "worker": name, "step": step})
                    return {"step": step, "by": name}

                job.step(step, do)
                if name == "A" and step == "charge":
                    worker[0].crash()  # killed here: step three never starts
                    crashed.set()
                    return

        return handler

    with Queue(dsn) as q:
        job_id = q.enqueue({"order": 7}, queue="orders")
    a_box: list[Worker] = []
    a = FaultyWorker(order("A", a_box), queue="orders", dsn=dsn, lease=lease, name="A", **FAST)
    a_box.append(a)
    a.start()
    if not crashed.wait(10):
        raise TimeoutError("worker A never reached its second step")
    b = Worker(order("B", []), queue="orders", dsn=dsn, lease=5, name="B", **FAST).start()
    with Queue(dsn) as q:
        deadline = time.monotonic() + 20
        while (state := q.get(job_id)) is None or state.status != "done":
            if time.monotonic() > deadline:
                raise TimeoutError("worker B did not finish the job")
            time.sleep(0.02)
    b.stop(grace=2)
    a.stop(grace=0.1)
    return pd.DataFrame(ran), job_id


# NEVER USE: check the claim, then write the step, in two statements.
CHECK = (
    "SELECT 1 FROM jobs WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'"
    " AND lease_until > clock_timestamp()"
)
WRITE = (
    "INSERT INTO pgqueue_steps (job_id, name, output, fence, written_at)"
    " VALUES (%(job)s, %(name)s, %(output)s, %(fence)s, clock_timestamp())"
    " ON CONFLICT (job_id, name) DO NOTHING"
)


def step_fence(conn: psycopg.Connection, job_id: int, name: str) -> int | None:
    """The fence stored with step ``name`` of job ``job_id`` (None if not stored)."""
    row = conn.execute(
        "SELECT fence FROM pgqueue_steps WHERE job_id = %s AND name = %s", [job_id, name]
    ).fetchone()
    return None if row is None else int(row[0])


def draw_stale_steps(conn: psycopg.Connection, runs: dict[str, dict[str, Any]]) -> Figure:
    """Notebook 16's stale-step story, one timeline per way of writing A's step two: the
    workers' lanes (A's claim and pause, the reaper's return, B's claim, each step-two write), the
    database's leases, and two storage lanes read from ``stories.watch``'s log: the job's
    row (its fence) and the stored step two (the fence it was written under)."""
    import matplotlib.pyplot as plt

    from . import plot, stories

    fig, axes = plt.subplots(len(runs), 1, figsize=(11.5, 3.4 * len(runs)))
    # Laid out once, before any timeline places its labels (layout=False below).
    fig.subplots_adjust(left=0.1, right=0.72, top=0.9, bottom=0.08, hspace=0.5)
    leases = stories.leases(conn)
    for ax, (way, run) in zip(axes, runs.items(), strict=True):
        job = run["job"]
        storage = {
            "jobs row": stories.fences(conn, "jobs", id=job),
            "step two row": stories.fences(conn, "pgqueue_steps", job_id=job, name="two"),
        }
        answer = run["B's step two returned"]
        plot.timeline(
            run["log"],
            ax=ax,
            leases=leases[leases.job_id == job],
            storage=storage,
            lanes=["A", "B"],
            title=f"{way}: B's step two returned {answer!r}",
            layout=False,
        )
    fig.suptitle("A freezes between its claim check and its step write; B takes the job over")
    return fig


def finished_at(conn: psycopg.Connection, job_id: int) -> float:
    """When job ``job_id`` ended (``finished_at``, the database's clock), as ``time.time()``
    seconds of this process."""
    from .stories import clock_offset

    row = conn.execute(
        "SELECT extract(epoch FROM finished_at)::float8 FROM jobs WHERE id = %s", [job_id]
    ).fetchone()
    assert row is not None and row[0] is not None, f"job {job_id} has not ended"
    return float(row[0]) - clock_offset(conn)


def waited(wait: dict[str, Any]) -> float:
    """Seconds from the handler's return to ``Queue.result``'s, in one of notebook 16's
    result waits."""
    return float(wait["at"]["result() returned"] - wait["at"]["handler returned"])


_WAIT_MARKS = {
    "handler returned": ("o", "none"),
    "job row done": ("s", "tab:blue"),
    "result() returned": ("*", "tab:red"),
}


def draw_result_waits(waits: dict[str, dict[str, Any]]) -> Figure:
    """Notebook 16's result waits, one lane each, in seconds since ``Queue.result`` was
    called: when the handler returned, when the job's row was done (database clock), when
    ``result`` returned, and the moments its polls were due (grey ticks)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.8 * len(waits)))
    end = max(w["at"]["result() returned"] - w["at"]["result() called"] for w in waits.values())
    right = max(end * 1.15, 1.3)
    for y, wait in enumerate(waits.values()):
        at, start = wait["at"], wait["at"]["result() called"]
        ax.plot(
            [0, at["result() returned"] - start],
            [y, y],
            color="0.75",
            lw=6,
            zorder=1,
            label="result() waiting" if y == 0 else None,
        )
        every = wait["poll every (s)"]
        polls = [k * every for k in range(1, int(right / every) + 1)]
        ax.scatter(
            polls,
            [y] * len(polls),
            marker="|",
            s=300,
            color="0.45",
            zorder=2,
            label="a poll due (poll_interval)" if y == 0 else None,
        )
        if not polls:
            ax.annotate(
                f"first poll due at {every:g} s →",
                (right, y),
                xytext=(-4, -12),
                textcoords="offset points",
                ha="right",
                fontsize=8,
                color="0.35",
            )
        for name, (marker, color) in _WAIT_MARKS.items():
            ax.scatter(
                [at[name] - start],
                [y],
                marker=marker,
                facecolors=color,
                edgecolors="tab:green" if color == "none" else color,
                linewidths=1.5,
                s=170 if color == "none" else 90,
                zorder=3,
                label=name if y == 0 else None,
            )
        ax.annotate(
            f"{waited(wait):.2f} s after the handler returned",
            (at["result() returned"] - start, y),
            xytext=(6, 9),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_yticks(range(len(waits)), list(waits))
    ax.set_ylim(-0.7, len(waits) - 0.3)
    ax.set_xlim(-0.05, right)
    ax.invert_yaxis()
    ax.set_xlabel("time since Queue.result() was called (s)")
    ax.set_ylabel("how result() waits")
    ax.set_title("Woken by the job's notification, or at the next poll")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


INVOICES = (
    "CREATE TABLE IF NOT EXISTS invoices (job_id bigint PRIMARY KEY, cents int CHECK (cents >= 0))"
)


def cancelled_mid_block(dsn: str, *, held: bool) -> dict[str, Any]:
    """Claim an invoice job and write its invoice in a transaction: ``job.transaction()``
    (``held``) or a plain one; someone cancels the job while the block is still writing.
    How the block ended, and whether the invoice is there."""
    with Queue(dsn) as q:
        q.conn.execute(INVOICES)
        q.enqueue({"order": 9}, queue="invoices")
        [job] = q.claim("invoices")
        assert job.conn is not None
        block = job.transaction() if held else job.conn.transaction()
        try:
            with block:
                job.conn.execute("INSERT INTO invoices VALUES (%s, 900)", [job.id])
                with Queue(dsn) as other:
                    assert other.cancel(job.id)  # someone cancels the job, mid-block
            outcome = "committed"
        except LeaseLost:
            outcome = "LeaseLost, rolled back"
        row = q.conn.execute("SELECT count(*) FROM invoices WHERE job_id = %s", [job.id])
        (kept,) = row.fetchone() or (0,)
    return {"block": outcome, "invoice rows": kept}
