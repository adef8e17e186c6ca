"""How an idle worker learns of new work, measured: one worker per (poll interval, LISTEN)
setting, the enqueue-to-start latency of each job, the statements an idle worker sends
grouped by purpose, one worker's statements while it holds a job, burst and backlog
throughput, and the figures of all of these (notebook 07, polling vs LISTEN/NOTIFY).

The statement counting itself (a statement-level trigger) is ``polling.statement_log``, and
the backlog and burst runs are ``polling.drain_backlog`` and ``polling.burst_trials``; this
module starts the workers, shapes the results into tables and draws them. Teaching aids,
not the queue."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..events import EventLog
from ..job import Job
from ..queue import Queue
from ..worker import Worker
from . import lab
from .polling import statement_log

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

Setting = tuple[float, bool]  # (poll_interval in seconds, listen)

# The statements of sql/queries.sql by what they do (one job or many at a time, same purpose).
PURPOSE = {
    "claim": "claim",
    "reap": "reap",
    "heartbeat": "heartbeat",
    "heartbeat_many": "heartbeat",
    "complete": "complete",
    "complete_many": "complete",
}


def _seconds(value: float, _pos: Any = None) -> str:
    return f"{value:g}"


# -- workers, one per setting ---------------------------------------------------------------
def start_workers(
    dsn: str, settings: Iterable[Setting], started: dict[int, float], **options: Any
) -> dict[Setting, Worker]:
    """One worker per ``(poll_interval, listen)``, each on a queue of its own named after its
    setting (``poll-0.2s``, ``listen-0.2s``), noting in ``started`` the ``time.time()`` at
    which each job's handler began. Returns once the workers listen (or made their first
    empty claim). ``options`` go to every ``Worker``."""

    def note_start(job: Job) -> None:
        started[job.id] = time.time()

    workers = {}
    for poll, listen in settings:
        name = f"{'listen' if listen else 'poll'}-{poll:g}s"
        workers[poll, listen] = Worker(
            note_start,
            queue=name,
            dsn=dsn,
            poll_interval=poll,
            listen=listen,
            lease=1.5,
            name=name,
            **options,
        ).start()
    time.sleep(0.5)  # listeners have run LISTEN, pollers have made their first empty claim
    return workers


def stop_all(workers: Mapping[Any, Worker]) -> None:
    """Stop every worker at once (each may take up to its poll interval to notice)."""
    with ThreadPoolExecutor(max(len(workers), 1)) as pool:
        list(pool.map(lambda w: w.stop(grace=1), workers.values()))


def plot_latency(latency: pd.DataFrame) -> Figure:
    """Each job's latency (dots) and the median per setting (lines) against the poll
    interval, with one interval (the longest wait) and half of one (the mean) as models."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for listen, color, label in ((False, "C1", "polling only"), (True, "C0", "polling + LISTEN")):
        part = latency[latency.listen == listen]
        jitter = np.exp(np.random.default_rng(1).uniform(-0.06, 0.06, len(part)))
        ax.scatter(
            part.poll_interval_s * jitter,
            part.latency_ms.clip(lower=0.1),
            s=18,
            color=color,
            alpha=0.45,
            label=f"{label}: one job",
        )
        med = part.groupby("poll_interval_s").latency_ms.median()
        ax.plot(med.index, med.values, "o-", color=color, lw=2, label=f"{label}: median")
    x = np.array(sorted(latency.poll_interval_s.unique()))
    ax.plot(x, 1000 * x, ":", color="0.4", label="one poll interval (the longest wait)")
    ax.plot(x, 500 * x, "--", color="0.6", label="model: half a poll interval (the mean wait)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel("poll interval (s)")
    ax.set_ylabel("enqueue-to-start latency (ms)")
    ax.set_title("Latency grows with the poll interval, unless the worker listens")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


# -- what an idle worker sends ----------------------------------------------------------------
def idle_table(rates: pd.DataFrame, workers: Mapping[Setting, Worker]) -> pd.DataFrame:
    """``StatementLog.rates`` (per worker and statement) as one row per setting: claims,
    reaps and heartbeats per second, and all statements together."""
    import pandas as pd

    names = [w.name for w in workers.values()]
    by_purpose = rates.T.groupby(lambda kind: PURPOSE.get(kind, "other")).sum().T
    by_purpose = by_purpose.reindex(index=names, fill_value=0.0)
    kinds = by_purpose.reindex(columns=["claim", "reap", "heartbeat"], fill_value=0.0)
    return pd.DataFrame(
        [
            {
                "poll_interval_s": poll,
                "listen": listen,
                **kinds.loc[w.name],
                "total": by_purpose.loc[w.name].sum(),
            }
            for (poll, listen), w in workers.items()
        ]
    )


def plot_idle(idle: pd.DataFrame, reap_interval: float) -> Figure:
    """Statements per second of each idle worker (all, and claims alone) against its poll
    interval, beside the model ``1 / poll interval + 1 / reap interval``."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for listen, color, marker, size in ((False, "C1", "o", 12), (True, "C0", "s", 6)):
        part = idle[idle.listen == listen].sort_values("poll_interval_s")
        label = "polling + LISTEN" if listen else "polling only"
        ax.plot(
            part.poll_interval_s,
            part.total,
            marker,
            color=color,
            ms=size,
            mfc="none" if not listen else None,
            mew=2,
            label=f"{label}: all statements",
        )
        ax.plot(
            part.poll_interval_s,
            part.claim,
            marker,
            color=color,
            ms=size / 2,
            alpha=0.6,
            label=f"{label}: claims only",
        )
    x = np.geomspace(min(idle.poll_interval_s), max(idle.poll_interval_s), 50)
    ax.plot(x, 1 / x, ":", color="0.4", label="claims alone: 1 / poll interval")
    ax.plot(
        x,
        1 / x + 1 / reap_interval,
        "--",
        color="0.2",
        label=f"model: 1 / poll interval + 1 / reap interval ({reap_interval:g} s)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(_seconds)
    ax.set_xticks(sorted(idle.poll_interval_s.unique()))
    ax.set_xlabel("poll interval (s)")
    ax.set_ylabel("statements per second, empty queue (1/s)")
    ax.set_title("Idle cost of one worker: a claim per poll, and a reap per reap interval")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


@dataclass
class HeldJob:
    """Every statement one worker sent around one job it held: ``sent`` has one row per
    statement (``purpose``, ``at`` in server seconds), ``since`` is where the window began,
    and ``claimed_at`` / ``completed_at`` bound the time the job was held."""

    sent: pd.DataFrame
    since: float
    claimed_at: float
    completed_at: float


def hold_one_job(
    dsn: str,
    q: Queue,
    *,
    hold: float,
    lease: float,
    concurrency: int,
    poll_interval: float,
    reap_interval: float,
) -> HeldJob:
    """Start one worker (named ``holder``) with these settings, let it idle 0.4 s, give it
    one job whose handler sleeps ``hold`` seconds, let it idle 0.4 s more, and return every
    UPDATE statement it sent in that window, by purpose."""
    held = EventLog()
    with statement_log(dsn) as log:
        worker = Worker(
            lambda job: time.sleep(hold),
            queue="one-job",
            dsn=dsn,
            concurrency=concurrency,
            poll_interval=poll_interval,
            reap_interval=reap_interval,
            lease=lease,
            name="holder",
            events=held,
        ).start()
        try:
            time.sleep(0.3)  # past start-up
            since = log.now()
            time.sleep(0.4)
            q.enqueue({"slow": True}, queue="one-job")
            lab.wait_for(held, "complete", timeout=10)
            time.sleep(0.4)
            until = log.now()
        finally:
            worker.stop(grace=1)
        sent = log.frame(since, until).query("worker == 'holder'")
    sent = sent.assign(purpose=sent.kind.map(PURPOSE).fillna("other"))
    return HeldJob(sent, since, held.events("claim")[0].t, held.events("complete")[0].t)


def plot_statements(run: HeldJob) -> Figure:
    """One tick per statement, one row per purpose, the time the job was held shaded."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.axvspan(
        run.claimed_at - run.since,
        run.completed_at - run.since,
        color="tab:green",
        alpha=0.15,
        label="holding the job (claim to complete)",
    )
    order = ["claim", "reap", "heartbeat", "complete"]
    rows = order + sorted(set(run.sent.purpose) - set(order))
    for row, purpose in enumerate(rows):
        at = run.sent.loc[run.sent.purpose == purpose, "at"] - run.since
        ax.plot(
            at, [row] * len(at), "|", ms=18, mew=2, color=f"C{row}", label=f"{purpose} ({len(at)})"
        )
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("statement")
    ax.set_title("Every statement one worker (2 lanes) sent: heartbeats only while it held a job")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


