"""What a chaos run left behind, for its lesson: the run's rows copied into a database of the
notebook's (so ``chaos_view.trace`` can be read in SQL), and the re-runs per fault kind drawn
against what the injected faults can explain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import pandas as pd
import psycopg

from ..tools.chaos import Report
from .chaos_view import COLORS, ChaosRun

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TABLES = (
    "CREATE TABLE chaos_runs (job_id bigint, fence bigint, worker text, started_at timestamptz)",
    "CREATE TABLE chaos_faults (kind text, worker text, at timestamptz, detail text)",
)


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
