"""The monitor's figure (``pgqueue.monitor``): the jobs by queue at the last look, ready
and running jobs over time, jobs finished per second, and the running jobs' leases with their
fences. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .monitor_looks import Counts, Snapshot, kept_jobs, side_notes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["draw"]

_COLORS = {"ready": "tab:blue", "running": "tab:orange", "dead": "0.2", "done": "tab:green"}
# What ended a watch (Monitor.stopped_by), as the figure's title says it.
_STOPS = {
    "seconds": "its time was up",
    "until": "until= was met",
    "interrupted": "interrupted",
    "stop": "stop()",
    "error": "a look failed",
}
# One color per queue when several are drawn, none of them a status's.
_QUEUE_COLORS = ["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]


def draw(
    snapshots: Sequence[Snapshot], *, stopped_by: str | None = None, fig: Figure | None = None
) -> Figure:
    """The monitor's figure from its looks: the jobs by queue at the last look, ready and
    running jobs over time, jobs finished per second, and the running jobs' leases (time
    left, fence) at the last look, or if none runs then at the look that saw the most.
    ``fig``: a figure to draw again (its axes are made anew)."""
    from matplotlib.figure import Figure

    snapshots = list(snapshots)  # one list throughout, while a watch may be adding to it
    if fig is None:
        fig = Figure(figsize=(11, 6.6), dpi=100)
    fig.clear()
    # Fixed margins, not a layout engine: a layout pass would cost a second drawing.
    grid = fig.add_gridspec(
        2, 3, height_ratios=[1.0, 1.1], width_ratios=[1.0, 1.25, 1.25], left=0.1, right=0.98
    )
    grid.update(top=0.9, bottom=0.08, hspace=0.45, wspace=0.3)
    queues = _queues_seen(snapshots)
    _draw_now(fig.add_subplot(grid[0, 0]), snapshots, queues)
    _draw_over_time(fig.add_subplot(grid[0, 1]), snapshots, queues)
    _draw_rate(fig.add_subplot(grid[0, 2]), snapshots, queues)
    _draw_leases(fig.add_subplot(grid[1, :]), snapshots, many=len(queues) > 1)
    fig.suptitle(_title(snapshots, stopped_by), fontsize=11)
    return fig


def _queues_seen(snapshots: Sequence[Snapshot], most: int = 6) -> list[str]:
    """The queues to draw: the busiest ``most`` seen (by their largest count)."""
    size: dict[str, int] = {}
    for s in snapshots:
        for queue, c in s.queues.items():
            size[queue] = max(size.get(queue, 0), kept_jobs(c) + c.finished)
    return sorted(sorted(size, key=lambda q: -size[q])[:most])


def _title(snapshots: Sequence[Snapshot], stopped_by: str | None) -> str:
    if not snapshots:
        return "pgqueue monitor: no look yet"
    last, done = snapshots[-1], sum(s.total.finished for s in snapshots)
    total = last.total
    said = (
        f"pgqueue monitor · {last.at:%H:%M:%S} on the database's clock · {last.t:.1f} s "
        f"watched · {total.ready} ready · {total.running} running · {total.dead} dead · "
        f"{done} finished"
    )
    said += f" · stopped: {_STOPS.get(stopped_by, stopped_by)}" if stopped_by else " · live"
    side = side_notes(last)  # schedules and limits, if the queues watched have any
    return said + ("\n" + " · ".join(side) if side else "")


def _draw_now(ax: Axes, snapshots: Sequence[Snapshot], queues: list[str]) -> None:
    last = snapshots[-1].queues if snapshots else {}
    ax.set_title("Now, by queue", fontsize=10)
    ax.set_xlabel("jobs (count)")
    if not queues:
        ax.text(0.5, 0.5, "no jobs yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        return
    height = 0.26
    most = 0
    for i, status in enumerate(("ready", "running", "dead")):
        values = [getattr(last.get(q, Counts()), status) for q in queues]
        ys = [row + (i - 1) * height for row in range(len(queues))]
        bars = ax.barh(ys, values, height=height, color=_COLORS[status], label=status)
        ax.bar_label(bars, padding=2, fontsize=7)
        most = max(most, *values)
    ax.set_yticks(range(len(queues)), queues)
    ax.set_ylim(len(queues) - 0.5, -0.5)
    ax.set_xlim(0, max(most, 1) * 1.25)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)


def _draw_over_time(ax: Axes, snapshots: Sequence[Snapshot], queues: list[str]) -> None:
    times = [s.t for s in snapshots]
    for n, queue in enumerate(queues):
        color = _QUEUE_COLORS[n] if len(queues) > 1 else None
        for status, style in (("ready", "-"), ("running", "--")):
            values = [getattr(s.queues.get(queue, Counts()), status) for s in snapshots]
            label = f"{queue} {status}" if len(queues) > 1 else status
            ax.plot(  # a count holds until the next look: steps, not slopes
                times,
                values,
                style,
                color=color or _COLORS[status],
                label=label,
                linewidth=1.5,
                drawstyle="steps-post",
            )
    ax.set_xlabel("time since the first look (s)")
    ax.set_ylabel("jobs (count)")
    ax.set_title("Ready and running", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if queues:
        ax.legend(fontsize=7, ncols=2 if len(queues) > 2 else 1)


def _draw_rate(ax: Axes, snapshots: Sequence[Snapshot], queues: list[str]) -> None:
    later = [s for s in snapshots if s.seconds > 0]
    edges = [s.t - s.seconds for s in later[:1]] + [s.t for s in later]  # each look's interval
    for n, queue in enumerate(queues if later else []):
        rates = [s.queues.get(queue, Counts()).finished / s.seconds for s in later]
        color = _QUEUE_COLORS[n] if len(queues) > 1 else _COLORS["done"]
        ax.stairs(rates, edges, color=color, label=queue, linewidth=1.5)
    done = sum(s.total.finished for s in snapshots)
    ax.set_xlabel("time since the first look (s)")
    ax.set_ylabel("jobs/s")
    ax.set_title(f"Finished per second ({done} since the first look)", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if len(queues) > 1:
        ax.legend(fontsize=7)


def _draw_leases(ax: Axes, snapshots: Sequence[Snapshot], *, many: bool) -> None:
    """One bar per running job: grey since its attempt began, then the lease left (red
    where it ran out), labelled with the job and its fence; the jobs whose leases end first
    on top. From the last look, or if it saw none running the look that saw the most (the
    latest of those; the title says which)."""
    last = snapshots[-1] if snapshots else None
    seen = last
    if last is not None and not last.leases:
        busiest = max(snapshots, key=lambda s: (len(s.leases), s.t))
        seen = busiest if busiest.leases else None
    ax.set_xlabel("seconds from the look (0): since the attempt began ← | → lease left")
    ax.grid(axis="x", alpha=0.3)
    if seen is None or last is None:
        ax.set_title("Running jobs and their leases", fontsize=10)
        ax.text(0.5, 0.5, "no job running", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        return
    when = "now" if seen is last else f"at {seen.t:.1f} s (none now; the most seen at once)"
    running = seen.total.running
    more = (
        f" (the {len(seen.leases)} of {running} whose leases end first)"
        if running > len(seen.leases)
        else ""
    )
    ax.set_title(f"Running jobs and their leases, {when}{more}", fontsize=10)
    rows = range(len(seen.leases))
    for row, lease in zip(rows, seen.leases, strict=True):
        if lease.running_for:
            ax.barh(row, -lease.running_for, color="0.8", height=0.6)
        if lease.left >= 0:
            ax.barh(row, lease.left, color=_COLORS["running"], height=0.6)
            said = f"{lease.left:.1f} s left"
        else:
            ax.barh(row, lease.left, color="tab:red", height=0.6)
            said = f"ran out {-lease.left:.1f} s ago: the reaper may take it"
        ax.annotate(
            f"  {said}",
            (max(lease.left, 0.0), row),
            va="center",
            fontsize=7,
            color="tab:red" if lease.left < 0 else "0.2",
        )
    names = [
        f"#{lease.id} f={lease.fence}" + (f" {lease.queue}" if many else "")
        for lease in seen.leases
    ]
    ax.set_yticks(list(rows), names, fontsize=8)
    ax.set_ylim(len(seen.leases) - 0.5, -0.5)
    ax.axvline(0, color="0.3", linewidth=1)
    longest = max(max(lease.left for lease in seen.leases), 0.0)
    oldest = max((lease.running_for or 0.0) for lease in seen.leases)
    ax.set_xlim(-max(oldest, 0.05 * longest, 0.1) * 1.05, max(longest, 0.1) * 1.3)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="0.8", label="running since"),
            Patch(color=_COLORS["running"], label="lease left (#job f=fence)"),
            Patch(color="tab:red", label="lease ran out"),
        ],
        fontsize=7,
        loc="lower right",
    )
