"""Checks for notebook 17: the bound on re-runs, predicted from a chaos run's fault plan, with
hints in tiers (the plan and its true bound first, the rule missed at the second slip)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from ...tools.chaos import Fault, Report, min_duration, plan
from ...tools.chaos.checks import HELD, fault_costs
from . import passed
from .tiers import Hints

HINTS = Hints()
PLAN_LEASE = 2.0  # seconds: the lease the plans are drawn for when no run's report is given

# A fault that hits one worker costs at most the attempts of the jobs it holds (HELD: the
# one its lane runs, and the one before it whose completion is still on its way); a
# restart hits every worker at once.
_ONE_WORKER = ("kill", "stop", "terminate")


def _expected(faults: list[Fault], workers: int) -> int:
    kinds = Counter(f.kind for f in faults)
    return sum(kinds[kind] * cost for kind, cost in fault_costs(workers).items())


def _describe(faults: list[Fault]) -> str:
    kinds = Counter(f.kind for f in faults)
    return ", ".join(f"{kinds[k]} {k}" for k in ("kill", "stop", "terminate", "restart"))


def _slip(faults: list[Fault], workers: int, got: object) -> tuple[str, str]:
    """The kind of mistake behind a wrong bound, and the rule it misses."""
    kinds = Counter(f.kind for f in faults)
    one_each, restarts = sum(kinds[k] for k in _ONE_WORKER), kinds["restart"]
    if got == one_each + restarts * workers:
        return "one-job", (
            "a worker claims its next job while the last one's completion is still on its way: "
            "it may hold two jobs when a fault strikes, and lose both attempts"
        )
    if got == HELD * (one_each + restarts):
        return "restart-one", (
            "a restart cuts every worker's session at once: up to two lost attempts per worker"
        )
    if got == HELD * one_each:
        return "restart-none", (
            "a restart costs too: every worker may lose the jobs it held when its session is cut"
        )
    if got == HELD * (one_each + restarts) * workers:
        return "per-worker", (
            "a kill, a stop or a cut hits one worker, which holds at most two jobs: two "
            "attempts each"
        )
    if isinstance(got, int) and got < _expected(faults, workers):
        return "missed", (
            "count every kind of fault: a kill, a stop and a cut (terminate) cost two attempts "
            "each; a restart, two per worker"
        )
    return "other", (
        "a kill, stop or cut costs the two jobs its victim may hold; a restart, two per worker"
    )


def check_bound(
    explainable: Callable[[list[Fault], int], Any], report: Report | None = None
) -> None:
    """``explainable(faults, workers)`` gives the most extra attempts a fault plan can cause:
    right on other plans (with and without a restart), and, given a chaos run's ``report``,
    at least what that run caused. Without ``report`` it checks the plans alone (it can
    then sit right after the exercise, before the chaos run)."""
    hints = HINTS
    lease = report.lease if report is not None else PLAN_LEASE
    for seed, workers, restart in ((1, 2, True), (2, 5, True), (3, 4, False), (4, 3, True)):
        faults = plan(seed, 3 * min_duration(lease), workers, lease, restart=restart)
        got, want = explainable(list(faults), workers), _expected(faults, workers)
        if got != want:
            kind, rule = _slip(faults, workers, got)
            hints.fail(
                kind,
                f"a plan with {_describe(faults)} and {workers} workers: explainable says "
                f"{got!r}, but that plan can cost up to {want} extra attempts",
                rule,
            )
    if report is None:
        passed(
            "explainable gives the most extra attempts of four fault plans, with and "
            "without a restart"
        )
        return
    ran = report.faults  # what was injected (a scheduled fault that found no target is not)
    injected = [Fault(0.0, kind) for kind, n in ran.items() for _ in range(n)]
    bound = explainable(injected, report.workers)
    hints.expect(
        bound == report.bound,
        "report",
        f"for the faults this run injected ({_describe(injected)}) explainable says {bound!r}; "
        f"the report's bound is {report.bound}",
        "count the faults the run injected, report.faults, not the ones it planned",
    )
    hints.expect(
        report.extra_attempts <= bound,
        "below-run",
        f"the run had {report.extra_attempts} extra attempts, more than your bound {bound}",
        "a bound is the most the faults can cost: count each fault at its worst",
    )
    passed(
        f"bound {bound} for {_describe(injected)} with {report.workers} workers; the run "
        f"caused {report.extra_attempts} extra attempts"
    )
