"""Checks for notebook 10: choosing a lease from measured stalls and a recovery budget."""

from __future__ import annotations

import math
import numbers

from ..production import lost_fraction, stall_sample
from . import expect, passed

LOSS_BUDGET = 0.001  # at most one stall in a thousand may cost a healthy job its lease


def check_lease(lease: object, *, reap_interval: float, recovery_budget: float) -> None:
    """The lease survives the stalls of a fresh week (at most one in a thousand costs a
    healthy job) and gets a crashed worker's job running again within the budget."""
    expect(
        isinstance(lease, numbers.Real) and not isinstance(lease, bool) and math.isfinite(lease),
        f"lease should be a number of seconds, got {lease!r}",
    )
    assert isinstance(lease, numbers.Real)
    expect(lease > 0, f"lease should be more than 0 seconds, got {lease:g}")
    recovery = lease + reap_interval
    expect(
        recovery <= recovery_budget,
        f"with a {lease:.1f} s lease a crashed worker's job waits up to {recovery:.1f} s "
        f"(lease + reap interval), over the {recovery_budget:g} s budget: heartbeats already "
        "cover long jobs, so size the lease from the stalls, not from the job durations",
    )
    # Stalls the reader has not seen: a week of them from the same model, another seed.
    week = stall_sample(200_000, seed=2024)
    lost = lost_fraction(lease, week)
    expect(
        lost <= LOSS_BUDGET,
        f"with a {lease:.1f} s lease {lost:.2%} of a fresh week's stalls cost a healthy job "
        f"(budget {LOSS_BUDGET:.1%}): a job is lost when the time since its last heartbeat "
        "(up to lease/3) plus the stall reaches the lease; add that, and a margin",
    )
    passed(
        f"lease {lease:.1f} s: {lost:.3%} of a fresh week's stalls cost a healthy job "
        f"(budget {LOSS_BUDGET:.1%}); a crashed worker's job runs again within "
        f"{recovery:.1f} s (budget {recovery_budget:g} s)"
    )
