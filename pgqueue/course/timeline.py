"""The course's timeline: one lane per worker, and what each held, when, with which fence."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..events import EventLog
from .labels import _Labels
from .plot_parts import (
    _ENDS,
    _MARKS,
    _lane_order,
    _lanes_of,
    _legend_handles,
    _mark_of,
    _Sheet,
    as_frame,
)
from .timeline_bars import _draw_claim_transactions, _draw_holds, _draw_lock_waits, _draw_pauses
from .timeline_storage import _draw_storage

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The kinds that give a worker a lane of its own (a pause or a crash goes on its worker's).
_LANE_KINDS = {*_ENDS, "claim", "heartbeat", "lease-lost", "fenced-write"} | {
    "fenced-write-rejected",
    "unfenced-write",
    "lock-wait",
}


def timeline(
    events: EventLog | pd.DataFrame,
    *,
    title: str = "Who held which job, and when",
    ax: Axes | None = None,
    lease: float | None = None,
    leases: pd.DataFrame | None = None,
    dead: Iterable[int] = (),
    storage: Mapping[str, pd.DataFrame] | None = None,
    annotate: bool | None = None,
    legend: bool = True,
    lanes: Sequence[str] | None = None,
    layout: bool = True,
) -> Figure:
    """Draw one lane per worker over time and return the figure.

    Shows claims (annotated ``#job f=fence``), the time each job was held (a bar from
    claim to complete/fail/release; red when that ending was refused), heartbeats,
    shaded pauses, crashes, reaper returns, jobs gone dead, and rejected late writes as a
    red X. Labels never overlap one another or run out of the axes.

    ``leases``: the database's lease deadlines (``job_id``, ``fence``, ``set_t``,
    ``until_t`` in ``time.time()`` seconds, e.g. from ``pgqueue.course.stories.leases``):
    a thin line under each hold shows its lease, and a red dotted line where it ran out
    before the hold ended. Without them, ``lease`` (seconds) estimates each deadline from
    the worker's last claim or heartbeat event, on the client's clock.
    ``dead``: ids of jobs that ended dead by a fail (their last fail is marked as such;
    a reap that sent a job dead is marked from the event itself).
    ``storage``: lanes for what the database stored, ``{label: frame}`` with columns ``t``
    (``time.time()`` seconds) and ``fence`` (e.g. ``stories.fences``): each change is
    labelled, and arrows show each write reaching it. The first storage lane receives the
    job's own writes (claim, complete, fail, release), the last the side-table writes.
    ``annotate`` defaults to labelling claims only when there are few of them.
    ``lanes`` fixes which lanes to draw, in order (a worker that did nothing keeps its lane).
    ``layout=False``: the caller has laid the figure out already (several timelines in one
    figure): no ``tight_layout`` here, which would move the axes of a timeline drawn before
    and with them its labels, placed for where the axes were.
    """
    frame = as_frame(events)
    origin = float((frame["t"] - frame["s"]).iloc[0]) if len(frame) else 0.0
    stores = dict(storage or {})
    fig, ax = _figure(ax, frame, lanes, len(stores))
    sheet = _sheet(ax, frame, lanes, stores, origin, annotate)
    _draw_pauses(sheet)
    _draw_lock_waits(sheet)
    _draw_claim_transactions(sheet)
    _draw_holds(sheet, _database_leases(leases, origin), lease)
    _draw_points(sheet, dead, label_rejections=not stores)
    left = min(0.0, float(sheet.frame["s"].min()) if len(sheet.frame) else 0.0)
    if stores:
        _draw_storage_lanes(sheet, stores, origin, left)
    _set_axes(sheet, title, left, stored=bool(stores))
    if legend:
        ax.legend(
            handles=_legend_handles(sheet.holds, sheet.used),
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=8,
            frameon=False,
        )
    if layout:
        fig.tight_layout()
    sheet.labels.place()
    return fig


def _figure(
    ax: Axes | None, frame: pd.DataFrame, lanes: Sequence[str] | None, stores: int
) -> tuple[Figure, Axes]:
    """The given axes and their figure, or a new figure tall enough for every lane."""
    import matplotlib.pyplot as plt

    if ax is None:
        count = len(lanes) if lanes is not None else _count_lanes(frame)
        fig, ax = plt.subplots(figsize=(10, 1.4 + 0.75 * max(1, count + stores)))
    else:
        fig = ax.figure
    return fig, ax


def _count_lanes(frame: pd.DataFrame) -> int:
    """How many workers did something other than reap (the height of a new figure)."""
    return frame.loc[frame["kind"] != "reap", "worker"].nunique()


def _sheet(
    ax: Axes,
    frame: pd.DataFrame,
    lanes: Sequence[str] | None,
    stores: Mapping[str, pd.DataFrame],
    origin: float,
    annotate: bool | None,
) -> _Sheet:
    """Lay out the lanes: the workers' (given, or every worker that touched a job, in
    natural order), a "reaper" lane if a job was reaped whose claim is not shown, then one
    per storage row; and find how far the time axis must run."""
    seen = set(frame.loc[frame["kind"].isin(_LANE_KINDS), "worker"])
    order = list(lanes) if lanes is not None else sorted(seen, key=_lane_order)
    # Worker-level events (pause, crash) and reaps are placed on lanes below.
    frame = frame[frame["worker"].isin(order) | frame["kind"].isin(["pause", "crash", "reap"])]
    claims = frame[frame["kind"] == "claim"]
    holder = {(int(row.job_id), int(row.fence)): row.worker for row in claims.itertuples()}
    reaps = frame[frame["kind"] == "reap"]
    if reaps.size and any((int(r.job_id), int(r.fence)) not in holder for r in reaps.itertuples()):
        order.append("reaper")  # a job reaped whose claim we did not see
    clients = len(order)
    order += list(stores)
    end_s = float(frame["s"].max()) if len(frame) else 1.0
    for store in stores.values():
        if len(store):
            end_s = max(end_s, float(store["t"].max() - origin))
    return _Sheet(
        ax=ax,
        frame=frame,
        claims=claims,
        lanes=order,
        y={lane: i for i, lane in enumerate(order)},
        clients=clients,
        holder=holder,
        end_s=end_s,
        annotate=len(claims) <= 30 if annotate is None else annotate,
        labels=_Labels(ax),
    )


def _database_leases(leases: pd.DataFrame | None, origin: float) -> pd.DataFrame | None:
    """The database's lease deadlines with seconds columns ``set_s`` and ``until_s``."""
    if leases is None or not len(leases):
        return None
    return leases.assign(set_s=leases["set_t"] - origin, until_s=leases["until_t"] - origin)