# -- throughput against the poll interval -----------------------------------------------------
def burst_spread(bursts: pd.DataFrame, backlog: pd.DataFrame, burst: int) -> pd.DataFrame:
    """Seconds ``burst`` jobs took, per poll interval, as min, median and max over the
    repeats: for each burst of ``polling.burst_trials``, from its enqueue to its last job
    done (polling only, and with LISTEN); for a backlog, ``burst`` jobs' share of each drain
    (``backlog``: jobs per second, one row per interval, one column per repeated drain).
    Columns: (series, statistic)."""
    import pandas as pd

    stats = ["min", "median", "max"]
    waited = bursts.groupby(["listen", "poll_interval_s"]).all_done_s.agg(stats)
    drained = burst / backlog
    return pd.concat(
        {
            "bursts, polling only": waited.loc[False],
            "bursts, polling + LISTEN": waited.loc[True],
            "backlog": pd.DataFrame({stat: drained.agg(stat, axis=1) for stat in stats}),
        },
        axis=1,
    ).rename_axis("poll interval (s)")


def plot_burst_times(spread: pd.DataFrame, burst: int, unwaited_s: float, runs: int) -> Figure:
    """The seconds of ``burst_spread`` against the poll interval, both axes linear (the wait
    for a poll grows in proportion to the interval): each series' median with a bar from
    its fastest to its slowest run, and, thin and grey, the model: ``T0 + interval / 2``
    for bursts that wait for the next poll (``T0``, ``unwaited_s``: what a burst takes when
    it waits for none, measured with LISTEN), and ``T0`` for those that do not wait."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    grid = np.linspace(0, max(spread.index) * 1.05, 50)
    ax.plot(grid, unwaited_s + grid / 2, "-", color="0.6", lw=1, zorder=1,
            label="model, polling only: T0 + interval / 2 (the mean wait for a poll)")  # fmt: skip
    ax.plot(grid, np.full_like(grid, unwaited_s), "--", color="0.6", lw=1, zorder=1,
            label="model, LISTEN or a backlog: T0 (no wait)")  # fmt: skip
    looks = {
        "bursts, polling only": ("s", "C1", f"bursts of {burst}, polling only", 0),
        "bursts, polling + LISTEN": ("^", "C0", f"bursts of {burst}, polling + LISTEN", 1),
        "backlog": ("o", "C2", f"a backlog: {burst} jobs' share of the drain", -1),
    }
    dodge = 0.012 * grid[-1]  # side by side at each interval, so no bar hides another
    for name, (marker, color, label, side) in looks.items():
        part = spread[name]
        ax.errorbar(
            part.index + side * dodge,
            part["median"],
            yerr=[part["median"] - part["min"], part["max"] - part["median"]],
            fmt=marker,
            color=color,
            ms=7,
            capsize=3,
            zorder=3,
            label=f"measured, {label}",
        )
    ax.set_xlim(0, grid[-1])
    ax.set_ylim(0, None)
    ax.set_xlabel("poll interval (s)")
    ax.set_ylabel(f"seconds to finish {burst} jobs")
    ax.set_title(f"Bursts wait for the next poll: half an interval on average ({runs} runs each)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.text(1.02, 0.02, "markers: median of the runs\nbars: fastest to slowest run",
            transform=ax.transAxes, fontsize=8, color="0.3", va="bottom")  # fmt: skip
    fig.tight_layout()
    return fig


# -- the benchmark ------------------------------------------------------------------------------
def plot_bench(bench: pd.DataFrame, stamp: str) -> Figure:
    """``data/bench_polling.csv`` in three panels against the poll interval: latency (p50,
    p99), throughput at steady arrivals, and the idle worker's statements per second."""
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [
        ("latency_p50_ms", "enqueue-to-start latency, p50 and p99 (ms)", "Latency"),
        ("jobs_per_s", "throughput at steady arrivals (jobs/s)", "Throughput"),
        ("idle_qps", "statements per second, empty queue (1/s)", "Idle cost"),
    ]
    panels = [p for p in panels if p[0] in bench.columns]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    grouped = bench.groupby(["listen", "poll_interval_s"]).median(numeric_only=True).reset_index()
    x = np.geomspace(grouped.poll_interval_s.min(), grouped.poll_interval_s.max(), 50)
    for ax, (column, ylabel, title) in zip(axes[0], panels, strict=True):
        for listen, color, label in (
            (False, "C1", "polling only"),
            (True, "C0", "polling + LISTEN"),
        ):
            part = grouped[grouped.listen == listen]
            ax.plot(
                part.poll_interval_s,
                part[column],
                "o-" if listen else "o--",
                color=color,
                ms=5 if listen else 10,
                mfc=None if listen else "none",
                label=label + (": p50" if column == "latency_p50_ms" else ""),
            )
            if column == "latency_p50_ms" and "latency_p99_ms" in part:
                ax.plot(
                    part.poll_interval_s,
                    part.latency_p99_ms,
                    "^:",
                    color=color,
                    alpha=0.7,
                    label=f"{label}: p99",
                )
        if column == "latency_p50_ms":
            ax.plot(x, 500 * x, "--", color="0.6", label="model: half a poll interval")
            ax.set_yscale("log")
        if column == "idle_qps":
            ax.plot(x, 1 / x + 1 / 5, ":", color="0.3", label="model: 1/interval + 1/(5 s)")
            ax.set_yscale("log")
        if column == "jobs_per_s" and "arrival_per_s" in bench:
            ax.axhline(bench.arrival_per_s.median(), color="0.5", ls=":", label="arrival rate")
            ax.set_ylim(0, 1.4 * grouped.jobs_per_s.max())
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_seconds)
        ax.set_xlabel("poll interval (s)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} (benchmark)")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"data/bench_polling.csv, {stamp}", fontsize=9)
    fig.tight_layout()
    return fig


