"""The worker engine's lesson (notebook 18, inside the worker): where each kind of handler
runs, how many statements a worker sends for a backlog, counted by the worker and by the
server, and the figure and "Try it" run of that count. Teaching aids, not the queue."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pandas as pd
import psycopg

from ..db import resolve_dsn
from ..events import EventLog
from ..queue import JobState, Queue
from ..worker import Worker
from .lab import scratch_database

COUNTED = "course_18_statements"  # the scratch database whose commits are counted


def place(notebook_loop: asyncio.AbstractEventLoop) -> tuple[str, str]:
    """Where the calling handler runs: its thread's name (a lane's number shown as N), and
    which event loop runs on that thread ("none", "the notebook's" or "another")."""
    thread = re.sub(r"\.\d+$", ".N", threading.current_thread().name)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return thread, "none"
    return thread, "the notebook's" if loop is notebook_loop else "another"


def statements(events: EventLog, kind: str) -> int:
    """How many statements the worker sent for the events of ``kind`` ("claim", "complete"):
    what one statement did to a batch of jobs is recorded with one time stamp."""
    return len({event.t for event in events.events(kind)})


def enqueue_noops(dsn: str, jobs: int, queue: str = "noop") -> None:
    """Enqueue ``jobs`` jobs for a handler that does nothing."""
    with Queue(dsn) as q:
        q.enqueue_many([{}] * jobs, queue=queue)


def drain(dsn: str, queue: str = "noop", **options: Any) -> dict[str, int]:
    """Drain ``queue`` with a ``Worker`` whose handler does nothing (burst, the given
    options): the jobs done and the claim and completion statements it sent."""
    events = EventLog()
    worker = Worker(
        lambda job: None,
        queue=queue,
        dsn=dsn,
        burst=True,
        listen=False,
        events=events,
        name=queue,
        **options,
    )
    worker.start()
    worker.join(timeout=60)
    worker.stop()
    return {
        "jobs": worker.done,
        "claims": statements(events, "claim"),
        "completions": statements(events, "complete"),
    }


def commits(dbname: str, *, quiet: float = 0.2, timeout: float = 10.0) -> int:
    """The transactions database ``dbname`` has committed (``pg_stat_database``), read once
    no session is connected to it and the count has stopped moving: a session hands its
    counts to the statistics when it ends (or about once a second), not at each commit."""
    last, since = -1, time.monotonic()
    deadline = since + timeout
    with psycopg.connect(resolve_dsn(None), autocommit=True) as conn:
        while True:
            count, sessions = conn.execute(
                "SELECT d.xact_commit, (SELECT count(*) FROM pg_stat_activity a "
                "WHERE a.datname = d.datname) FROM pg_stat_database d WHERE d.datname = %s",
                [dbname],
            ).fetchone() or (0, 0)
            now = time.monotonic()
            if count != last or sessions:
                last, since = count, now
            elif now - since >= quiet or now > deadline:
                return int(count)
            time.sleep(0.05)


def counted(jobs: int, runs: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """For each run (a label and a ``Worker``'s options), ``drain`` of ``jobs`` no-op jobs
    in a queue of its own, in one scratch database, with the transactions the server
    committed there meanwhile (the worker's start-up included) and the statements per job:
    one row per run."""
    rows = {}
    with scratch_database(COUNTED) as dsn:
        for n, (label, options) in enumerate(runs.items()):
            queue = f"backlog-{n}"
            enqueue_noops(dsn, jobs, queue)
            before = commits(COUNTED)
            drained: dict[str, Any] = drain(dsn, queue, **options)
            drained["commits"] = commits(COUNTED) - before
            sent = drained["claims"] + drained["completions"]
            drained["statements per job"] = sent / max(1, jobs)
            drained["commits per job"] = drained["commits"] / max(1, jobs)
            rows[label] = drained
    return pd.DataFrame.from_dict(rows, orient="index")


def chores(rows: list[JobState], looks: dict[int, tuple[str, bool, int]]) -> pd.DataFrame:
    """The careless handler's jobs as the table holds them, each ``look`` with what it found
    on the lane's connection; sessions numbered in the order they first served a look."""
    numbers: dict[int, str] = {}
    for _, _, pid in looks.values():
        numbers.setdefault(pid, f"session {len(numbers) + 1}")
    table = pd.DataFrame(
        [
            {
                "id": job.id,
                "do": job.payload["do"],
                "status": job.status,
                "attempts": job.attempts,
                "last_error": job.last_error or "",
                "search_path seen": looks[job.id][0] if job.id in looks else "",
                "autocommit seen": looks[job.id][1] if job.id in looks else "",
                "session": numbers[looks[job.id][2]] if job.id in looks else "",
            }
            for job in rows
        ]
    )
    return table.set_index("id")


def one_lane(
    dsn: str, handler: Any, payloads: list[dict[str, Any]], queue: str = "chores"
) -> tuple[list[JobState], bool]:
    """Run ``handler`` over one job per payload, in order, on a ``Worker`` of one lane (a
    claim per job; a failed job is retried after 0.1 s): the jobs as the table holds them
    once all are done, and whether the worker was still working then."""
    with Queue(dsn) as q:
        ids = q.enqueue_many(payloads, queue=queue)
        worker = Worker(handler, queue=queue, dsn=dsn, backoff=0.05, poll_interval=0.1, name="lane")
        worker.start()
        deadline = time.monotonic() + 30
        while worker.done < len(ids) and time.monotonic() < deadline:
            time.sleep(0.02)
        working = not worker.stopping
        worker.stop()
        rows = [q.get(job_id) for job_id in ids]
    return [row for row in rows if row is not None], working


async def run_face(face: str, tasks: Any, dsn: str, *, jobs: int, **options: Any) -> None:
    """Run the registry ``tasks`` under one face of the engine until ``jobs`` jobs are done,
    then stop it: ``"Worker"`` (its engine on a thread and loop of its own; started and
    stopped without awaiting) or ``"AsyncWorker"`` (its engine on the loop that awaits this).
    The loop that awaits this runs on while the worker works."""
    from ..async_worker import AsyncWorker

    if face == "Worker":
        threaded = Worker(tasks, dsn=dsn, **options).start()
        while threaded.done < jobs:
            await asyncio.sleep(0.02)
        threaded.stop()
    elif face == "AsyncWorker":
        looped = await AsyncWorker(tasks, dsn=dsn, **options).start()
        while looped.done < jobs:
            await asyncio.sleep(0.02)
        await looped.stop()
    else:
        raise ValueError(f"face must be 'Worker' or 'AsyncWorker', got {face!r}")


def places(ran: list[tuple[str, str, str, str]]) -> pd.DataFrame:
    """The distinct places the handlers noted, (face, handler, thread, event loop) each,
    indexed by face and handler: one row per pair when each ran in one place only."""
    where = pd.DataFrame(ran, columns=["face", "handler", "thread", "event loop"])
    return where.drop_duplicates().set_index(["face", "handler"]).sort_index()


def plot_backlog(backlog: pd.DataFrame, *, title: str | None = None) -> Any:
    """The table of ``counted`` drawn: for each run (one colour), the claims and completion
    statements the worker sent and the commits the server counted, beside the number of
    jobs (the dashed line: one statement per job), on a log scale."""
    import matplotlib.pyplot as plt

    measures = {"claims": "claims", "completions": "completion\nstatements", "commits": "commits"}
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / max(1, len(backlog))
    for n, (label, row) in enumerate(backlog.iterrows()):
        xs = [i + (n - (len(backlog) - 1) / 2) * width for i in range(len(measures))]
        values = [int(row[column]) for column in measures]
        bars = ax.bar(xs, values, width, label=str(label))
        ax.bar_label(bars, labels=[f"{v:,}" for v in values], fontsize=8)
    jobs = int(backlog.jobs.max())
    ax.axhline(jobs, color="0.3", linestyle="--", linewidth=1, label=f"{jobs} jobs")
    ax.set_yscale("log")
    ax.set_ylim(1, jobs * 5)
    ax.set_xticks(range(len(measures)), list(measures.values()))
    ax.set_ylabel("count (log scale)")
    ax.set_title(title or f"{jobs} jobs drained: the worker's statements, the server's commits")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def try_backlog(concurrency: int = 4, batch: int = 10, jobs: int = 300) -> None:
    """The backlog run of notebook 18 with your lanes and batch: ``counted`` buffered and
    one completion per job, in the scratch database ``COUNTED``; shows the table and its
    figure."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    lanes = {"concurrency": concurrency, "batch": batch}
    backlog = counted(
        jobs,
        {
            "buffered (default)": lanes,
            "one complete per job": lanes | {"complete_in_batches": False},
        },
    )
    display(backlog.round(2))
    plot_backlog(backlog, title=f"{jobs} jobs, {concurrency} lanes, batch={batch}")
    plt.show()
