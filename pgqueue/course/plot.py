"""Figures for the course: per-worker timelines of claims, leases and fences, and
throughput curves, drawn with matplotlib from an ``EventLog`` (or its DataFrame).

A timeline has one lane per worker and time in seconds on the x axis, like the
paused-client diagram in Kleppmann's "How to do distributed locking": you see who held
which job with which fence, when a worker froze, when the reaper took a job back, and
which late writes the database refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..events import EventLog

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["as_frame", "claims_per_worker", "throughput", "timeline"]

# What ends a worker's hold on a claimed job (rejected endings mean it had lost the job).
_ENDS = (
    "complete",
    "complete-rejected",
    "fail",
    "fail-rejected",
    "release",
    "release-rejected",
    "skipped",
)
_REJECTED = ("complete-rejected", "fail-rejected", "release-rejected", "fenced-write-rejected")

# kind -> (legend label, matplotlib marker style)
_MARKS: dict[str, tuple[str, dict[str, Any]]] = {
    "claim": ("claim (#job f=fence)", {"marker": ">", "color": "tab:blue", "s": 55}),
    "heartbeat": ("heartbeat", {"marker": "|", "color": "0.35", "s": 60}),
    "lease-lost": ("heartbeat: lease lost", {"marker": "d", "color": "tab:purple", "s": 55}),
    "complete": ("complete (accepted)", {"marker": "s", "color": "tab:green", "s": 45}),
    "fail": ("fail (retry later)", {"marker": "v", "color": "tab:orange", "s": 55}),
    "release": ("release (handed back)", {"marker": "<", "color": "0.5", "s": 45}),
    "fenced-write": ("fenced write (accepted)", {"marker": "D", "color": "tab:green", "s": 35}),
    "unfenced-write": (
        "write without fence (accepted!)",
        {"marker": "P", "color": "darkorange", "s": 70},
    ),
    "reap": ("reaper takes the job back", {"marker": "^", "color": "black", "s": 60}),
    "crash": ("crash", {"marker": "*", "color": "black", "s": 160}),
    "rejected": ("late write rejected (0 rows)", {"marker": "X", "color": "red", "s": 110}),
}


def as_frame(events: EventLog | pd.DataFrame) -> pd.DataFrame:
    """The events as a DataFrame with a seconds column ``s`` (from ``EventLog.to_frame``)."""
    if isinstance(events, EventLog):
        return events.to_frame()
    frame = events.copy()
    if "s" not in frame.columns:
        frame["s"] = frame["t"] - (frame["t"].min() if len(frame) else 0.0)
    return frame


def _lane_order(name: str) -> list[Any]:
    """Natural sort: A < B, w.2 < w.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _lanes_of(worker: str, lanes: list[str]) -> list[str]:
    """The lanes a worker-level event (pause, crash) belongs to: ``A`` or ``A.0``, ``A.1``..."""
    return [lane for lane in lanes if lane == worker or lane.startswith(worker + ".")]


