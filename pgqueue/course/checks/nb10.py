"""Checks for notebook 10: choosing a lease from measured stalls and a recovery budget, with
hints in tiers (what the simulated week showed first, the fix at the second slip of a kind)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..production import lost_fraction, stall_sample
from . import expect, passed
from .tiers import Hints

LOSS_BUDGET = 0.001  # at most one stall in a thousand may cost a healthy job its lease
HINTS = Hints()


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
    HINTS.expect(
        recovery <= recovery_budget,
        "recovery",
        f"with a {lease:.1f} s lease a crashed worker's job waits up to {recovery:.1f} s "
        f"(lease + reap interval), over the {recovery_budget:g} s budget",
        "heartbeats already carry long jobs: size the lease from the stalls, not from the job "
        "durations",
    )
    # Stalls the reader has not seen: a week of them from the same model, another seed.
    week = stall_sample(200_000, seed=2024)
    lost = lost_fraction(lease, week)
    alone = float(np.mean(week >= lease))  # stalls longer than the lease by themselves
    symptom = (
        f"with a {lease:.1f} s lease {lost:.2%} of a fresh week's stalls cost a healthy job "
        f"(budget {LOSS_BUDGET:.1%}); {alone:.2%} are longer than the lease by themselves, the "
        "rest lose it to the time since the last heartbeat"
    )
    # The reader's day of stalls (the notebook's sample): a lease under about twice its p99
    # has no margin for a tail that one day cannot show.
    day_p99 = float(np.percentile(stall_sample(10_000), 99))
    HINTS.expect(
        lost <= LOSS_BUDGET or lease >= 1.9 * day_p99,
        "margin",
        symptom,
        "a day's sample is short and its tail uncertain: multiply the stall p99 by a margin "
        "(2, say), then add the heartbeat gap",
    )
    HINTS.expect(
        lost <= LOSS_BUDGET,
        "heartbeat-gap",
        symptom,
        "a job is lost when the time since its last heartbeat (up to lease/3) plus the stall "
        "reaches the lease: solve margin x p99 + lease/3 = lease",
    )
    passed(
        f"lease {lease:.1f} s: {lost:.3%} of a fresh week's stalls cost a healthy job "
        f"(budget {LOSS_BUDGET:.1%}); a crashed worker's job runs again within "
        f"{recovery:.1f} s (budget {recovery_budget:g} s)"
    )
