"""Many reapers at once on the same expired jobs, as on a fleet where every host reaps.

``race`` starts one thread per reaper, each with a connection of its own (``Queue.reap``,
the library's statement), released together and looping until no job is running any more;
it returns which jobs each reaper returned. ``plot_waves`` draws, per wave of expiring
leases, which reaper returned its jobs. Teaching aids, not the queue."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..queue import Queue

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_waves", "race"]

LEFT = "SELECT EXISTS (SELECT FROM jobs WHERE status = 'running')"


def race(dsn: str, reapers: int) -> dict[int, list[int]]:
    """Run ``reapers`` reapers at once until no job of database ``dsn`` is running; return
    the ids each one returned, by reaper number."""
    queues = [Queue(dsn, application_name=f"reaper {i}") for i in range(reapers)]
    returned: dict[int, list[int]] = {i: [] for i in range(reapers)}
    start = threading.Barrier(reapers)

    def reap_until_none_running(i: int) -> None:
        start.wait()
        while True:
            got = queues[i].reap()
            returned[i] += [row.id for row in got]
            row = queues[i].conn.execute(LEFT).fetchone()
            if not got and not (row and row[0]):
                return

    threads = [threading.Thread(target=reap_until_none_running, args=(i,)) for i in range(reapers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for queue in queues:
            queue.close()
    return returned


def plot_waves(returned: dict[int, list[int]], waves: int, first_out: int) -> Figure:
    """Jobs returned per wave (job id modulo ``waves``), stacked by reaper; wave ``w``'s
    leases ran out ``(w - first_out) / 10`` seconds after the reapers started."""
    import matplotlib.pyplot as plt
    import pandas as pd

    rows = [(reaper, job_id % waves) for reaper, ids in returned.items() for job_id in ids]
    frame = pd.DataFrame(rows, columns=["reaper", "wave"])
    by_wave = pd.crosstab(frame.wave, frame.reaper).reindex(columns=sorted(returned), fill_value=0)
    offsets = (by_wave.index - first_out) * 0.1
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bottom = 0
    for reaper in by_wave.columns:
        ax.bar(offsets, by_wave[reaper], bottom=bottom, width=0.08, label=f"reaper {reaper}")
        bottom = bottom + by_wave[reaper]
    ax.set_title("Which reaper returned each wave of expired leases (each job once)")
    ax.set_xlabel("lease ran out, seconds after the leases were set (the reapers start then)")
    ax.set_ylabel("jobs returned")
    ax.set_ylim(0, by_wave.sum(axis=1).max() * 1.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    return fig
