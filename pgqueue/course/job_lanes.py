"""Every job's life in one picture, from a live run: one lane per job, time left to right.

In a job's lane, from top to bottom: each claim of it as a bar in the colour of the worker
that held it (hatched while that worker was frozen), the lease the database gave that claim
as a line under it (red and dotted where the lease ran out while the worker still held on),
the reaper handing the job back, the late writes the database refused, and at the bottom
the fence stored in the job's row as a step that rises at every claim.

``record`` reads what the database stored during a run (``stories.watch`` must have been
installed before it) beside the workers' ``EventLog``; ``draw`` draws it, or only what had
happened by a moment (``upto``: leases still running show the part left); ``scrub`` puts a
slider and a play button on ``draw``. Teaching aids, not the queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..events import EventLog
from . import stories
from .plot_parts import _ENDS, _REJECTED, _lane_order

if TYPE_CHECKING:
    import pandas as pd
    import psycopg
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Hold", "Lives", "draw", "holds", "record", "scrub"]

# Worker colours: none of them green, red, orange or black, which the marks use.
_PALETTE = ("tab:blue", "tab:purple", "tab:olive", "tab:cyan", "tab:brown", "tab:pink", "0.55")


class Lives(NamedTuple):
    """One run: the workers' events and the job rows' changes, on one clock."""

    events: pd.DataFrame  # EventLog.to_frame(): s is seconds since ``origin``
    rows: pd.DataFrame  # job_id, s, fence, status, until_s: each change of a job's row
    origin: float  # time.time() of s = 0
    jobs: list[int]

    def fences(self, job_id: int) -> list[int]:
        """The fences the job's row held, in order (one entry per change of the fence)."""
        mine = self.rows[self.rows["job_id"] == job_id]["fence"].tolist()
        return [f for i, f in enumerate(mine) if i == 0 or f != mine[i - 1]]


class Hold(NamedTuple):
    """One claim of a job: from the moment the database took it (the row's ``now()``) to its
    worker's last word on it (``end_kind``: complete, complete-rejected, fail... or None
    while still held)."""

    job_id: int
    fence: int
    worker: str
    start: float
    end: float | None
    end_kind: str | None
    leases: tuple[tuple[float, float], ...]  # (set, until): each lease_until set for it

    def lease_at(self, s: float) -> float | None:
        """The lease deadline the database held for this claim at ``s`` seconds."""
        set_by = [until for at, until in self.leases if at <= s + 1e-3]
        return set_by[-1] if set_by else None


def record(conn: psycopg.Connection, log: EventLog, jobs: Sequence[int]) -> Lives:
    """What happened to ``jobs``: the events of ``log`` about them (and the workers'
    pauses), and every change of their rows as ``stories.watch`` logged it, stamped with
    the database's ``now()`` and moved onto this process's clock."""
    import pandas as pd

    offset = stories.clock_offset(conn)
    found = conn.execute(
        """
        SELECT (row->>'id')::bigint, extract(epoch FROM at)::float8, (row->>'fence')::int,
               row->>'status', extract(epoch FROM (row->>'lease_until')::timestamptz)::float8
        FROM watch_log
        WHERE tbl = 'jobs' AND (row->>'id')::bigint = ANY(%s)
        ORDER BY seq
        """,
        [list(jobs)],
    ).fetchall()
    origin = log.started
    rows = pd.DataFrame(found, columns=["job_id", "t", "fence", "status", "until_t"])
    rows["s"] = rows["t"] - offset - origin
    rows["until_s"] = rows["until_t"] - offset - origin
    events = log.to_frame()
    wanted = events["job_id"].isin(list(jobs)) | (events["kind"] == "pause")
    return Lives(
        events[wanted].reset_index(drop=True),
        rows[["job_id", "s", "fence", "status", "until_s"]],
        origin,
        list(jobs),
    )


