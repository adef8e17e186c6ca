"""Notebook 17's view of a chaos run (``pgqueue.tools.chaos``): keep the run's rows before its
throwaway server goes away, trace every re-run to the fault behind it, and draw the run.

A re-run is a job attempt after the first: each one means an earlier attempt was lost. The
workload records every handler start (``chaos_runs``: job, fence, worker, time) and the
injector every fault (``chaos_faults``), both in database time, so the two can be lined up.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..tools.chaos import Config, Report
from ..tools.chaos.checks import fault_costs
from ..tools.chaos.run import _Run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Per fault kind: colour, and how the figure marks it.
COLORS = {"kill": "black", "stop": "tab:blue", "terminate": "tab:orange", "restart": "tab:purple"}
UNSTARTED = "claimed, lost before its handler started"


@dataclass
class ChaosRun:
    """A chaos run's report, what it said while running, and its rows."""

    report: Report
    lines: list[str]
    jobs: pd.DataFrame  # id, status, attempts, max_attempts, fence
    runs: pd.DataFrame  # job_id, fence, worker, started_at: one row per handler start
    faults: pd.DataFrame  # kind, worker, at, detail: one row per injected fault
    results: pd.DataFrame  # job_id, worker, fence, history: the fenced result rows
    reruns: pd.DataFrame = field(default_factory=pd.DataFrame)  # see ``trace``
    refused: pd.DataFrame = field(default_factory=pd.DataFrame)  # see ``refused_writes``


class _KeepRows(_Run):
    """The chaos run, keeping its rows before cleanup stops its throwaway server."""

    rows: dict[str, list[tuple[Any, ...]]]
    refused: pd.DataFrame

    def cleanup(self) -> None:
        self.rows = {}
        with contextlib.suppress(Exception):  # a run that failed early has nothing to keep
            for name, query in _QUERIES.items():
                self.rows[name] = self.session.sql(query, [self.queue])
        self.refused = refused_writes(self.log_dir)
        super().cleanup()


# What the engine logs when the database refuses a stale holder's write (engine._log_end).
_REFUSED = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) \S+ (?P<lane>\S+): "
    r"late (?P<action>\w+) of job (?P<job_id>\d+) refused: fence (?P<fence>\d+) is stale"
)


def refused_writes(log_dir: Path | None) -> pd.DataFrame:
    """The late writes the database refused, as the worker processes logged them: one row
    per refusal with ``at`` (the worker's clock, on the server's machine), ``worker`` (the
    log file's name), ``job_id``, ``fence`` (the stale one it carried) and ``action``."""
    rows = []
    for path in sorted(log_dir.glob("*.log")) if log_dir is not None else []:
        for line in path.read_text(errors="replace").splitlines():
            found = _REFUSED.match(line)
            if found:
                at = datetime.strptime(found["at"], "%Y-%m-%d %H:%M:%S,%f").astimezone()
                rows.append(
                    (pd.Timestamp(at), path.stem, int(found["job_id"]), int(found["fence"]),
                     found["action"])
                )  # fmt: skip
    return pd.DataFrame(rows, columns=["at", "worker", "job_id", "fence", "action"])


_COLUMNS = {
    "jobs": ["id", "status", "attempts", "max_attempts", "fence"],
    "runs": ["job_id", "fence", "worker", "started_at"],
    "faults": ["kind", "worker", "at", "detail"],
    "results": ["job_id", "worker", "fence", "history"],
}
_QUERIES = {
    "jobs": "SELECT id, status, attempts, max_attempts, fence FROM jobs WHERE queue = %s "
    "ORDER BY id",
    "runs": "SELECT r.job_id, r.fence, r.worker, r.started_at FROM chaos_runs r "
    "JOIN jobs j ON j.id = r.job_id WHERE j.queue = %s ORDER BY r.started_at",
    "faults": "SELECT kind, worker, at, detail FROM chaos_faults WHERE run = %s ORDER BY at",
    "results": "SELECT c.job_id, c.worker, c.fence, c.history FROM chaos_results c "
    "JOIN jobs j ON j.id = c.job_id WHERE j.queue = %s ORDER BY c.job_id",
}


def run_chaos(config: Config, say: Callable[[str], None] | None = None) -> ChaosRun:
    """Run ``pgqueue chaos`` in-process with ``config``; return its report, its lines and
    its rows, with every re-run traced (``trace``)."""
    config.validate()
    lines: list[str] = []

    def hear(line: str) -> None:
        lines.append(line)
        if say is not None:
            say(line)

    chaos = _KeepRows(config, hear)
    report = chaos.run()
    frames = {
        name: pd.DataFrame(chaos.rows.get(name, []), columns=columns)
        for name, columns in _COLUMNS.items()
    }
    result = ChaosRun(report, lines, **frames)
    result.reruns = trace(result.jobs, result.runs, result.faults)
    result.refused = chaos.refused
    return result


