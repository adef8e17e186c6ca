"""A job's life as a state diagram: the five statuses of ``jobs.status`` as boxes, and on
each arrow the statement of ``pgqueue/sql/queries.sql`` that moves a job along it, with
what that statement does to ``attempts`` and ``fence``. Drawn with matplotlib alone.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import statements

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["TRANSITIONS", "Transition", "lifecycle", "schema_statuses"]


class Transition(NamedTuple):
    """One arrow: ``statement`` (a name in ``queries.sql``) moves a job from ``source`` to
    ``target``; ``source`` is None for the statement that creates the job."""

    source: str | None
    target: str
    statement: str


TRANSITIONS: tuple[Transition, ...] = (
    Transition(None, "ready", "enqueue"),
    Transition("ready", "running", "claim"),
    Transition("running", "running", "heartbeat"),
    Transition("running", "done", "complete"),
    Transition("running", "done", "complete_many"),
    Transition("running", "ready", "fail"),
    Transition("running", "ready", "release"),
    Transition("running", "ready", "reap"),
    Transition("running", "dead", "fail"),
    Transition("running", "dead", "reap"),
    Transition("ready", "cancelled", "cancel"),
    Transition("running", "cancelled", "cancel"),
    Transition("dead", "ready", "retry_dead"),
)

# Box centres (data units) and colours: the live statuses blue, the ends by how they ended.
_BOXES: dict[str, tuple[float, float, str]] = {
    "ready": (0.0, 0.0, "#cfe2f3"),
    "running": (5.0, 0.0, "#cfe2f3"),
    "done": (10.0, 0.0, "#d9ead3"),
    "cancelled": (2.5, 3.0, "#e6e6e6"),
    "dead": (10.0, -3.0, "#f4cccc"),
}
_W, _H = 1.5, 0.8  # box width and height
_START = (-2.6, 0.0)

# What each arrow's label says, keyed by (source, target); every name in it is a statement.
_LABELS: dict[tuple[str | None, str], str] = {
    (None, "ready"): "enqueue",
    ("ready", "running"): "claim\nattempts+1, fence+1",
    ("running", "running"): "heartbeat\nlease_until moves on",
    ("running", "done"): "complete /\ncomplete_many",
    ("running", "ready"): (
        "fail (attempts < max_attempts): fence+1,\n"
        "    run_at = now() + backoff·2^attempts\n"
        "release: attempts-1 (fence stays)\n"
        "reap: the lease ran out"
    ),
    ("running", "dead"): "fail at max_attempts,\nor GiveUp: fence+1\nreap at max_attempts",
    ("ready", "cancelled"): "cancel\nfence+1",
    ("running", "cancelled"): "cancel\nfence+1",
    ("dead", "ready"): "retry_dead: max_attempts = attempts + extra (attempts, fence kept)",
}

_CAPTION = (
    "Every arrow is one UPDATE (enqueue: an INSERT) of pgqueue/sql/queries.sql. "
    "attempts+1: the claim counts an attempt; attempts-1: release gives it back.\n"
    "fence+1: the statement raises the job's fencing token, so a heartbeat, complete, fail or "
    "release still sent with the old value changes no row: that holder no longer owns the job.\n"
    "Blue: live (a worker may claim it, or holds it; its unique key, if any, stays taken). "
    "Green, grey: finished for good. Red: dead, waiting for a person."
)


def schema_statuses() -> list[str]:
    """The statuses the schema gives ``jobs.status``, read from its column comment in
    ``sql/schema.sql`` (``-- ready running done dead cancelled``)."""
    found = re.search(r"^\s*status\s+text\b.*--\s*(.+)$", statements.schema(), re.MULTILINE)
    if found is None:
        raise LookupError("schema.sql: no comment listing the statuses on jobs.status")
    return found.group(1).split()


def lifecycle(ax: Axes | None = None) -> list[Transition]:
    """Draw the job lifecycle on ``ax`` (a new figure when None) and return its arrows, one
    ``Transition(source, target, statement)`` per statement, so that a notebook can check
    them against the schema and ``pgqueue.statements.queries()``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    if ax is None:
        fig, ax = plt.subplots(figsize=(12.5, 7.4))
        fig.subplots_adjust(left=0.01, right=0.99, top=0.95, bottom=0.1)
    else:
        fig = ax.figure
    ax.set_xlim(-3.2, 11.6)
    ax.set_ylim(-4.6, 3.7)
    ax.set_aspect("equal")
    ax.axis("off")

    for name, (x, y, color) in _BOXES.items():
        ax.add_patch(
            FancyBboxPatch(
                (x - _W / 2, y - _H / 2),
                _W,
                _H,
                boxstyle="round,pad=0.02,rounding_size=0.15",
                facecolor=color,
                edgecolor="0.25",
                linewidth=1.3,
                zorder=2,
            )
        )
        ax.text(x, y, name, ha="center", va="center", fontsize=12, weight="bold", zorder=3)
    ax.plot(*_START, "o", color="0.15", markersize=10, zorder=3)

    def side(name: str, where: str, shift: float = 0.0) -> tuple[float, float]:
        """A point on a box's edge: 'l', 'r', 't', 'b', moved along the edge by ``shift``."""
        x, y, _ = _BOXES[name]
        return {
            "l": (x - _W / 2, y + shift),
            "r": (x + _W / 2, y + shift),
            "t": (x + shift, y + _H / 2),
            "b": (x + shift, y - _H / 2),
        }[where]

    def arrow(
        start: tuple[float, float], end: tuple[float, float], rad: float = 0.0, style: str = ""
    ) -> None:
        ax.annotate(
            "",
            xy=end,
            xytext=start,
            zorder=1,
            arrowprops={
                "arrowstyle": "-|>",
                "mutation_scale": 16,
                "color": "0.2",
                "lw": 1.4,
                "shrinkA": 2,
                "shrinkB": 2,
                "connectionstyle": style or f"arc3,rad={rad}",
            },
        )

    def label(x: float, y: float, key: tuple[str | None, str], **kw: Any) -> None:
        ax.text(x, y, _LABELS[key], **({"ha": "center", "va": "center", "fontsize": 9.5} | kw))

    # enqueue
    arrow((_START[0] + 0.15, 0.0), side("ready", "l"))
    label(-1.75, 0.3, (None, "ready"), va="bottom")
    # claim, straight, above the centre line; the three ways back, an arc below it
    arrow(side("ready", "r", 0.2), side("running", "l", 0.2))
    label(2.5, 0.4, ("ready", "running"), va="bottom")
    arrow(side("running", "b", -0.3), side("ready", "b", 0.3), rad=-0.45)
    label(2.5, -1.6, ("running", "ready"), va="top", multialignment="left")
    # heartbeat: a loop over running's right shoulder
    arrow(side("running", "t", 0.15), side("running", "t", 0.6), rad=-3.0)
    label(5.95, 1.0, ("running", "running"), va="bottom", ha="left")
    # done and dead
    arrow(side("running", "r"), side("done", "l"))
    label(7.5, 0.15, ("running", "done"), va="bottom")
    arrow(side("running", "r", -0.25), side("dead", "t", -0.4))
    label(7.9, -0.75, ("running", "dead"), ha="left", va="top", multialignment="left")
    # cancel, from both live statuses
    arrow(side("ready", "t", 0.3), side("cancelled", "l"))
    label(0.45, 2.1, ("ready", "cancelled"), ha="right")
    arrow(side("running", "t", -0.3), side("cancelled", "r"))
    label(4.55, 2.1, ("running", "cancelled"), ha="left")
    # retry_dead: under everything, from dead back to ready
    dead_x, dead_y, _ = _BOXES["dead"]
    floor = -4.0
    ax.plot(
        [dead_x, dead_x, -0.5],
        [dead_y - _H / 2, floor, floor],
        color="0.2",
        lw=1.4,
        zorder=1,
        solid_joinstyle="miter",
    )
    arrow((-0.5, floor), side("ready", "b", -0.5))
    label(4.75, floor - 0.12, ("dead", "ready"), va="top")

    ax.set_title(
        "A job's life: five statuses, and the statement of queries.sql on each arrow",
        fontsize=13,
    )
    ax.legend(
        handles=[
            Patch(facecolor=_BOXES["ready"][2], edgecolor="0.25", label="live: ready, running"),
            Patch(facecolor=_BOXES["done"][2], edgecolor="0.25", label="done"),
            Patch(facecolor=_BOXES["cancelled"][2], edgecolor="0.25", label="cancelled"),
            Patch(facecolor=_BOXES["dead"][2], edgecolor="0.25", label="dead (retry_dead revives)"),
        ],
        loc="upper right",
        fontsize=9,
        frameon=False,
    )
    fig.text(0.02, 0.015, _CAPTION, fontsize=8.5, ha="left", va="bottom", color="0.2")
    return list(TRANSITIONS)