def holds(lives: Lives) -> list[Hold]:
    """Every claim of the run's jobs, with how and when its worker let go of it."""
    frame = lives.events
    found = []
    for claim in frame[frame["kind"] == "claim"].itertuples():
        job, fence = int(claim.job_id), int(claim.fence)
        after = frame[
            (frame["worker"] == claim.worker)
            & (frame["job_id"] == job)
            & (frame["fence"] == fence)
            & frame["kind"].isin(_ENDS)
            & (frame["s"] >= claim.s)
        ]
        ended = after.iloc[0] if len(after) else None
        rows = lives.rows
        set_ = rows[(rows["job_id"] == job) & (rows["fence"] == fence) & rows["until_s"].notna()]
        # When the claim took effect is the database's to say: the worker records it when it
        # reads the claim's reply, which can come later (sent beside a completion).
        start = float(set_["s"].iloc[0]) if len(set_) else float(claim.s)
        found.append(
            Hold(
                job,
                fence,
                claim.worker,
                start,
                None if ended is None else float(ended["s"]),
                None if ended is None else str(ended["kind"]),
                tuple(zip(set_["s"].astype(float), set_["until_s"].astype(float), strict=True)),
            )
        )
    return found


def draw(
    lives: Lives,
    *,
    title: str = "Each job's claims, leases and fence",
    upto: float | None = None,
    lane_height: float = 0.62,
    ax: Axes | None = None,
) -> Figure:
    """One lane per job (the first on top); see the module's docstring for what is in a
    lane. With ``upto`` (seconds), only what had happened by then, a line marks that
    moment, and each lease still running shows, paler, the part it had left.
    ``lane_height``: inches a lane takes in a new figure."""
    import matplotlib.pyplot as plt

    jobs = list(lives.jobs)
    every = holds(lives)
    end = _end_of(lives, every)
    now = end if upto is None else upto
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 1.3 + lane_height * len(jobs)))
    else:
        fig = ax.figure
    y = {job: len(jobs) - 1 - i for i, job in enumerate(jobs)}  # the first job on top
    workers = sorted({h.worker for h in every}, key=_lane_order)
    colour = {w: _PALETTE[i % len(_PALETTE)] for i, w in enumerate(workers)}
    top = max([1, *(f for f in lives.rows["fence"])])
    pauses = _pauses(lives.events)

    for job in jobs:
        ax.axhline(y[job] - 0.5, color="0.85", linewidth=0.8, zorder=0)
        _draw_fence(ax, lives.rows[lives.rows["job_id"] == job], y[job], top, now)
    for hold, slot, slots in _slots(every):
        if hold.start > now:
            continue
        _draw_hold(ax, hold, y[hold.job_id], slot, slots, colour, pauses, now, upto is not None)
    _draw_marks(ax, lives.events, y, every, now)
    if upto is not None:
        ax.axvline(upto, color="0.2", linewidth=1, linestyle="--", zorder=4)

    ax.set_xlim(0, end * 1.03 + 0.02)
    ax.set_ylim(-0.55, len(jobs) - 0.45)
    ax.set_yticks([y[j] for j in jobs], [f"job #{j}" for j in jobs])
    ax.set_xlabel("time since the workers started (s)")
    ax.set_ylabel("job (one lane each)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    _fence_axis(ax, jobs, y, top)
    shown = set(lives.events.loc[lives.events["s"] <= now, "kind"])
    if any(h.lease_at(min(h.end or now, now)) is not None and len(h.leases) > 1 for h in every):
        shown.add("heartbeat")
    if any((u := h.lease_at(h.end or now)) is not None and u < (h.end or now) for h in every):
        shown.add("outlived")
    ax.legend(
        handles=_legend(workers, colour, bool(pauses), shown),
        loc="upper left",
        bbox_to_anchor=(1.06, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    return fig


def scrub(lives: Lives, *, title: str = "Each job's claims, leases and fence") -> Any:
    """The figure of ``draw`` with a time slider and a play button (ipywidgets): move
    through the run and watch the leases run out and the fences step up."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    end = _end_of(lives, holds(lives))
    step = round(max(end / 60, 0.01), 2)
    slider = widgets.FloatSlider(
        value=end, min=0.0, max=round(end + step, 2), step=step, description="time (s)"
    )
    play = widgets.Play(value=0, min=0, max=round(end / step) + 1, step=1, interval=150)
    widgets.jslink((play, "value"), (slider, "value"))  # needs a live frontend
    play.observe(lambda change: setattr(slider, "value", change["new"] * step), names="value")

    def show(upto: float) -> None:
        draw(lives, title=f"{title} (at {upto:.2f} s)", upto=upto)
        plt.show()

    out = widgets.interactive_output(show, {"upto": slider})
    return widgets.VBox([widgets.HBox([play, slider]), out])


# -- drawing ----------------------------------------------------------------------------


def _end_of(lives: Lives, every: list[Hold]) -> float:
    """The last moment worth showing: the last event, claim end or lease deadline."""
    times = [0.1, *lives.events["s"].tolist()]
    times += [h.end for h in every if h.end is not None]
    return float(max(times))


def _pauses(events: pd.DataFrame) -> dict[str, list[tuple[float, float]]]:
    """Each worker's frozen spells, from its ``pause`` events (detail: the seconds)."""
    found: dict[str, list[tuple[float, float]]] = {}
    for row in events[events["kind"] == "pause"].itertuples():
        found.setdefault(row.worker, []).append((float(row.s), float(row.s) + float(row.detail)))
    return found


def _slots(every: list[Hold]) -> list[tuple[Hold, int, int]]:
    """Each hold with a row of its lane (claims of one job that overlap in time, a stale
    holder's and the new one's, go one under the other) and how many rows the lane needs."""
    out: list[tuple[Hold, int]] = []
    per_job: dict[int, list[float]] = {}
    for hold in sorted(every, key=lambda h: h.start):
        ends = per_job.setdefault(hold.job_id, [])
        stop = hold.end if hold.end is not None else float("inf")
        free = next((i for i, e in enumerate(ends) if e <= hold.start), None)
        if free is None:
            ends.append(stop)
            free = len(ends) - 1
        else:
            ends[free] = stop
        out.append((hold, free))
    return [(h, slot, len(per_job[h.job_id])) for h, slot in out]


# Where things go in a lane centred on 0: claims above, the fence's step below.
_HOLD_BAND = (0.0, 0.44)
_FENCE_BAND = (-0.42, -0.08)


def _fence_level(lane_y: float, fence: float, top: int) -> float:
    low, high = _FENCE_BAND
    return lane_y + low + (high - low) * fence / top


def _draw_fence(ax: Axes, rows: pd.DataFrame, lane_y: float, top: int, now: float) -> None:
    """The fence the job's row held, as a step from the first row seen to ``now``."""
    changes = rows[rows["s"] <= now]
    if not len(changes):
        return
    xs = [max(0.0, float(s)) for s in changes["s"]] + [now]
    fences = [int(f) for f in changes["fence"]]
    levels = [_fence_level(lane_y, f, top) for f in [*fences, fences[-1]]]
    base = lane_y + _FENCE_BAND[0]
    ax.fill_between(xs, base, levels, step="post", color="0.3", alpha=0.12, linewidth=0)
    ax.step(xs, levels, where="post", color="0.25", linewidth=1.8, zorder=2)


def _draw_hold(
    ax: Axes,
    hold: Hold,
    lane_y: float,
    slot: int,
    slots: int,
    colour: dict[str, str],
    pauses: dict[str, list[tuple[float, float]]],
    now: float,
    scrubbing: bool,
) -> None:
    """One claim: the bar of its holder, hatched where the holder was frozen, and the lease
    line under it (red and dotted past a deadline the holder outlived)."""
    low, high = _HOLD_BAND
    height = (high - low) / slots
    bottom = lane_y + high - (slot + 1) * height
    stop = min(hold.end if hold.end is not None else now, now)
    bar = (bottom + 0.3 * height, 0.62 * height)
    ax.broken_barh([(hold.start, stop - hold.start)], bar, color=colour[hold.worker], alpha=0.75)
    for start, end in pauses.get(hold.worker, []):
        a, b = max(start, hold.start), min(end, stop)
        if b > a:
            ax.broken_barh(
                [(a, b - a)], bar, facecolor="none", edgecolor="0.15", hatch="////", linewidth=0
            )
    until = hold.lease_at(stop)
    if until is None:
        return
    lease_y = bottom + 0.14 * height
    ax.plot([hold.start, min(until, stop)], [lease_y, lease_y], color="tab:red", linewidth=1.6)
    beats = [at for at, _ in hold.leases[1:] if at <= stop]
    ax.scatter(beats, [lease_y] * len(beats), marker="|", color="0.2", s=30, zorder=3)
    if scrubbing and until > now and stop >= now:  # still running: the part left, pale
        ax.plot([now, until], [lease_y, lease_y], color="tab:red", linewidth=3, alpha=0.3)
    if until < stop:  # the holder held on past its lease
        ax.plot([until, stop], [lease_y, lease_y], color="tab:red", linewidth=1.2, linestyle=":")
        ax.plot([until, until], [lease_y - 0.05, lease_y + 0.05], color="tab:red", linewidth=1.6)


def _draw_marks(
    ax: Axes, events: pd.DataFrame, y: dict[int, int], every: list[Hold], now: float
) -> None:
    """Claims, accepted completes and writes, refused writes, fails and reaper returns,
    each at its moment in its job's lane, at the height of the claim it belongs to."""
    height_of = {}
    for hold, slot, slots in _slots(every):
        low, high = _HOLD_BAND
        h = (high - low) / slots
        height_of[(hold.job_id, hold.fence, hold.worker)] = (
            y[hold.job_id] + high - (slot + 1) * h + 0.61 * h
        )
    styles = {
        "claim": {"marker": ">", "facecolor": "white", "edgecolor": "0.1", "s": 45},
        "complete": {"marker": "s", "color": "tab:green", "s": 36},
        "fenced-write": {"marker": "D", "color": "tab:green", "s": 28},
        "fail": {"marker": "v", "color": "tab:orange", "s": 45},
        "refused": {"marker": "X", "color": "red", "s": 90},
        "reap": {"marker": "^", "color": "black", "s": 55},
    }
    points: dict[str, tuple[list[float], list[float]]] = {}
    claimed_at = {(h.job_id, h.fence, h.worker): h.start for h in every}
    for row in events[events["s"] <= now].itertuples():
        kind = "refused" if row.kind in _REJECTED else row.kind
        if kind not in styles or row.job_id is None:
            continue
        job = int(row.job_id)
        at = float(row.s)
        if kind == "claim":  # drawn where the database says it took effect
            at = claimed_at.get((job, int(row.fence), row.worker), at)
        if kind == "reap":
            lane = y[job] + _HOLD_BAND[1] - 0.02
        else:
            lane = height_of.get((job, int(row.fence), row.worker), y[job] + 0.2)
        xs, ys = points.setdefault(kind, ([], []))
        xs.append(at)
        ys.append(lane)
    for kind, (xs, ys) in points.items():
        ax.scatter(xs, ys, zorder=5, **styles[kind])


def _fence_axis(ax: Axes, jobs: list[int], y: dict[int, int], top: int) -> None:
    """A scale on the right for the fence steps: 0 up to the highest fence in each lane."""
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    levels = range(top + 1) if top <= 4 else (0, top)
    ticks = [_fence_level(y[j], f, top) for j in jobs for f in levels]
    right.set_yticks(ticks, [str(f) for _ in jobs for f in levels], fontsize=6.5)
    right.tick_params(length=2, pad=1)
    right.set_ylabel("fence in the job's row (step)", fontsize=9)


def _legend(workers: list[str], colour: dict[str, str], paused: bool, shown: set[str]) -> list[Any]:
    """Each worker's colour, then only the marks this figure shows (``shown``: event kinds,
    and "heartbeat" and "outlived" when a lease moved on or ran out under its holder)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def mark(marker: str, color: str, label: str, **style: Any) -> Line2D:
        return Line2D([], [], linestyle="", marker=marker, color=color, label=label, **style)

    def line(label: str, **style: Any) -> Line2D:
        return Line2D([], [], label=label, **style)

    handles: list[Any] = [
        Patch(facecolor=colour[w], alpha=0.75, label=f"held by {w}") for w in workers
    ]
    if paused:
        handles.append(Patch(facecolor="0.9", edgecolor="0.15", hatch="////", label="frozen"))
    if any(kind in shown for kind in _REJECTED):
        shown = shown | {"refused"}
    optional: list[tuple[str | None, Any]] = [
        (None, line("lease (the database's)", color="tab:red", linewidth=1.6)),
        ("outlived", line("held after the lease ran out", color="tab:red", linestyle=":")),
        (None, mark(">", "0.1", "claim", markerfacecolor="white")),
        ("heartbeat", mark("|", "0.2", "heartbeat: lease moved on")),
        ("reap", mark("^", "black", "reaper hands the job back")),
        ("complete", mark("s", "tab:green", "complete accepted")),
        ("fenced-write", mark("D", "tab:green", "fenced write accepted")),
        ("fail", mark("v", "tab:orange", "fail: retried later")),
        ("refused", mark("X", "red", "late write refused (0 rows)")),
        (None, line("fence in the row: +1 at each claim", color="0.25", linewidth=1.8)),
    ]
    return handles + [h for when, h in optional if when is None or when in shown]