def trace(jobs: pd.DataFrame, runs: pd.DataFrame, faults: pd.DataFrame) -> pd.DataFrame:
    """One row per lost attempt, with the fault behind it (the rule of the chaos checks,
    ``pgqueue.tools.chaos.checks.attribute``).

    A job's handler starts, in order: every start of a dead job, and every start but the
    last of a done job (that one finished it), is a lost attempt, and the next start re-ran
    it. Its cause is the first fault, from a second before the lost start to the re-run,
    that hit the worker running it, or a server restart. Lost attempts beyond those starts
    were claims cut before their handler started: traced to the latest fault before the
    job's last start.
    """
    rows: list[dict[str, Any]] = []
    fault_list = list(faults.itertuples(index=False))
    by_job = {job_id: part.sort_values("started_at") for job_id, part in runs.groupby("job_id")}
    for job in jobs.itertuples(index=False):
        starts = list(by_job.get(job.id, runs.iloc[0:0]).itertuples(index=False))
        lost = job.attempts - (1 if job.status == "done" else 0)
        lost_starts = (starts if job.status != "done" else starts[:-1])[:lost]
        for n, run in enumerate(lost_starts):
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
        for _ in range(lost - len(lost_starts)):  # claims that never reached the handler
            after = starts[-1] if starts else None
            until = after.started_at if after is not None else None
            cause = next((f for f in reversed(fault_list) if until is None or f.at <= until), None)
            rows.append(_row(job.id, None, after, cause))
    columns = [
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
    return pd.DataFrame(rows, columns=columns)


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


def causes(reruns: pd.DataFrame) -> Counter[str]:
    """Lost attempts by the kind of fault traced to them."""
    return Counter(reruns["cause"])


def _slot(worker: object) -> int | None:
    """``chaos-2.3`` (slot 2, third process in it) -> 2."""
    if not isinstance(worker, str) or not worker.startswith("chaos-"):
        return None
    return int(worker.removeprefix("chaos-").split(".")[0])


def plot_run(run: ChaosRun, *, title: str = "") -> Figure:
    """The run on a time line: one lane per worker slot, a tick per handler start, the
    faults where they struck (kills, stops, cut sessions, the server restart), and an arrow
    from each lost attempt to its re-run, coloured by the fault it is traced to."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    report = run.report
    t0 = run.runs["started_at"].min()

    def s(at: Any) -> float:
        return (at - t0).total_seconds()

    rerun_jobs = sorted({*run.reruns.get("job_id", []), *run.refused.get("job_id", [])})
    fig, (ax, below) = plt.subplots(
        2,
        1,
        figsize=(12, 2.6 + 0.9 * report.workers + 0.42 * len(rerun_jobs)),
        sharex=True,
        gridspec_kw={"height_ratios": [0.9 * report.workers + 0.6, 0.42 * len(rerun_jobs) + 0.6]},
    )
    lanes = range(report.workers)
    starts = run.runs.assign(slot=run.runs["worker"].map(_slot), t=run.runs["started_at"].map(s))
    ax.scatter(starts["t"], starts["slot"], marker="|", s=70, color="0.6", linewidths=1)
    end = float(starts["t"].max()) if len(starts) else 1.0
    used: set[str] = set()
    for fault in run.faults.itertuples(index=False):
        t, slot = s(fault.at), _slot(fault.worker)
        used.add(fault.kind)
        color = COLORS.get(fault.kind, "red")
        if fault.kind == "restart":
            ax.axvline(t, color=color, ls="--", lw=1.5)
            ax.text(t, -0.62, " server restart", color=color, fontsize=8, va="bottom")
        elif fault.kind == "stop" and slot is not None:
            hold = float(str(fault.detail).removesuffix("s") or 0)
            ax.broken_barh([(t, hold)], (slot - 0.35, 0.7), color=color, alpha=0.18)
            ax.text(
                t + hold / 2,
                slot - 0.38,
                f"stopped {hold:.1f} s",
                ha="center",
                va="bottom",
                fontsize=8,
                color=color,
            )
        elif fault.kind == "kill" and slot is not None:
            ax.scatter([t], [slot], marker="*", s=260, color=color, zorder=4)
        elif fault.kind == "terminate" and slot is not None:
            ax.scatter([t], [slot], marker="X", s=140, color=color, zorder=4)
        end = max(end, t)
    for rerun in run.reruns.itertuples(index=False):
        if rerun.rerun_at is None or pd.isna(rerun.rerun_at):
            continue
        color = COLORS.get(rerun.cause, "red")
        to = (s(rerun.rerun_at), _slot(rerun.rerun_worker))
        if rerun.lost_at is None or pd.isna(rerun.lost_at):
            ax.scatter([to[0]], [to[1]], marker="o", s=50, facecolor="none", edgecolor=color)
            continue
        start = (s(rerun.lost_at), _slot(rerun.lost_worker))
        ax.annotate(
            "",
            xy=to,
            xytext=start,
            arrowprops={
                "arrowstyle": "->",
                "color": color,
                "lw": 1.4,
                "connectionstyle": "arc3,rad=0.08",
            },
        )
        ax.scatter([start[0]], [start[1]], marker="o", s=28, color=color, zorder=3)
    ax.set_yticks(list(lanes), [f"worker slot {i}" for i in lanes])
    ax.set_ylim(report.workers - 0.5, -0.75)
    ax.set_xlim(-0.5, end + 1.0)
    ax.set_ylabel("worker process")
    ax.set_title(title or f"chaos run, seed {report.seed}: faults and the re-runs they caused")
    ax.grid(axis="x", alpha=0.3)
    handles: list[Any] = [
        Line2D([], [], ls="", marker="|", color="0.6", markersize=9, label="a handler starts"),
    ]
    marks = {
        "kill": Line2D(
            [],
            [],
            ls="",
            marker="*",
            color="black",
            markersize=12,
            label="SIGKILL (a new process takes the slot)",
        ),
        "stop": Patch(color=COLORS["stop"], alpha=0.18, label="SIGSTOP past the lease"),
        "terminate": Line2D(
            [],
            [],
            ls="",
            marker="X",
            color=COLORS["terminate"],
            markersize=9,
            label="sessions cut (pg_terminate_backend)",
        ),
        "restart": Line2D([], [], ls="--", color=COLORS["restart"], label="server restart"),
    }
    handles += [marks[k] for k in COLORS if k in used]
    for kind in COLORS:
        if kind in set(run.reruns["cause"]):
            handles.append(
                Line2D(
                    [],
                    [],
                    color=COLORS[kind],
                    marker="o",
                    markersize=4,
                    label=f"lost attempt -> re-run ({kind})",
                )
            )
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )
    _draw_fences(below, run, rerun_jobs, s)
    below.set_xlabel("time since the first job started (s)")
    fig.tight_layout()
    return fig


def _draw_fences(ax: Any, run: ChaosRun, jobs: list[int], s: Callable[[Any], float]) -> None:
    """One lane per job that ran more than once (or had a write refused): the fence each
    attempt held as a step that rises at the attempt's start (a grey tick), and each late
    write the database refused, at the stale fence it carried (a red cross)."""
    from matplotlib.lines import Line2D

    starts = run.runs[run.runs["job_id"].isin(jobs)]
    refused = run.refused[run.refused["job_id"].isin(jobs)] if len(run.refused) else run.refused
    fences = [*starts["fence"], *(refused["fence"] if len(refused) else [])]
    top = max([1, *(int(f) for f in fences)])
    end = ax.get_xlim()[1]
    y = {job: len(jobs) - 1 - i for i, job in enumerate(jobs)}

    def level(job: int, fence: int) -> float:
        return y[job] - 0.32 + 0.64 * fence / top

    for job in jobs:
        mine = starts[starts["job_id"] == job].sort_values("started_at")
        if not len(mine):
            continue
        xs = [s(at) for at in mine["started_at"]]
        levels = [level(job, int(f)) for f in mine["fence"]]
        ax.step([*xs, end], [*levels, levels[-1]], where="post", color="0.25", linewidth=1.8)
        ax.fill_between(
            [*xs, end], y[job] - 0.32, [*levels, levels[-1]], step="post", color="0.3", alpha=0.1
        )
        ax.scatter(xs, levels, marker="|", s=70, color="0.4", zorder=3)
        ax.axhline(y[job] - 0.5, color="0.88", linewidth=0.8, zorder=0)
    for row in refused.itertuples(index=False) if len(refused) else []:
        ax.scatter(
            [s(row.at)], [level(row.job_id, row.fence)], marker="X", s=110, color="red", zorder=4
        )
    ax.set_yticks([y[j] for j in jobs], [f"job #{j}" for j in jobs])
    ax.set_ylim(-0.55, max(len(jobs), 1) - 0.45)
    ax.set_ylabel("jobs run twice")
    ax.grid(axis="x", alpha=0.3)
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    shown = range(1, top + 1) if top <= 4 else (1, top)
    right.set_yticks(
        [level(j, f) for j in jobs for f in shown], [str(f) for _ in jobs for f in shown]
    )
    right.tick_params(labelsize=6.5, length=2, pad=1)
    right.set_ylabel("fence", fontsize=9)
    handles = [
        Line2D([], [], color="0.25", linewidth=1.8, label="fence of each attempt (step)"),
        Line2D([], [], ls="", marker="|", color="0.4", markersize=9, label="the attempt starts"),
        Line2D([], [], ls="", marker="X", color="red", markersize=9,
               label="late write refused (stale fence)"),
    ]  # fmt: skip
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.03, 1.0), fontsize=8, frameon=False
    )


def explained(report: Report) -> dict[str, int]:
    """Per fault kind, the most extra attempts the chaos checks let its injections explain."""
    f = report.faults
    cost = fault_costs(report.workers)
    return {k: f[k] * cost[k] for k in cost if f[k] or k != "restart" or report.restart_enabled}
