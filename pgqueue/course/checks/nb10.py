"""Checks for notebook 10: the bound on re-runs, predicted from a chaos run's fault plan."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from ...tools.chaos import Fault, Report, min_duration, plan
from . import expect, passed

# One extra attempt per fault that hits one worker; a restart hits every worker at once.
_COST = {"kill": 1, "stop": 1, "terminate": 1}


def _expected(faults: list[Fault], workers: int) -> int:
    kinds = Counter(f.kind for f in faults)
    return sum(kinds[k] * c for k, c in _COST.items()) + kinds["restart"] * workers


def _describe(faults: list[Fault]) -> str:
    kinds = Counter(f.kind for f in faults)
    return ", ".join(f"{kinds[k]} {k}" for k in ("kill", "stop", "terminate", "restart"))


def check_bound(explainable: Callable[[list[Fault], int], Any], report: Report) -> None:
    """``explainable(faults, workers)`` gives the most extra attempts a fault plan can cause:
    right on other plans (with and without a restart), and at least what the run caused."""
    lease = report.lease
    for seed, workers, restart in ((1, 2, True), (2, 5, True), (3, 4, False), (4, 3, True)):
        faults = plan(seed, 3 * min_duration(lease), workers, lease, restart=restart)
        got, want = explainable(list(faults), workers), _expected(faults, workers)
        expect(
            got == want,
            f"a plan with {_describe(faults)} and {workers} workers: explainable says {got!r}, "
            f"the most it can cause is {want}: a kill, stop or cut costs the one job its victim "
            "held; a restart, one job per worker",
        )
    ran = report.faults  # what was injected (a scheduled fault that found no target is not)
    injected = [Fault(0.0, kind) for kind, n in ran.items() for _ in range(n)]
    bound = explainable(injected, report.workers)
    expect(
        bound == report.bound,
        f"for the faults this run injected ({_describe(injected)}) explainable says {bound!r}; "
        f"the report's bound is {report.bound}",
    )
    expect(
        report.extra_attempts <= bound,
        f"the run had {report.extra_attempts} extra attempts, more than your bound {bound}",
    )
    passed(
        f"bound {bound} for {_describe(injected)} with {report.workers} workers; the run "
        f"caused {report.extra_attempts} extra attempts"
    )
