"""Checks for notebook 07, polling and LISTEN/NOTIFY: what an idle worker costs, with
hints in tiers (how the count differs from the worker's first, the rule it misses after)."""

from __future__ import annotations

import math
from collections.abc import Callable

from .. import lab, polling
from . import expect, passed
from .tiers import Hints

# (concurrency, queues, poll_interval, reap_interval): settings the formula is tried on.
CASES = [(1, 1, 2.0, 5.0), (4, 1, 0.1, 5.0), (1, 3, 1.0, 5.0), (2, 2, 0.25, 0.5), (3, 2, 0.5, 1.0)]
LIVE = (2, 2, 0.25, 0.5)  # the setting measured on a real worker
SECONDS = 2.0  # the live window
# Measured against predicted: polls and reaps can come late on a busy machine (a claim's
# time, a thread woken late), never early, so the live rate may fall well below the model
# and rise only a little above it (a statement more at either edge of the window).
LOW, HIGH = 0.5, 1.3


def _reference(concurrency: int, queues: int, poll: float, reap: float) -> float:
    return queues / poll + 1 / reap


# Plausible slips: (formula, kind, what it shows against the worker, the rule it misses).
_SLIPS: list[tuple[Callable[[int, int, float, float], float], str, str, str]] = [
    (
        lambda c, q, p, r: q / p,
        "reaper",
        "your count matches the worker's claims alone, but its log also has reaps",
        "the worker also runs the reap statement once every reap_interval seconds, work or no "
        "work: + 1 / reap_interval",
    ),
    (
        lambda c, q, p, r: c * q / p + 1 / r,
        "per-lane",
        "your count grows with concurrency, but the worker's claims are the same for 1 lane or 4",
        "the lanes do not poll on their own: one dispatcher claims for the whole worker "
        "whenever a lane is free, so concurrency does not multiply the claims",
    ),
    (
        lambda c, q, p, r: 1 / p + 1 / r,
        "queues",
        "your count is the same for 1 queue or 3, but the worker's claims grow with its queues",
        "the dispatcher asks each queue in turn, one claim statement per queue per poll: "
        "queues / poll_interval",
    ),
    (
        lambda c, q, p, r: q / p + c / r,
        "reap-per-lane",
        "your reaps grow with concurrency, but the worker's do not",
        "the reaper runs once per worker, not once per lane: 1 / reap_interval",
    ),
    (
        lambda c, q, p, r: q / p + 1 / r + 3 / 30,
        "heartbeats",
        "your count is 0.1 a second above the worker's, and an idle worker's log has no heartbeats",
        "an idle worker holds no job, so it sends no heartbeats: they come only while a job "
        "is held",
    ),
    (
        lambda c, q, p, r: q * p + 1 / r,
        "interval",
        "your claims grow as poll_interval grows, but the worker's fall",
        "the dispatcher claims once every poll_interval seconds: that is 1 / poll_interval "
        "claims a second per queue, not poll_interval",
    ),
]
HINTS = Hints()


def check_idle_formula(formula: Callable[[int, int, float, float], float]) -> None:
    """Compare ``formula(concurrency, queues, poll_interval, reap_interval)`` (statements per
    second of an idle worker; ``queues`` is how many queues it serves) with the worker's
    rules, then with a real idle worker."""
    hints = HINTS
    expect(
        callable(formula),
        "idle_statements_per_s should be a function of "
        "(concurrency, queues, poll_interval, reap_interval)",
    )
    for case in CASES:
        c, q, p, r = case
        try:
            got = float(formula(*case))
        except TypeError as exc:
            hints.fail(
                "queues-count",
                f"idle_statements_per_s{case} raised TypeError: {exc}",
                f"queues is how many queues the worker serves, a number ({q} here; 2 for "
                'queue=["emails", "reports"]), not the list of their names',
            )
        except Exception as exc:
            expect(False, f"idle_statements_per_s{case} raised {type(exc).__name__}: {exc}")
        want = _reference(*case)
        if math.isclose(got, want, rel_tol=0.02):
            continue
        setting = (
            f"for concurrency={c}, queues={q}, poll_interval={p:g}, reap_interval={r:g} your "
            f"formula gives {got:.3g} statements/s, the worker sends {want:.3g}"
        )
        for slip, kind, symptom, rule in _SLIPS:
            if math.isclose(got, slip(*case), rel_tol=0.02):
                hints.fail(kind, f"{setting}: {symptom}", rule)
        hints.fail(
            "other",
            setting,
            "count the worker's claims (one per queue per poll) and its reaps (one per "
            "reap_interval, for the whole worker)",
        )
    c, q, p, r = LIVE
    predicted = float(formula(*LIVE))
    names = [f"q{i}" for i in range(1, q + 1)]
    with lab.scratch_database("course_07_exercise") as dsn:
        rates = polling.idle_statements(
            dsn, concurrency=c, queues=names, poll_interval=p, reap_interval=r, seconds=SECONDS
        )
    measured = sum(rates.values())
    edge = 2 / SECONDS  # a claim and a reap more or fewer at the window's edges
    detail = ", ".join(f"{kind} {rate:.1f}/s" for kind, rate in sorted(rates.items()))
    hints.expect(
        LOW * predicted - edge <= measured <= HIGH * predicted + edge,
        "live",
        f"a real worker ({c} lanes, {q} queues, poll {p:g} s, reap {r:g} s) sent "
        f"{measured:.1f} statements/s ({detail}); your formula says {predicted:.1f}",
        "count only what an idle worker sends: its claims and its reaps",
    )
    passed(
        f"your formula predicts {predicted:g} statements/s for {c} lanes on {q} queues "
        f"(poll {p:g} s, reap {r:g} s), and a real idle worker sent about that (fewer only "
        "when a busy machine makes its polls come late)"
    )
