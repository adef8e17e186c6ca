"""The timeline's bars: pauses, lock waits, claim transactions, and each hold with its lease."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .labels import _BAR
from .plot_parts import _ENDS, _REJECTED, _lanes_of, _Sheet

if TYPE_CHECKING:
    import pandas as pd

# A hold bar's style: (legend label, color, alpha, hatch).
_BarStyle = tuple[str, str, float, str]
_HELD: _BarStyle = ("holding a job", "tab:blue", 0.3, "")
_REFUSED: _BarStyle = ("held, then refused", "tab:red", 0.25, "")
_STOPPED: _BarStyle = ("lease held by a stopped worker", "0.55", 0.35, "///")


def _draw_pauses(sheet: _Sheet) -> None:
    """A shaded box over the paused worker's lanes, labelled with its length."""
    for row in sheet.frame[sheet.frame["kind"] == "pause"].itertuples():
        seconds = float(row.detail or 0)
        for lane in _lanes_of(row.worker, sheet.workers):
            lane_y = sheet.y[lane]
            sheet.ax.broken_barh([(row.s, seconds)], (lane_y - 0.42, 0.84), color="0.8", alpha=0.6)
            sheet.labels.keep(
                sheet.ax.text(
                    row.s + seconds / 2,
                    lane_y - 0.35,
                    f"paused {seconds:g} s",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="0.25",
                )
            )
        sheet.end_s = max(sheet.end_s, row.s + seconds)
        sheet.used.add("pause")


def _draw_lock_waits(sheet: _Sheet) -> None:
    """(02's claim races) A dotted box where the claim's select stood in line behind other locks."""
    for row in sheet.frame[sheet.frame["kind"] == "lock-wait"].itertuples():
        if row.worker in sheet.y:
            waited, lane_y = float(row.detail or 0), sheet.y[row.worker]
            sheet.ax.broken_barh(
                [(row.s - waited, waited)],
                (lane_y - 0.14, 0.28),
                facecolor="none",
                edgecolor="tab:orange",
                hatch="....",
                linewidth=0,
            )
            sheet.labels.block(row.s - waited, row.s, lane_y - _BAR, lane_y + _BAR)
            sheet.used.add("lock-wait")


def _draw_claim_transactions(sheet: _Sheet) -> None:
    """(02's claim races) A thin bar from the claim's select returning to the claim's commit."""
    begins = sheet.frame[sheet.frame["kind"] == "claim-begin"]
    for row in sheet.claims.itertuples():
        mine = begins[(begins["worker"] == row.worker) & (begins["s"] <= row.s)]
        if len(mine):
            begun, lane_y = float(mine["s"].iloc[-1]), sheet.y[row.worker]
            sheet.ax.broken_barh([(begun, row.s - begun)], (lane_y - 0.06, 0.12), color="navy")
            sheet.used.add("claim-tx")


def _draw_holds(sheet: _Sheet, db: pd.DataFrame | None, lease: float | None) -> None:
    """For each claim: a bar from the claim to whatever ended it, its lease (from the
    database's deadlines ``db``, else estimated from ``lease``) and where that ran out
    before the hold ended, and (when annotating) the claim's ``#job f=fence``."""
    frame = sheet.frame
    crashed = {
        lane
        for w in frame.loc[frame["kind"] == "crash", "worker"]
        for lane in _lanes_of(w, sheet.workers)
    }
    for row in sheet.claims.itertuples():
        key = (int(row.job_id), int(row.fence))
        mine = frame[
            (frame["job_id"] == key[0]) & (frame["fence"] == key[1]) & (frame["s"] >= row.s)
        ]
        ends = mine[mine["kind"].isin(_ENDS) & (mine["worker"] == row.worker)]
        stop, style = _hold_end(sheet, row.worker in crashed, mine, ends)
        lane_y = sheet.y[row.worker]
        _draw_hold(sheet, row.s, stop, lane_y, style)
        expiry = None
        if db is not None:
            held = db[(db["job_id"] == key[0]) & (db["fence"] == key[1])]
            expiry = _draw_lease_band(sheet, held, stop, lane_y)
        elif lease is not None:
            renewals = mine[
                mine["kind"].isin(["claim", "heartbeat"]) & (mine["worker"] == row.worker)
            ]
            expiry = float(renewals["s"].max()) + lease
        if expiry is not None and (
            expiry < stop - 1e-3 or (not len(ends) and expiry <= sheet.end_s)
        ):
            _draw_expiry(sheet, expiry, lane_y)
        if sheet.annotate:
            text, short = f"#{key[0]} f={key[1]}", f"#{key[0]}"
            sheet.labels.add(row.s, lane_y, text, short=short, color="tab:blue")
            sheet.used.add("claim-labels")


def _hold_end(
    sheet: _Sheet, crashed: bool, mine: pd.DataFrame, ends: pd.DataFrame
) -> tuple[float, _BarStyle]:
    """When a hold stopped, and its bar's style: at its worker's first ending (refused or
    not), else at the reap that took it back from a stopped worker, else at the end."""
    reaped = mine[mine["kind"] == "reap"]
    if len(ends):
        stop, kind = float(ends["s"].iloc[0]), ends["kind"].iloc[0]
        return stop, _REFUSED if kind in _REJECTED else _HELD
    if crashed or len(reaped):
        return (float(reaped["s"].iloc[0]) if len(reaped) else sheet.end_s), _STOPPED
    return sheet.end_s, _HELD


def _draw_hold(sheet: _Sheet, start: float, stop: float, lane_y: int, style: _BarStyle) -> None:
    """The bar of one hold, from ``start`` to ``stop`` on its lane."""
    label, color, alpha, hatch = style
    sheet.ax.broken_barh(
        [(start, max(stop - start, 1e-3))],
        (lane_y - _BAR, 2 * _BAR),
        facecolor=color,
        alpha=alpha,
        hatch=hatch,
        edgecolor=color if hatch else "none",
    )
    sheet.labels.block(start, stop, lane_y - _BAR, lane_y + _BAR)
    sheet.holds.setdefault(label, (color, alpha, hatch))


def _draw_lease_band(sheet: _Sheet, held: pd.DataFrame, stop: float, lane_y: int) -> float | None:
    """A thin line under the hold for its lease in the database; returns its deadline."""
    if not len(held):
        return None
    first, expiry = float(held["set_s"].min()), float(held["until_s"].max())
    band_end = min(expiry, stop)
    sheet.ax.plot(
        [first, band_end],
        [lane_y + 0.22, lane_y + 0.22],
        color="tab:red",
        alpha=0.5,
        linewidth=1.5,
        solid_capstyle="butt",
    )
    sheet.labels.block(first, band_end, lane_y + 0.19, lane_y + 0.25)
    sheet.used.add("lease-band")
    return expiry


def _draw_expiry(sheet: _Sheet, expiry: float, lane_y: int) -> None:
    """A red dotted line where a lease ran out before its hold ended."""
    top, bottom = lane_y - 0.24, lane_y + 0.24
    sheet.ax.plot([expiry, expiry], [top, bottom], color="tab:red", linestyle=":", linewidth=2)
    sheet.labels.block_vline(expiry, top, bottom)
    sheet.used.add("expiry")
