"""What a chaos run left behind, for its lesson: every lost attempt traced to its fault, the
run's rows copied into a database of the notebook's (so the trace can be read in SQL), and
the re-runs per fault kind drawn against what the injected faults can explain.

``trace`` is ``chaos_view.trace`` adapted to the rule of the chaos checks
(``pgqueue.tools.chaos.checks.attribute``): a done job's last handler start finished the job
and is never a lost attempt. ``chaos_view.trace`` paired the first ``attempts - 1`` starts
with their successors, so when a claim was lost before its handler started (it leaves no
start), the finishing run was counted as lost, with no re-run and no fault: a busy machine
made the lesson fail on it. ``run_chaos`` is ``chaos_view.run_chaos`` with this trace."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd
import psycopg

from ..tools.chaos import Config, Report
from . import chaos_view
from .chaos_view import COLORS, UNSTARTED, ChaosRun

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TABLES = (
    "CREATE TABLE chaos_runs (job_id bigint, fence bigint, worker text, started_at timestamptz)",
    "CREATE TABLE chaos_faults (kind text, worker text, at timestamptz, detail text)",
)


def run_chaos(config: Config, say: Callable[[str], None] | None = None) -> ChaosRun:
    """``chaos_view.run_chaos``, its re-runs traced by ``trace``."""
    run = chaos_view.run_chaos(config, say)
    run.reruns = trace(run.jobs, run.runs, run.faults)
    return run


def trace(jobs: pd.DataFrame, runs: pd.DataFrame, faults: pd.DataFrame) -> pd.DataFrame:
    """One row per lost attempt, with the fault behind it (the columns of
    ``chaos_view.trace``).

    A job's handler starts, in order: every start of a dead job, and every start but the
    last of a done job, is a lost attempt, and the next start re-ran it. Its cause is the
    first fault, from a second before the lost start to the re-run, that hit the worker
    running it, or a server restart. Lost attempts beyond those starts were claims cut
    before their handler started: traced to the latest fault before the job's last start.
    """
    rows: list[dict[str, Any]] = []
    fault_list = list(faults.itertuples(index=False))
    by_job = {job_id: part.sort_values("started_at") for job_id, part in runs.groupby("job_id")}
    for job in jobs.itertuples(index=False):
        starts = list(by_job.get(job.id, runs.iloc[0:0]).itertuples(index=False))
        lost = job.attempts - (1 if job.status == "done" else 0)
        lost_starts = starts if job.status != "done" else starts[:-1]
        for n, run in enumerate(lost_starts[:lost]):
            after = starts[n + 1] if n + 1 < len(starts) else None
            until = after.started_at if after is not None else None
            begun = run.started_at - pd.Timedelta(seconds=1)
            cause = next(
                (
                    f
                    for f in fault_list
                    if (f.worker == run.worker or f.kind == "restart")
                    and begun <= f.at
                    and (until is None or f.at <= until)
                ),
                None,
            )
            rows.append(_row(job.id, run, after, cause))
        for _ in range(lost - len(lost_starts[:lost])):  # claims that never reached the handler
            after = starts[-1] if starts else None
            until = after.started_at if after is not None else None
            cause = next((f for f in reversed(fault_list) if until is None or f.at <= until), None)
            rows.append(_row(job.id, None, after, cause))
    return pd.DataFrame(rows, columns=COLUMNS)


COLUMNS = [
    "job_id",
    "lost_fence",
    "lost_worker",
    "lost_at",
    "rerun_worker",
    "rerun_at",
    "cause",
    "fault_worker",
    "fault_at",
]


def _row(job_id: int, run: Any, after: Any, cause: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "lost_fence": run.fence if run is not None else None,
        "lost_worker": run.worker if run is not None else UNSTARTED,
        "lost_at": run.started_at if run is not None else None,
        "rerun_worker": after.worker if after is not None else None,
        "rerun_at": after.started_at if after is not None else None,
        "cause": cause.kind if cause is not None else "unattributed",
        "fault_worker": cause.worker if cause is not None else None,
        "fault_at": cause.at if cause is not None else None,
    }


def copy_rows(dsn: str, run: ChaosRun) -> None:
    """Create ``chaos_runs`` (one row per handler start) and ``chaos_faults`` (one row per
    injected fault) in ``dsn`` and copy the run's rows into them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in TABLES:
            conn.execute(table)
        with conn.cursor() as cur:
            with cur.copy("COPY chaos_runs FROM STDIN") as copy:
                for row in run.runs.itertuples(index=False):
                    copy.write_row(row)
            with cur.copy("COPY chaos_faults FROM STDIN") as copy:
                for row in run.faults.itertuples(index=False):
                    copy.write_row([None if pd.isna(v) else v for v in row])


def query(dsn: str, sql: str) -> pd.DataFrame:
    """The rows of one query on ``dsn``, as a DataFrame with the query's column names."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql.encode())
        return pd.DataFrame(cur.fetchall(), columns=[c.name for c in cur.description or ()])


def plot_by_fault(report: Report, allowed: Mapping[str, int], traced: Mapping[str, int]) -> Figure:
    """Per fault kind, two bars: the most extra attempts its injections can cost (grey), and
    the lost attempts traced to it (in the fault's colour)."""
    import matplotlib.pyplot as plt

    kinds = list(allowed)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = range(len(kinds))
    ax.bar([i - 0.2 for i in x], [allowed[k] for k in kinds], 0.4, color="0.75")
    ax.bar(
        [i + 0.2 for i in x],
        [traced.get(k, 0) for k in kinds],
        0.4,
        color=[COLORS[k] for k in kinds],
    )
    ax.set_xticks(list(x), [f"{k}\n({report.faults[k]} injected)" for k in kinds])
    ax.set(
        xlabel="fault kind",
        ylabel="extra attempts (count)",
        ylim=(0, max(allowed.values(), default=0) + 1.5),
        title=f"Re-runs by fault: {report.extra_attempts} of at most {report.bound}",
    )
    grey = plt.Rectangle((0, 0), 1, 1, color="0.75", label="the most the injected faults can cost")
    traced_box = plt.Rectangle(
        (0, 0),
        1,
        1,
        facecolor="white",
        edgecolor="black",
        label="lost attempts traced to them (fault's colour)",
    )
    ax.legend(handles=[grey, traced_box], fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
