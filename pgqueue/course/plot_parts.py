"""The timelines' vocabulary: event kinds, their marks and legend, and the sheet drawn on."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..events import EventLog
from .labels import _Labels

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

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
# Which storage lane a write goes to (``storage=``): the job's own row, or a side table.
_JOB_WRITES = ("claim", *(k for k in _ENDS if k != "skipped"))
_SIDE_WRITES = ("fenced-write", "fenced-write-rejected", "unfenced-write")
# The worker's keeper records this detail when a lease ran out on its own clock.
_LOCAL_EXPIRY = "lease ran out here"

# mark -> (legend label, matplotlib scatter style). Marks are event kinds, except
# "lease-ran-out" (a local expiry), "timeout" (a fail by timeout), "dead" (a fail or reap
# that sent the job dead) and "rejected" (any refused write).
_MARKS: dict[str, tuple[str, dict[str, Any]]] = {
    "claim": ("claim (#job f=fence)", {"marker": ">", "color": "tab:blue", "s": 55}),
    "heartbeat": ("heartbeat", {"marker": "|", "color": "0.35", "s": 60}),
    "lease-lost": (
        "heartbeat refused: lease lost",
        {"marker": "d", "color": "tab:purple", "s": 55},
    ),
    "lease-ran-out": (
        "lease ran out on the worker's clock",
        {"marker": "d", "facecolors": "none", "edgecolors": "tab:purple", "s": 55},
    ),
    "complete": ("complete (accepted)", {"marker": "s", "color": "tab:green", "s": 45}),
    "fail": ("fail (retry later)", {"marker": "v", "color": "tab:orange", "s": 55}),
    "timeout": ("fail: handler timed out", {"marker": "v", "color": "tab:brown", "s": 65}),
    "release": ("release (handed back)", {"marker": "<", "color": "0.5", "s": 45}),
    "fenced-write": ("fenced write (accepted)", {"marker": "D", "color": "tab:green", "s": 35}),
    "unfenced-write": (
        "write without fence (accepted!)",
        {"marker": "P", "color": "darkorange", "s": 70},
    ),
    "reap": ("reaper takes the job back", {"marker": "^", "color": "black", "s": 60}),
    "dead": ("job dead (not retried)", {"marker": "$\\dagger$", "color": "black", "s": 200}),
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
    """The lanes a worker-level event (pause, crash) belongs to: ``A`` or ``A.1``, ``A.2``..."""
    return [lane for lane in lanes if lane == worker or lane.startswith(worker + ".")]


def _mark_of(row: Any, last_fail: Mapping[int, Any]) -> str | None:
    """The mark (a key of ``_MARKS``) for an event, or None for an event drawn otherwise.
    ``last_fail``: job id -> the index of its last fail, for jobs that died by failing."""
    kind, detail = row.kind, str(row.detail or "")
    if kind in _REJECTED:
        return "rejected"
    if kind == "lease-lost":
        return "lease-ran-out" if detail == _LOCAL_EXPIRY else "lease-lost"
    if kind == "fail":
        if last_fail.get(int(row.job_id)) == row.Index:
            return "dead"
        return "timeout" if detail.startswith("TimeoutError") else "fail"
    if kind == "reap":
        return "dead" if detail == "dead" else "reap"
    return kind if kind in _MARKS else None


@dataclass
class _Sheet:
    """What the drawing steps share: the axes, the events, the lanes, what was drawn."""

    ax: Axes
    frame: pd.DataFrame  # the events drawn: the lanes' own, and every pause, crash and reap
    claims: pd.DataFrame  # the claim events among them
    lanes: list[str]  # the workers' lanes (then "reaper" if needed), then the storage lanes
    y: dict[str, int]  # lane -> its row on the y axis
    clients: int  # how many of the lanes are not storage lanes
    holder: dict[tuple[int, int], str]  # (job id, fence) -> the lane that claimed it
    end_s: float  # the last moment to draw, in seconds
    annotate: bool  # label every claim with its #job f=fence
    labels: _Labels
    used: set[str] = field(default_factory=set)  # what the legend explains
    holds: dict[str, tuple[str, float, str]] = field(default_factory=dict)  # label -> style

    @property
    def workers(self) -> list[str]:
        """The lanes that are not storage lanes."""
        return self.lanes[: self.clients]


def _legend_handles(holds: Mapping[str, tuple[str, float, str]], used: set[str]) -> list[Any]:
    """The legend's entries for what was drawn: hold bars, shadings, lease lines, marks,
    and the storage lanes' fences and arrows."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

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
    if "lease-band" in used:
        handles.append(
            Line2D(
                [],
                [],
                color="tab:red",
                alpha=0.5,
                linewidth=1.5,
                label="lease (lease_until, from the database)",
            )
        )
    if "expiry" in used:
        handles.append(
            Line2D([], [], color="tab:red", linestyle=":", linewidth=2, label="lease runs out")
        )
    for kind, (label, style) in _MARKS.items():
        if kind in used:
            hollow = style.get("facecolors") == "none"
            color = style.get("edgecolors") if hollow else style["color"]
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="",
                    marker=style["marker"],
                    color=color,
                    markerfacecolor="none" if hollow else color,
                    markersize=8 if kind != "dead" else 11,
                    label=label if kind != "claim" or "claim-labels" in used else "claim",
                )
            )
    if "storage" in used:
        handles += [
            Line2D([], [], color="0.45", linewidth=5, alpha=0.35, label="fence stored in the row"),
            Line2D(
                [],
                [],
                color="tab:blue",
                marker=">",
                markersize=6,
                label="claim: new fence handed out",
            ),
            Line2D(
                [],
                [],
                color="tab:green",
                marker=">",
                markersize=6,
                label="write with the current fence",
            ),
            Line2D(
                [],
                [],
                color="red",
                marker=">",
                markersize=6,
                label="write with an old fence: refused",
            ),
        ]
    return handles