def timeline(
    events: EventLog | pd.DataFrame,
    *,
    title: str = "Who held which job, and when",
    ax: Axes | None = None,
    lease: float | None = None,
    annotate: bool | None = None,
    legend: bool = True,
    lanes: Sequence[str] | None = None,
) -> Figure:
    """Draw one lane per worker over time and return the figure.

    Shows claims (annotated ``#job f=fence``), the time each job was held (a bar from
    claim to complete/fail/release; red when that ending was refused), heartbeats,
    shaded pauses, crashes, reaper returns, and rejected late writes as a red X.
    With ``lease`` (seconds), marks where each hold's lease ran out before the hold ended.
    ``annotate`` defaults to labelling claims only when there are few of them.
    ``lanes`` fixes which lanes to draw, in order (a worker that did nothing keeps its lane).
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    frame = as_frame(events)
    if ax is None:
        count = len(lanes) if lanes is not None else _count_lanes(frame)
        fig, ax = plt.subplots(figsize=(10, 1.4 + 0.75 * max(1, count)))
    else:
        fig = ax.figure
    job_kinds = set(_ENDS) | {"claim", "heartbeat", "lease-lost", "fenced-write"}
    job_kinds |= {"fenced-write-rejected", "unfenced-write", "lock-wait"}
    seen = set(frame.loc[frame["kind"].isin(job_kinds), "worker"])
    lanes = list(lanes) if lanes is not None else sorted(seen, key=_lane_order)
    # Worker-level events (pause, crash) and reaps are placed on lanes below.
    frame = frame[frame["worker"].isin(lanes) | frame["kind"].isin(["pause", "crash", "reap"])]
    reap_rows = frame[frame["kind"] == "reap"]
    end_s = float(frame["s"].max()) if len(frame) else 1.0
    y = {lane: i for i, lane in enumerate(lanes)}
    holder: dict[tuple[int, int], str] = {}  # (job id, fence) -> lane
    claims = frame[frame["kind"] == "claim"]
    for row in claims.itertuples():
        holder[(int(row.job_id), int(row.fence))] = row.worker
    if reap_rows.size and any(
        (int(r.job_id), int(r.fence)) not in holder for r in reap_rows.itertuples()
    ):
        lanes.append("reaper")  # a job reaped whose claim we did not see
        y["reaper"] = len(lanes) - 1
    if annotate is None:
        annotate = len(claims) <= 30
    used: set[str] = set()
    holds: dict[str, tuple[str, float, str]] = {}  # legend label -> bar style

    # Pauses: a shaded box over the worker's lanes, labelled with its length.
    for row in frame[frame["kind"] == "pause"].itertuples():
        seconds = float(row.detail or 0)
        for lane in _lanes_of(row.worker, lanes):
            ax.broken_barh([(row.s, seconds)], (y[lane] - 0.42, 0.84), color="0.8", alpha=0.6)
            ax.text(
                row.s + seconds / 2,
                y[lane] - 0.32,
                f"paused {seconds:g} s",
                ha="center",
                va="center",
                fontsize=8,
                color="0.25",
            )
        end_s = max(end_s, row.s + seconds)
        used.add("pause")

    # Lock waits (lab.race): the claim's select stood in line behind other workers' locks.
    for row in frame[frame["kind"] == "lock-wait"].itertuples():
        if row.worker in y:
            waited = float(row.detail or 0)
            ax.broken_barh(
                [(row.s - waited, waited)],
                (y[row.worker] - 0.14, 0.28),
                facecolor="none",
                edgecolor="tab:orange",
                hatch="....",
                linewidth=0,
            )
            used.add("lock-wait")

    # Claim transactions (lab.race): from the select's return to the commit of the claim.
    begins = frame[frame["kind"] == "claim-begin"]
    for row in claims.itertuples():
        mine = begins[(begins["worker"] == row.worker) & (begins["s"] <= row.s)]
        if len(mine):
            begun = float(mine["s"].iloc[-1])
            ax.broken_barh([(begun, row.s - begun)], (y[row.worker] - 0.06, 0.12), color="navy")
            used.add("claim-tx")

    # Holds: from the claim to whatever ended it.
    crashed = {
        lane for w in frame.loc[frame["kind"] == "crash", "worker"] for lane in _lanes_of(w, lanes)
    }
    for row in claims.itertuples():
        key = (int(row.job_id), int(row.fence))
        mine = frame[
            (frame["job_id"] == key[0]) & (frame["fence"] == key[1]) & (frame["s"] >= row.s)
        ]
        ends = mine[mine["kind"].isin(_ENDS) & (mine["worker"] == row.worker)]
        reaped = mine[mine["kind"] == "reap"]
        if len(ends):
            stop, kind = float(ends["s"].iloc[0]), ends["kind"].iloc[0]
            style = (
                ("held, then refused", "tab:red", 0.25, "")
                if kind in _REJECTED
                else ("holding a job", "tab:blue", 0.3, "")
            )
        elif row.worker in crashed or len(reaped):
            stop = float(reaped["s"].iloc[0]) if len(reaped) else end_s
            style = ("lease held by a stopped worker", "0.55", 0.35, "///")
        else:
            stop, style = end_s, ("holding a job", "tab:blue", 0.3, "")
        label, color, alpha, hatch = style
        ax.broken_barh(
            [(row.s, max(stop - row.s, 1e-3))],
            (y[row.worker] - 0.14, 0.28),
            facecolor=color,
            alpha=alpha,
            hatch=hatch,
            edgecolor=color if hatch else "none",
        )
        holds.setdefault(label, (color, alpha, hatch))
        if lease is not None:
            renewals = mine[
                mine["kind"].isin(["claim", "heartbeat"]) & (mine["worker"] == row.worker)
            ]
            expiry = float(renewals["s"].max()) + lease
            if expiry < stop - 1e-3 or (not len(ends) and expiry <= end_s):
                ax.plot(
                    [expiry, expiry],
                    [y[row.worker] - 0.22, y[row.worker] + 0.22],
                    color="tab:red",
                    linestyle=":",
                    linewidth=2,
                )
                used.add("expiry")
        if annotate:
            ax.annotate(
                f"#{key[0]} f={key[1]}",
                (row.s, y[row.worker]),
                xytext=(2, 9),
                textcoords="offset points",
                fontsize=8,
                color="tab:blue",
            )

    # Point events. Labels of writes that land at about the same moment are stacked.
    labelled: dict[str, list[float]] = {}
    for kind, (_, style) in _MARKS.items():
        if kind == "rejected":
            rows = frame[frame["kind"].isin(_REJECTED)]
        elif kind == "reap":
            rows = reap_rows
        elif kind == "crash":
            rows = frame[frame["kind"] == "crash"]
        else:
            rows = frame[(frame["kind"] == kind) & frame["worker"].isin(lanes)]
        xs: list[float] = []
        ys: list[float] = []
        for row in rows.itertuples():
            if kind == "reap":
                lane = holder.get((int(row.job_id), int(row.fence)), "reaper")
                targets = [lane]
            elif kind == "crash":
                targets = _lanes_of(row.worker, lanes)
            else:
                targets = [row.worker]
            for lane in targets:
                xs.append(row.s)
                ys.append(y[lane])
                if kind in ("rejected", "unfenced-write") and len(rows) <= 12:
                    near = [
                        t for t in labelled.setdefault(lane, []) if abs(t - row.s) < 0.25 * end_s
                    ]
                    labelled[lane].append(row.s)
                    what = row.kind.removesuffix("-rejected").replace("fenced-write", "write")
                    text = f"{what} f={int(row.fence)} rejected"
                    if kind == "unfenced-write":
                        text = f"write f={int(row.fence)} accepted, unchecked"
                    ax.annotate(
                        text,
                        (row.s, y[lane]),
                        xytext=(6, 8 if not near else -6 - 10 * len(near)),
                        textcoords="offset points",
                        fontsize=8,
                        color=style["color"],
                    )
                elif kind == "reap" and annotate:
                    ax.annotate(
                        f"#{int(row.job_id)} back",
                        (row.s, y[lane]),
                        xytext=(-4, -16),
                        textcoords="offset points",
                        fontsize=8,
                    )
        if xs:
            ax.scatter(
                xs, ys, zorder=3, linewidths=1.5 if style["marker"] == "|" else None, **style
            )
            used.add(kind)

    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.6)  # first worker on top
    ax.set_xlim(
        left=min(0.0, float(frame["s"].min()) if len(frame) else 0.0), right=end_s * 1.25 + 0.05
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("worker")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    if legend:
        handles: list[Any] = []
        for label, (color, alpha, hatch) in holds.items():
            handles.append(
                Patch(
                    facecolor=color,
                    alpha=alpha,
                    hatch=hatch,
                    edgecolor=color if hatch else "none",
                    label=label,
                )
            )
        if "pause" in used:
            handles.append(Patch(facecolor="0.8", alpha=0.6, label="worker paused"))
        if "claim-tx" in used:
            handles.append(Patch(facecolor="navy", label="claim transaction open"))
        if "lock-wait" in used:
            handles.append(
                Patch(
                    facecolor="none",
                    edgecolor="tab:orange",
                    hatch="....",
                    linewidth=0,
                    label="waiting for a row lock",
                )
            )
        if "expiry" in used:
            handles.append(
                Line2D([], [], color="tab:red", linestyle=":", linewidth=2, label="lease runs out")
            )
        for kind, (label, style) in _MARKS.items():
            if kind in used:
                handles.append(
                    Line2D(
                        [],
                        [],
                        linestyle="",
                        marker=style["marker"],
                        color=style["color"],
                        markersize=8,
                        label=label,
                    )
                )
        ax.legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
        )
    fig.tight_layout()
    return fig


def _count_lanes(frame: pd.DataFrame) -> int:
    return frame.loc[frame["kind"] != "reap", "worker"].nunique()


def claims_per_worker(
    events: EventLog | pd.DataFrame,
    *,
    title: str = "Jobs claimed per worker",
    ax: Axes | None = None,
) -> Figure:
    """Bar chart of how many claims each worker lane made (a fair share looks flat)."""
    import matplotlib.pyplot as plt

    frame = as_frame(events)
    counts = frame[frame["kind"] == "claim"].groupby("worker").size()
    counts = counts.reindex(sorted(counts.index, key=_lane_order))
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3))
    else:
        fig = ax.figure
    ax.bar(counts.index, counts.values, color="tab:blue", label="claims")
    ax.set_xlabel("worker")
    ax.set_ylabel("jobs claimed (count)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def throughput(
    runs: Mapping[str, EventLog | pd.DataFrame],
    *,
    kinds: Iterable[str] = ("complete",),
    title: str = "Jobs finished over time",
    ax: Axes | None = None,
) -> Figure:
    """Cumulative count of ``kinds`` events over time, one line per labelled run."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
    else:
        fig = ax.figure
    wanted = list(kinds)
    for label, events in runs.items():
        frame = as_frame(events)
        times = frame.loc[frame["kind"].isin(wanted), "s"].sort_values()
        ax.step([0.0, *times], range(len(times) + 1), where="post", label=label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("jobs finished (count)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
