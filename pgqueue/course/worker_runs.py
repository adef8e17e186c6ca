"""The command-line worker run from a notebook, and its runs read back from the jobs table.

``run_worker`` starts ``pgqueue worker MODULE:tasks --burst`` as a separate process (the
console script of this environment), with the database in ``PGQUEUE_DSN`` as a deployment
would pass it, and notes on the database's clock when it was launched and when it exited.
``handled_jobs`` reads the claimed jobs' ``started_at`` and ``finished_at`` (stamped by the
database too) and tells which run took each; ``plot_runs`` draws them over the runs' spans.
Teaching aids, not the queue.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["WorkerRun", "handled_jobs", "plot_runs", "run_worker"]

PGQUEUE = Path(sys.executable).with_name("pgqueue")  # the console script of this environment


@dataclass(frozen=True)
class WorkerRun:
    """One finished worker process: its exit code and output, and when it was launched and
    seen to exit, read from the database's clock."""

    name: str
    process: subprocess.CompletedProcess[str]
    launched: datetime
    exited: datetime

    @property
    def summary(self) -> str:
        """The worker's last line: what it did."""
        lines = self.process.stdout.strip().splitlines()
        return lines[-1] if lines else ""


def _clock(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def run_worker(
    conn: psycopg.Connection,
    dsn: str,
    *options: str,
    name: str = "run",
    tasks: str = "example_tasks:tasks",
    cwd: Path | None = None,
) -> WorkerRun:
    """Run ``pgqueue worker TASKS --burst --poll 0.1 --backoff 0.05 --name shop-worker
    OPTIONS`` in ``cwd`` (default: here) on database ``dsn`` until it exits; ``conn`` reads
    the database's clock before and after."""
    command = [str(PGQUEUE), "worker", tasks, "--burst", "--poll", "0.1", "--backoff", "0.05"]
    command += ["--name", "shop-worker", *options]
    launched = _clock(conn)
    process = subprocess.run(
        command,
        cwd=cwd or Path.cwd(),
        env=os.environ | {"PGQUEUE_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return WorkerRun(name, process, launched, _clock(conn))


def handled_jobs(conn: psycopg.Connection, runs: list[WorkerRun]) -> pd.DataFrame:
    """One row per job that was claimed: id, task, kwargs, status, last_error, and in seconds
    since the first run was launched its claim (``started_s``), its end (``finished_s``) and
    ``took_s``; ``run`` names the worker run whose process was alive throughout."""
    import pandas as pd

    rows = conn.execute(
        "SELECT id, payload->>'task', payload->'kwargs', status, last_error, started_at, "
        "finished_at FROM jobs WHERE started_at IS NOT NULL ORDER BY id"
    ).fetchall()
    columns = ["id", "task", "kwargs", "status", "last_error", "started_at", "finished_at"]
    jobs = pd.DataFrame(rows, columns=columns)
    origin = min(run.launched for run in runs)
    jobs["started_s"] = (jobs.started_at - origin).dt.total_seconds()
    jobs["finished_s"] = (jobs.finished_at - origin).dt.total_seconds()
    jobs["took_s"] = jobs.finished_s - jobs.started_s

    def run_of(started: datetime, finished: datetime) -> str:
        [name] = [r.name for r in runs if r.launched <= started <= finished <= r.exited]
        return name

    jobs["run"] = [run_of(a, b) for a, b in zip(jobs.started_at, jobs.finished_at, strict=True)]
    return jobs


def spans(runs: list[WorkerRun]) -> dict[str, tuple[float, float]]:
    """Each run's launch and exit, in seconds since the first launch."""
    origin = min(run.launched for run in runs)
    return {
        r.name: ((r.launched - origin).total_seconds(), (r.exited - origin).total_seconds())
        for r in runs
    }


def plot_runs(
    jobs: pd.DataFrame, runs: list[WorkerRun], *, asked: dict[int, float], timeout: float
) -> Figure:
    """One row per job: claimed (``started_at``) to done or dead (``finished_at``), over the
    spans of the worker processes; the jobs in ``asked`` (id -> the seconds they asked to
    take) also with that time hatched and their ``timeout`` as a dashed line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.9))
    ax.plot([], [], ">", color="tab:blue", label="claimed (started_at)")
    ax.plot([], [], "s", color="tab:green", label="done (finished_at)")
    ax.plot([], [], "X", color="tab:red", label="dead (finished_at)")
    right = 0.0
    for y, job in enumerate(jobs.itertuples()):
        done = job.status == "done"
        color = "tab:green" if done else "tab:red"
        text_at = job.finished_s
        if job.id in asked:  # what it asked for, and where the timeout was
            wanted = asked[job.id]
            ax.barh(y, wanted, left=job.started_s, height=0.5, color="none", edgecolor="0.5",
                    hatch="//", label=f"the {wanted:g} s it asked for")  # fmt: skip
            ax.plot([job.started_s + timeout] * 2, [y - 0.42, y + 0.42], "--", color="0.1",
                    lw=1.5, label=f"its timeout, {timeout:g} s after the claim")  # fmt: skip
            text_at = job.started_s + wanted
        ax.plot([job.started_s, job.finished_s], [y, y], color=color, lw=7, solid_capstyle="butt")
        ax.plot(job.started_s, y, ">", color="tab:blue", ms=8)
        ax.plot(job.finished_s, y, "s" if done else "X", color=color, ms=8 if done else 10)
        took = f"{job.took_s * 1000:.0f} ms" if job.took_s < 0.1 else f"{job.took_s:.2f} s"
        why = "" if done else f" ({str(job.last_error).split(':')[0]})"
        ax.annotate(f"{job.status}{why} after {took}", (text_at, y), xytext=(9, -3),
                    textcoords="offset points", fontsize=8.5)  # fmt: skip
        right = max(right, text_at)
    colors = ["tab:blue", "tab:purple", "tab:orange", "tab:olive"]
    for n, (name, (start, end)) in enumerate(spans(runs).items()):
        ax.axvspan(start, end, color=colors[n % len(colors)], alpha=0.12,
                   label=f"worker process alive, {name}")  # fmt: skip
        right = max(right, end)
    names = [
        f"#{j.id} {j.task}" + (f", order {j.kwargs['order_id']}" if "order_id" in j.kwargs else "")
        for j in jobs.itertuples()
    ]
    ax.set_yticks(range(len(jobs)), names)
    ax.set_ylim(len(jobs) - 0.4, -0.6)
    ax.set_xlim(0, right * 1.5)  # room for the last label
    ax.set_xlabel("time since the first worker process was launched (s, database clock)")
    ax.set_ylabel("job")
    ax.set_title("The command-line worker's runs, from the jobs table's started_at and finished_at")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
