"""Leases as the database held them (lesson 03): the lease left over time, and two reapers.

Both figures read what ``stories.watch`` recorded (every new ``lease_until`` a statement
wrote, stamped with the database's ``now()``), never the workers' own guesses.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from .stories import ReaperRace


def lease_left(held: pd.DataFrame, start: float, end: float) -> pd.DataFrame:
    """The lease left of one claim over time, from its lease rows (``set_t``, ``until_t``,
    oldest first, as ``stories.leases`` gives them) up to ``end``: at each row's ``set_t``
    a full lease, falling until the next row (or ``end``). Columns ``t`` (seconds since
    ``start``) and ``left`` (seconds)."""
    times: list[float] = []
    left: list[float] = []
    for (_, row), nxt in zip(held.iterrows(), [*held.set_t[1:], end], strict=True):
        times += [row.set_t - start, nxt - start]
        left += [row.until_t - row.set_t, row.until_t - nxt]
    return pd.DataFrame({"t": times, "left": left})


def draw_lease_left(left: pd.DataFrame, lease: float, who: str = "A") -> Figure:
    """The saw-tooth of the lease left, with the line where it would run out and the model's
    lowest point for a heartbeat every third of the lease."""
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.plot(left.t, left.left, color="tab:red", label="lease left: lease_until - time (database)")
    ax.axhline(0, color="black", linestyle=":", label="lease runs out")
    ax.axhline(
        lease * 2 / 3,
        color="0.5",
        linestyle="--",
        label="model: lowest point, a beat every lease/3",
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("lease left (s)")
    ax.set_ylim(-0.1, lease * 1.15)
    ax.set_title(f"Heartbeats keep {who}'s lease from ever running low")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def draw_reaper_race(race: ReaperRace) -> Figure:
    """One dot per claim's batch of jobs (they share one ``lease_until``): when its lease ran
    out, how long after that a reaper returned it, coloured by the reaper; area: jobs."""
    returns = race.returns().merge(race.leases.groupby("job_id").until_t.max().reset_index())
    origin = race.calls.start.min()
    batches = returns.groupby(["reaper", "until_t", "t"]).size().rename("jobs").reset_index()
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for name, mine in batches.groupby("reaper"):
        ax.scatter(
            mine.until_t - origin,
            (mine.t - mine.until_t) * 1000,
            s=4 * mine.jobs,
            label=f"returned by {name} (area: jobs)",
        )
    ax.set_xlabel("lease ran out (s since the reapers started; the database's lease_until)")
    ax.set_ylabel("returned after the lease ran out (ms)")
    ax.set_title(f"Two reapers, {len(race.jobs)} leases running out: each job returned once")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
