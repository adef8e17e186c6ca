"""The fencing figure's storage lanes: the fence each row held, and the writes reaching it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .labels import _Labels
from .plot_parts import _JOB_WRITES, _REJECTED, _SIDE_WRITES

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes


def _draw_storage(
    ax: Axes,
    frame: pd.DataFrame,
    stores: Mapping[str, pd.DataFrame],
    y: Mapping[str, int],
    names: list[str],
    origin: float,
    left: float,
    end_s: float,
    labels: _Labels,
) -> None:
    """Each storage lane: the stored fence as a labelled step; each write an arrow from
    its worker's lane to the row it reached, green when taken, red with the fences compared
    when the stored fence turned it away; each claim an arrow handing out the new fence."""
    right = end_s * 1.25 + 0.05
    for name in names:
        _draw_stored_fences(ax, stores[name].sort_values("t"), y[name], origin, left, right, labels)
    targets = {kind: names[0] for kind in _JOB_WRITES} | {kind: names[-1] for kind in _SIDE_WRITES}
    for row in frame[
        frame["kind"].isin(list(targets)) & frame["worker"].isin(list(y))
    ].itertuples():
        store = targets[row.kind]
        _draw_write(ax, row, y[row.worker], y[store], stores[store], origin, labels)


def _draw_stored_fences(
    ax: Axes,
    store: pd.DataFrame,
    lane_y: int,
    origin: float,
    left: float,
    right: float,
    labels: _Labels,
) -> None:
    """One storage lane: "no row yet" until the row exists, then the fence it held as a
    labelled step that rises (or falls) where it changed (``store``: its changes, sorted
    by time)."""
    # A fence stored before the events begin is drawn from the left edge.
    times = [max(float(t) - origin, left) for t in store["t"]]
    if times and times[0] <= left + 0.03 * (right - left):
        times[0] = left  # there from (about) the start
    if not times or times[0] > left + 0.03 * (right - left):
        start = times[0] if times else right
        ax.plot([left, start], [lane_y, lane_y], color="0.6", linestyle="--", linewidth=1)
        labels.add(left, lane_y, "no row yet", priority=0, color="0.35")
    # The fence as a step: higher in the lane the higher it is (the lanes' axis runs down).
    top = max([1, *(int(f) for f in store["fence"])])

    def level(fence: int) -> float:
        return lane_y + 0.22 - 0.44 * fence / top

    for i, (t, fence) in enumerate(zip(times, store["fence"], strict=True)):
        stop = times[i + 1] if i + 1 < len(times) else right
        ax.plot(
            [t, stop],
            [level(int(fence))] * 2,
            color="0.45",
            linewidth=5,
            alpha=0.35,
            solid_capstyle="butt",
        )
        if i:  # the riser from the fence before
            before = level(int(store["fence"].iloc[i - 1]))
            ax.plot([t, t], [before, level(int(fence))], color="0.3", linewidth=1.5)
        else:
            ax.plot([t, t], [lane_y - 0.2, lane_y + 0.2], color="0.3", linewidth=1)
        labels.block(t, stop, lane_y - 0.25, lane_y + 0.25)
        labels.add(
            t,
            level(int(fence)),
            f"fence {int(fence)}",
            short=f"f={int(fence)}",
            priority=0,
            stay_right=True,
            color="0.15",
        )


def _draw_write(
    ax: Axes,
    row: Any,
    worker_y: int,
    store_y: int,
    store: pd.DataFrame,
    origin: float,
    labels: _Labels,
) -> None:
    """One claim or write between a worker's lane and a storage lane: an arrow, and where
    the write was refused an X with the fences compared: ``1 ≠ 2: refused`` on the job's
    row, whose writes must carry its current fence, ``1 < 2: refused`` on a side row,
    which takes any fence no older than its own."""
    refused = row.kind in _REJECTED
    color = "tab:blue" if row.kind == "claim" else "red" if refused else "tab:green"
    tail, head = (store_y, worker_y) if row.kind == "claim" else (worker_y, store_y)
    ax.annotate(
        "",
        xy=(row.s, head),
        xytext=(row.s, tail),
        arrowprops={
            "arrowstyle": "-|>",
            "color": color,
            "lw": 1.2,
            "alpha": 0.8,
            "shrinkA": 6,
            "shrinkB": 6,
        },
        zorder=1,
    )
    labels.block_vline(row.s, min(worker_y, store_y) + 0.2, max(worker_y, store_y) - 0.2)
    if refused:
        held = _stored_at(store, origin, row.s)
        ticket = int(row.fence)
        # The job's own row takes only its current fence (=); a side row none older (<=).
        compared = "≠" if row.kind in _JOB_WRITES else "<"
        stale = held is not None and ticket < held
        text = f"{ticket} {compared} {held}: refused" if stale else "refused"
        labels.add(row.s, store_y, text, short="refused", priority=0, color="red", side="below")
        ax.scatter([row.s], [store_y], marker="X", color="red", s=60, zorder=3)
        labels.block_point(row.s, store_y, 60**0.5)


def _stored_at(store: pd.DataFrame, origin: float, s: float) -> int | None:
    """The fence the row held at ``s`` seconds (None before the row existed)."""
    before = store[store["t"] - origin <= s + 1e-3]
    return None if not len(before) else int(before.sort_values("t")["fence"].iloc[-1])
