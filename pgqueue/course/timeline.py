"""The course's timeline: one lane per worker, and what each held, when, with which fence."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..events import EventLog
from .labels import _BAR, _Labels
from .plot_parts import (
    _ENDS,
    _LOCAL_EXPIRY,
    _MARKS,
    _REJECTED,
    _draw_storage,
    _lane_order,
    _lanes_of,
    as_frame,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    frame = as_frame(events)
    origin = float((frame["t"] - frame["s"]).iloc[0]) if len(frame) else 0.0
    stores = dict(storage or {})
    if ax is None:
        count = len(lanes) if lanes is not None else _count_lanes(frame)
        fig, ax = plt.subplots(figsize=(10, 1.4 + 0.75 * max(1, count + len(stores))))
    else:
        fig = ax.figure
    labels = _Labels(ax)
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
    clients = len(lanes)
    for label in stores:
        lanes.append(label)
        y[label] = len(lanes) - 1
    if annotate is None:
        annotate = len(claims) <= 30
    used: set[str] = set()
    holds: dict[str, tuple[str, float, str]] = {}  # legend label -> bar style
    db = None
    if leases is not None and len(leases):
        db = leases.assign(set_s=leases["set_t"] - origin, until_s=leases["until_t"] - origin)
    for store in stores.values():
        if len(store):
            end_s = max(end_s, float(store["t"].max() - origin))

    # Pauses: a shaded box over the worker's lanes, labelled with its length.
    for row in frame[frame["kind"] == "pause"].itertuples():
        seconds = float(row.detail or 0)
        for lane in _lanes_of(row.worker, lanes[:clients]):
            ax.broken_barh([(row.s, seconds)], (y[lane] - 0.42, 0.84), color="0.8", alpha=0.6)
            labels.keep(
                ax.text(
                    row.s + seconds / 2,
                    y[lane] - 0.35,
                    f"paused {seconds:g} s",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="0.25",
                )
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
            labels.block(row.s - waited, row.s, y[row.worker] - _BAR, y[row.worker] + _BAR)
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
        lane
        for w in frame.loc[frame["kind"] == "crash", "worker"]
        for lane in _lanes_of(w, lanes[:clients])
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
        lane_y = y[row.worker]
        ax.broken_barh(
            [(row.s, max(stop - row.s, 1e-3))],
            (lane_y - _BAR, 2 * _BAR),
            facecolor=color,
            alpha=alpha,
            hatch=hatch,
            edgecolor=color if hatch else "none",
        )
        labels.block(row.s, stop, lane_y - _BAR, lane_y + _BAR)
        holds.setdefault(label, (color, alpha, hatch))
        expiry = None
        if db is not None:
            held = db[(db["job_id"] == key[0]) & (db["fence"] == key[1])]
            if len(held):
                first, expiry = float(held["set_s"].min()), float(held["until_s"].max())
                band_end = min(expiry, stop)
                ax.plot(
                    [first, band_end],
                    [lane_y + 0.22, lane_y + 0.22],
                    color="tab:red",
                    alpha=0.5,
                    linewidth=1.5,
                    solid_capstyle="butt",
                )
                labels.block(first, band_end, lane_y + 0.19, lane_y + 0.25)
                used.add("lease-band")
        elif lease is not None:
            renewals = mine[
                mine["kind"].isin(["claim", "heartbeat"]) & (mine["worker"] == row.worker)
            ]
            expiry = float(renewals["s"].max()) + lease
        if expiry is not None and (expiry < stop - 1e-3 or (not len(ends) and expiry <= end_s)):
            ax.plot(
                [expiry, expiry],
                [lane_y - 0.24, lane_y + 0.24],
                color="tab:red",
                linestyle=":",
                linewidth=2,
            )
            labels.block_vline(expiry, lane_y - 0.24, lane_y + 0.24)
            used.add("expiry")
        if annotate:
            labels.add(row.s, lane_y, f"#{key[0]} f={key[1]}", short=f"#{key[0]}", color="tab:blue")

    # Point events, each under its mark.
    dead_ids = {int(i) for i in dead}
    fails = frame[(frame["kind"] == "fail") & frame["job_id"].isin(dead_ids)]
    last_fail = {int(j): i for j, i in zip(fails["job_id"], fails.index, strict=True)}

    def mark(row: Any) -> str | None:
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

    points: dict[str, tuple[list[float], list[float]]] = {}
    for row in frame.itertuples():
        what = mark(row)
        if what is None:
            continue
        if row.kind == "reap":
            targets = [holder.get((int(row.job_id), int(row.fence)), "reaper")]
        elif row.kind == "crash":
            targets = _lanes_of(row.worker, lanes[:clients])
        elif row.kind == "pause" or row.worker not in y:
            continue
        else:
            targets = [row.worker]
        for lane in targets:
            xs, ys = points.setdefault(what, ([], []))
            xs.append(row.s)
            ys.append(y[lane])
            if what == "rejected" and not stores:  # storage lanes say it where it lands
                name = row.kind.removesuffix("-rejected").replace("fenced-write", "write")
                labels.add(
                    row.s,
                    y[lane],
                    f"{name} f={int(row.fence)} rejected",
                    short="rejected",
                    priority=0,
                    color="red",
                )
            elif what == "unfenced-write":
                labels.add(
                    row.s,
                    y[lane],
                    f"write f={int(row.fence)} accepted, unchecked",
                    short="unchecked",
                    priority=0,
                    color="darkorange",
                )
            elif what == "dead":
                labels.add(row.s, y[lane], f"#{int(row.job_id)} dead", priority=1, side="below")
            elif what == "reap" and annotate:
                labels.add(row.s, y[lane], f"#{int(row.job_id)} back", priority=1, side="below")
            elif what == "timeout":
                labels.add(row.s, y[lane], "timed out", priority=1, side="below", color="tab:brown")
    for what, (xs, ys) in points.items():
        _, style = _MARKS[what]
        ax.scatter(
            xs,
            ys,
            zorder=3,
            linewidths=1.5 if what in ("heartbeat", "lease-ran-out") else None,
            **style,
        )
        for x, lane_y in zip(xs, ys, strict=True):
            labels.block_point(x, lane_y, style["s"] ** 0.5)
        used.add(what)

    # Storage lanes: the fence the database holds, and the writes that reach it.
    left = min(0.0, float(frame["s"].min()) if len(frame) else 0.0)
    if stores:
        _draw_storage(ax, frame, stores, y, lanes[clients:], origin, left, end_s, labels)
        ax.axhline(clients - 0.5, color="0.6", linewidth=0.8)
        used.add("storage")

    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.6)  # first worker on top
    ax.set_xlim(left=left, right=end_s * (1.25 if stores else 1.12) + 0.05)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("worker" if not stores else "worker / database")
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
                        label=label,
                    )
                )
        if "storage" in used:
            handles += [
                Line2D(
                    [], [], color="0.45", linewidth=5, alpha=0.35, label="fence stored in the row"
                ),
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
        ax.legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
        )
    fig.tight_layout()
    labels.place()
    return fig


def _count_lanes(frame: pd.DataFrame) -> int:
    return frame.loc[frame["kind"] != "reap", "worker"].nunique()
