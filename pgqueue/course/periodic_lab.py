"""Notebook 15's periodic-job experiments (its first, workers ticking one schedule, is
written in the notebook): the jobs a schedule made, two ticks of one slot at the same moment,
and the catch-up policies after every worker stopped. Teaching aids, not the queue: the
ticks are pgqueue's own (``periodic.py``, ``schedule_tick``)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pandas as pd
import psycopg

from .. import statements
from ..periodic import GRACE, Schedule, candidates, tick_params
from ..tasks import Tasks
from ..worker import Worker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FAST = {"poll_interval": 0.1, "listen": False, "reap_interval": 0.5}


def jobs_of(dsn: str, schedule: str) -> pd.DataFrame:
    """Every job a schedule made: its slot, its id and when its tick made it (``run_at``,
    the tick statement's ``now()``), oldest slot first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT (payload->>'slot')::timestamptz, id, run_at FROM jobs "
            "WHERE payload->>'schedule' = %s ORDER BY 1",
            [schedule],
        ).fetchall()
    return pd.DataFrame(rows, columns=["slot", "job_id", "made_at"])


def _schedule(every: float, name: str, catch_up: str = "latest") -> Schedule:
    tasks = Tasks()
    tasks.periodic(every=every, name=name, queue="ticks", catch_up=catch_up)(lambda job: None)
    return tasks.schedules[name]


def _clock(conn: psycopg.Connection, name: str) -> tuple[datetime, datetime | None]:
    row = conn.execute(
        "SELECT now(), (SELECT last_slot FROM pgqueue_schedules WHERE name = %s)", [name]
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def one_slot_two_tickers(dsn: str, name: str = "same-moment") -> dict[str, int]:
    """Two workers tick the same due slot of an ``every=1`` schedule with pgqueue's own
    statement (``schedule_tick``): the first inside a transaction still open when the
    second sends its own; then a stale third, its plan made before the others wrote and the
    schedule's cursor set back so that only the slot's primary key can stop it. How many
    jobs each made, and how many the slot has."""
    schedule = _schedule(1, name)
    tick = statements.query("schedule_tick")
    with (
        psycopg.connect(dsn, autocommit=True) as first,
        psycopg.connect(dsn, autocommit=True) as second,
    ):
        now, _ = _clock(first, name)
        first.execute(statements.query("schedule_add"), tick_params(schedule, candidates(
            schedule, None, now)))  # fmt: skip
        time.sleep(1.05)  # the next slot is due
        now, last = _clock(first, name)
        assert last is not None
        # Both tickers plan the same slot: the newest one due (a loaded machine may have
        # let two come due during the sleep; one slot keeps the count about one slot).
        plan = [slot for slot in candidates(schedule, last, now) if slot <= now][-1:]
        with first.transaction():
            (made_first,) = first.execute(tick, tick_params(schedule, plan)).fetchone() or (0,)
            (made_second,) = second.execute(tick, tick_params(schedule, plan)).fetchone() or (0,)
        first.execute("UPDATE pgqueue_schedules SET last_slot = %s WHERE name = %s", [last, name])
        (made_stale,) = second.execute(tick, tick_params(schedule, plan)).fetchone() or (0,)
    made = jobs_of(dsn, name)
    return {
        "first": made_first,
        "second, at the same moment": made_second,
        "stale, cursor set back": made_stale,
        "jobs for the slot": int((made["slot"] == plan[0]).sum()),
    }


POLICIES = ("latest", "all", "none")


def catch_up(
    dsn: str, *, before: float = 2.5, stopped: float = 5.0, after: float = 2.5
) -> pd.DataFrame:
    """One worker ticks three ``every=1`` schedules, one per catch-up policy, for
    ``before`` seconds; it stops (every worker of the queue is down) for ``stopped``
    seconds; a new worker ticks for ``after`` seconds. One row per slot of the run:
    its policy, its time (seconds since the first worker started, database clock), and
    what became of it: ``on time`` (a job within ``GRACE`` s of its slot), ``caught up``
    (a job made later than that, after the stop) or ``skipped`` (no job). ``attrs``:
    ``stop`` and ``restart`` (seconds, database clock)."""

    def registry() -> Tasks:
        tasks = Tasks(dsn)
        for policy in POLICIES:
            tasks.periodic(every=1, name=f"catch-up {policy}", queue="ticks", catch_up=policy)(
                lambda job: None
            )
        return tasks

    with psycopg.connect(dsn, autocommit=True) as conn:
        origin, _ = _clock(conn, "")
        for part, seconds in (("first", before), ("second", after)):
            tasks = registry()
            worker = Worker(tasks, dsn=dsn, name=part, **FAST).start()
            time.sleep(seconds)
            worker.stop(grace=2)
            tasks.close()
            if part == "first":
                stop, _ = _clock(conn, "")
                time.sleep(stopped)
                restart, _ = _clock(conn, "")
        end, _ = _clock(conn, "")
    rows = []
    for policy in POLICIES:
        made = jobs_of(dsn, f"catch-up {policy}")
        first_slot = made["slot"].min()
        late = made["made_at"] - made["slot"] > timedelta(seconds=GRACE)
        fates = dict(
            zip(made["slot"], late.map({True: "caught up", False: "on time"}), strict=True)
        )
        slot = first_slot
        while slot <= made["slot"].max():
            fate = fates.get(slot, "skipped")
            rows.append({"policy": policy, "slot": slot, "fate": fate})
            slot += timedelta(seconds=1)
    frame = pd.DataFrame(rows)
    frame["t"] = (frame["slot"] - origin).dt.total_seconds()
    frame.attrs = {
        "stop": (stop - origin).total_seconds(),
        "restart": (restart - origin).total_seconds(),
        "end": (end - origin).total_seconds(),
    }
    return frame


_FATES = {
    "on time": {"marker": "o", "color": "tab:blue"},
    "caught up": {"marker": "*", "color": "tab:orange", "s": 160},
    "skipped": {"marker": "x", "color": "0.6"},
}


def plot_catch_up(frame: pd.DataFrame) -> Figure:
    """One row per policy, one mark per slot: a job on time, a job caught up after the
    stop, or no job; the stop shaded."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.axvspan(frame.attrs["stop"], frame.attrs["restart"], color="0.92", zorder=0)
    ax.text(
        (frame.attrs["stop"] + frame.attrs["restart"]) / 2,
        len(POLICIES) - 0.45,
        "every worker stopped",
        ha="center",
        fontsize=8,
        color="0.3",
    )
    for y, policy in enumerate(reversed(POLICIES)):
        rows = frame[frame["policy"] == policy]
        for fate, style in _FATES.items():
            at = rows[rows["fate"] == fate]
            ax.scatter(at["t"], [y] * len(at), label=fate if y == 0 else None, zorder=2, **style)
    ax.set_yticks(range(len(POLICIES)), [f'catch_up="{p}"' for p in reversed(POLICIES)])
    ax.set_ylim(-0.6, len(POLICIES) - 0.2)
    ax.set_xlabel("slot (seconds since the first worker started, database clock)")
    ax.set_title("every=1 through a stop: what each policy makes of the missed slots")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def tick_excerpt() -> str:
    """The part of pgqueue's ``schedule_tick`` that keeps one job per slot."""
    text = statements.query("schedule_tick")
    start = text.index("), taken AS (")
    end = text.index("), moved AS (")
    return "WITH ...\n" + text[start + 3 : end] + "..."