def _draw_points(sheet: _Sheet, dead: Iterable[int], *, label_rejections: bool) -> None:
    """Each point event under its mark (see ``_MARKS``), some labelled. ``dead``: ids of
    jobs whose last fail sent them dead. Rejections are labelled here only when no storage
    lane says it where the write lands (``label_rejections``)."""
    frame = sheet.frame
    dead_ids = {int(i) for i in dead}
    fails = frame[(frame["kind"] == "fail") & frame["job_id"].isin(dead_ids)]
    last_fail = {int(j): i for j, i in zip(fails["job_id"], fails.index, strict=True)}
    points: dict[str, tuple[list[float], list[float]]] = {}
    for row in frame.itertuples():
        what = _mark_of(row, last_fail)
        if what is None:
            continue
        for lane in _point_lanes(sheet, row):
            xs, ys = points.setdefault(what, ([], []))
            xs.append(row.s)
            ys.append(sheet.y[lane])
            _label_point(sheet, what, row, sheet.y[lane], label_rejections)
    for what, (xs, ys) in points.items():
        _draw_marks(sheet, what, xs, ys)


def _point_lanes(sheet: _Sheet, row: Any) -> list[str]:
    """The lanes an event is marked on: a reap on the lane that held the job (or the
    reaper's), a crash on each of its worker's lanes, anything else on its own lane."""
    if row.kind == "reap":
        return [sheet.holder.get((int(row.job_id), int(row.fence)), "reaper")]
    if row.kind == "crash":
        return _lanes_of(row.worker, sheet.workers)
    if row.kind == "pause" or row.worker not in sheet.y:
        return []
    return [row.worker]


def _label_point(sheet: _Sheet, what: str, row: Any, lane_y: int, label_rejections: bool) -> None:
    """The words beside a point that needs them: refused and unchecked writes, a job gone
    dead, a reap (when annotating), a handler's timeout."""
    add = sheet.labels.add
    if what == "rejected" and label_rejections:
        name = row.kind.removesuffix("-rejected").replace("fenced-write", "write")
        text = f"{name} f={int(row.fence)} rejected"
        add(row.s, lane_y, text, short="rejected", priority=0, color="red")
    elif what == "unfenced-write":
        text = f"write f={int(row.fence)} accepted, unchecked"
        add(row.s, lane_y, text, short="unchecked", priority=0, color="darkorange")
    elif what == "dead":
        # A job that died by its handler's timeout says so: the dead mark replaces the fail's.
        why = ": timed out" if str(row.detail or "").startswith("TimeoutError") else ""
        add(row.s, lane_y, f"#{int(row.job_id)} dead{why}", priority=1, side="below")
    elif what == "reap" and sheet.annotate:
        add(row.s, lane_y, f"#{int(row.job_id)} back", priority=1, side="below")
    elif what == "timeout":
        add(row.s, lane_y, "timed out", priority=1, side="below", color="tab:brown")


def _draw_marks(sheet: _Sheet, what: str, xs: list[float], ys: list[float]) -> None:
    """One kind of mark at every point it was put."""
    _, style = _MARKS[what]
    thick = what in ("heartbeat", "lease-ran-out")
    sheet.ax.scatter(xs, ys, zorder=3, linewidths=1.5 if thick else None, **style)
    for x, lane_y in zip(xs, ys, strict=True):
        sheet.labels.block_point(x, lane_y, style["s"] ** 0.5)
    sheet.used.add(what)


def _draw_storage_lanes(
    sheet: _Sheet, stores: Mapping[str, pd.DataFrame], origin: float, left: float
) -> None:
    """The storage lanes (see ``_draw_storage``), below a line under the workers' lanes."""
    storage_lanes = sheet.lanes[sheet.clients :]
    _draw_storage(
        sheet.ax,
        sheet.frame,
        stores,
        sheet.y,
        storage_lanes,
        origin,
        left,
        sheet.end_s,
        sheet.labels,
    )
    sheet.ax.axhline(sheet.clients - 0.5, color="0.6", linewidth=0.8)
    sheet.used.add("storage")


def _set_axes(sheet: _Sheet, title: str, left: float, *, stored: bool) -> None:
    """Ticks, limits (the first worker on top, room on the right for labels), the words."""
    ax = sheet.ax
    ax.set_yticks(range(len(sheet.lanes)), sheet.lanes)
    ax.set_ylim(len(sheet.lanes) - 0.5, -0.6)  # first worker on top
    ax.set_xlim(left=left, right=sheet.end_s * (1.25 if stored else 1.12) + 0.05)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("worker" if not stored else "worker / database")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