# -- the controls at the end of the notebook --------------------------------------------------
def try_setting(poll_interval: float = 0.2, listen: bool = False, jobs: int = 6) -> None:
    """One worker with this setting, in a scratch database of its own (``course_07_try``,
    dropped afterwards), gets ``jobs`` jobs one at a time at random moments; draw each job's
    enqueue-to-start latency against one poll interval."""
    import matplotlib.pyplot as plt
    import numpy as np

    seen: dict[int, float] = {}  # job ids start at 1 again in the scratch database
    rows = []
    with lab.scratch_database("course_07_try") as scratch, Queue(scratch) as fresh:
        workers = start_workers(scratch, [(poll_interval, listen)], seen)
        try:
            (worker,) = workers.values()
            for _ in range(jobs):
                time.sleep(random.uniform(0, poll_interval))
                t0 = time.time()
                job_id = fresh.enqueue({}, queue=worker.queue)
                deadline = time.monotonic() + poll_interval + 5
                while job_id not in seen and time.monotonic() < deadline:
                    time.sleep(0.002)
                rows.append(1000 * (seen.get(job_id, np.nan) - t0))
        finally:
            stop_all(workers)
    _, ax = plt.subplots(figsize=(7, 3))
    ax.plot(range(1, jobs + 1), rows, "o", color="C0" if listen else "C1", label="one job")
    ax.axhline(1000 * poll_interval, ls=":", color="0.4", label="one poll interval")
    ax.set_xlabel("job number")
    ax.set_ylabel("enqueue-to-start latency (ms)")
    ax.set_ylim(bottom=0)
    state = "on" if listen else "off"
    median = statistics.median(rows)
    ax.set_title(f"poll every {poll_interval:g} s, LISTEN {state}: median {median:.0f} ms")
    ax.legend()
    plt.show()


__all__ = [
    "PURPOSE",
    "HeldJob",
    "burst_spread",
    "hold_one_job",
    "idle_table",
    "plot_bench",
    "plot_burst_times",
    "plot_idle",
    "plot_latency",
    "plot_statements",
    "start_workers",
    "stop_all",
    "try_setting",
]
