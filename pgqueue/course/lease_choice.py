"""Choosing the lease, drawn: what a longer or shorter lease costs, the measured stalls
against the job durations, and a lease checked against a fresh week of stalls.

The samples and the simulation live in ``pgqueue.course.production``; this module only
draws them, so the lesson's cells stay short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..options import WorkerOptions
from .production import lost_fraction

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_LEASE = WorkerOptions.__dataclass_fields__["lease"].default  # pgqueue's default, s


def plot_tradeoff(*, reap_interval: float, running: int = 1000) -> Figure:
    """Left: how long a crashed job waits (lease + reap interval) and the longest stall a
    healthy worker surely survives (2/3 of the lease, heartbeat every lease/3). Right: the
    heartbeat row updates per second of ``running`` jobs. Both against the lease."""
    import matplotlib.pyplot as plt

    leases = np.geomspace(3, 600, 50)  # seconds
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(
        leases,
        leases + reap_interval,
        color="C3",
        label="crashed job waits up to (lease + reap interval)",
    )
    left.plot(
        leases, 2 * leases / 3, color="C2", label="stall a healthy worker survives (2/3 lease)"
    )
    right.plot(
        leases,
        running * 3 / leases,
        color="C0",
        label=f"{running} running jobs, heartbeat every lease/3",
    )
    titles = (
        ("time (s)", "Longer leases tolerate longer stalls, recover crashes later"),
        ("heartbeat row updates per second (1/s)", "Shorter leases cost more heartbeats"),
    )
    for ax, (ylabel, title) in zip((left, right), titles, strict=True):
        ax.axvline(
            DEFAULT_LEASE, color="0.5", ls=":", label=f"pgqueue default: {DEFAULT_LEASE:g} s"
        )
        ax.set(xscale="log", yscale="log", xlabel="lease (s)", ylabel=ylabel, title=title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_samples(stalls: np.ndarray, durations: np.ndarray) -> Figure:
    """The two samples as histograms on one log axis, each with its 99th percentile."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    bins = np.geomspace(0.005, 2000, 70)
    ax.hist(stalls, bins=bins, alpha=0.6, color="C1", label="stalls of healthy workers")
    ax.hist(durations, bins=bins, alpha=0.5, color="C0", label="job durations")
    for sample, color, what in ((stalls, "C1", "stall"), (durations, "C0", "job")):
        p99 = np.percentile(sample, 99)
        ax.axvline(p99, color=color, ls="--", lw=1, label=f"{what} p99: {p99:.1f} s")
    ax.set(
        xscale="log",
        xlabel="duration (s, log scale)",
        ylabel="measurements (count)",
        title="A day of stalls and of job durations (seeded model)",
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_check(
    lease: float,
    week: np.ndarray,
    *,
    loss_budget: float,
    recovery_budget: float,
    reap_interval: float,
) -> Figure:
    """The share of ``week``'s stalls that cost a healthy job, against the lease, with the
    loss budget, the leases whose crash recovery is over budget, and ``lease`` marked."""
    import matplotlib.pyplot as plt

    candidates = np.geomspace(0.5, 300, 120)  # seconds
    lost = [lost_fraction(c, week) for c in candidates]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(candidates, lost, color="C1", label="healthy jobs lost per stall (simulated week)")
    ax.axhline(loss_budget, color="C1", ls=":", label=f"loss budget: 1 in {1 / loss_budget:,.0f}")
    ax.axvspan(
        recovery_budget - reap_interval,
        candidates[-1],
        color="C3",
        alpha=0.12,
        label="crash recovery over budget",
    )
    ax.axvline(lease, color="k", lw=1.5, label=f"your lease: {lease:.1f} s")
    ax.set(
        xscale="log",
        yscale="log",
        ylim=(1e-6, 1.5),
        xlabel="lease (s, log scale)",
        ylabel="share of stalls that lose a job",
        title="Too short loses healthy jobs; too long leaves crashed ones waiting",
    )
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig
