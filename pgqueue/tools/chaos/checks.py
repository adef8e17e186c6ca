"""The chaos run's checks, judged from the database alone, and the report they fill in.

Afterwards, from the database alone: every job is ``done`` or ``dead``; fence >=
attempts everywhere; every done job's result carries its final fence; the fences a
result row accepted only ever went up; and the extra attempts (jobs run more than
once) stay within what the faults can explain: each kill, stop or terminate costs at
most the jobs its victim held, a restart at most those of every worker process. A worker
(one lane, batch 1) holds at most two: the job its lane runs, and the one before it whose
completion is still on its way (the engine claims beside that statement, not after it).
The workers' logs are read only for tracebacks and refused late writes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...rules import holds_at_most
from .faults import KINDS
from .workers import APP_PREFIX, read_log
from .workload import Session

# The most jobs one chaos worker (the CLI's defaults, one lane and batch 1, either kind of
# handler) holds: the one it runs, and one whose completion is on its way.
HELD = holds_at_most(batch=1, concurrency=1, plain=True)[1]


def fault_costs(workers: int) -> dict[str, int]:
    """The most extra attempts one fault of each kind can cause: the jobs its victim holds,
    or those of every worker for a restart."""
    return {"kill": HELD, "stop": HELD, "terminate": HELD, "restart": HELD * workers}


@dataclass
class Report:
    """What happened and what the database says about it."""

    seed: int
    queue: str
    workers: int
    jobs: int
    lease: float
    restart_enabled: bool
    faults: Counter[str] = field(default_factory=Counter)  # kind -> times injected
    backends_terminated: int = 0
    skipped: list[str] = field(default_factory=list)  # faults that found no target
    unexpected_exits: list[str] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    rerun_jobs: int = 0  # jobs with attempts > 1
    extra_attempts: int = 0  # sum of (attempts - 1)
    bound: int = 0  # the most extra attempts the injected faults can explain
    causes: Counter[str] = field(default_factory=Counter)  # lost attempt -> likely fault
    superseded_writes: int = 0  # accepted results later overwritten by a newer fence
    refused_in_logs: int = 0  # late writes the workers reported as refused
    idle_in_transaction: int = 0  # most worker sessions seen idle in a transaction
    checks: dict[str, str] = field(default_factory=dict)  # name -> "" if passed, else why
    seconds: float = 0.0
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return not any(self.checks.values())


def idle_in_transaction(session: Session) -> int:
    """How many worker sessions are idle in a transaction right now (sampled during the run)."""
    rows = session.sql(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE state LIKE 'idle in transaction%%' AND application_name LIKE %s",
        [APP_PREFIX + "chaos-%"],
    )
    return int(rows[0][0])


def check(r: Report, session: Session) -> None:
    """Judge the run from the database (and the workers' logs for tracebacks): fill in
    ``r``'s counts and checks. ``r`` already holds what was injected and seen."""
    log_dir = Path(r.log_dir)
    jobs = session.sql(
        "SELECT j.id, j.status, j.attempts, j.max_attempts, j.fence, c.fence, c.history "
        "FROM jobs j LEFT JOIN chaos_results c ON c.job_id = j.id "
        "WHERE j.queue = %s ORDER BY j.id",
        [r.queue],
    )
    r.statuses = Counter(row[1] for row in jobs)
    r.rerun_jobs = sum(row[2] > 1 for row in jobs)
    r.extra_attempts = sum(max(row[2] - 1, 0) for row in jobs)
    r.superseded_writes = sum(len(row[6]) - 1 for row in jobs if row[6])
    r.bound = sum(r.faults[kind] * cost for kind, cost in fault_costs(r.workers).items())

    def failing(rows: list[tuple[Any, ...]], what: str) -> str:
        ids = ", ".join(str(row[0]) for row in rows[:10])
        return f"{len(rows)} jobs {what} (ids {ids})" if rows else ""

    r.checks["every job enqueued"] = (
        "" if len(jobs) == r.jobs else f"{len(jobs)} jobs of {r.jobs} found"
    )
    r.checks["every job done or dead"] = failing(
        [j for j in jobs if j[1] not in ("done", "dead")], "neither done nor dead"
    )
    r.checks["no job running"] = failing([j for j in jobs if j[1] == "running"], "running")
    # Each claim raises fence and attempts together; a release gives the attempt back and
    # a fail raises the fence again, so the fence never falls below attempts.
    r.checks["fence >= attempts"] = failing([j for j in jobs if j[4] < j[2]], "fence < attempts")
    r.checks["dead only at max_attempts"] = failing(
        [j for j in jobs if j[1] == "dead" and j[2] < j[3]], "dead early"
    )
    r.checks["done jobs carry their final fence"] = failing(
        [j for j in jobs if j[1] == "done" and j[5] != j[4]],
        "done without a result at the final fence",
    )
    r.checks["no stale write accepted"] = failing(
        [
            j
            for j in jobs
            if j[6]
            and (
                any(a >= b for a, b in zip(j[6], j[6][1:], strict=False))
                or j[6][-1] != j[5]
                or j[5] > j[4]
            )
        ],
        "whose accepted fences did not only go up",
    )
    r.checks["re-runs explained by faults"] = (
        ""
        if r.extra_attempts <= r.bound
        else f"{r.extra_attempts} extra attempts > {r.bound} the faults can explain"
    )
    r.checks["no worker idle in transaction"] = (
        f"{r.idle_in_transaction} seen" if r.idle_in_transaction else ""
    )
    r.checks["no worker exited by itself"] = "; ".join(r.unexpected_exits)
    tracebacks = [p.name for p in sorted(log_dir.glob("*.log")) if "Traceback" in read_log(p)]
    r.checks["no traceback in worker logs"] = ", ".join(tracebacks)
    r.refused_in_logs = sum(read_log(p).count("refused: fence") for p in log_dir.glob("*.log"))
    r.causes = attribute(session, r.queue, jobs)


def attribute(session: Session, queue: str, jobs: list[tuple[Any, ...]]) -> Counter[str]:
    """Name the likely fault behind each lost attempt: the first fault against the
    worker that started it (or a restart) between its start and the next attempt's.
    Attempts are taken in the order they started: fences are no attempt numbers (a fail
    or a release moves the fence without a run)."""
    starts: dict[int, list[tuple[str, Any]]] = {}
    for j, w, at in session.sql(
        "SELECT DISTINCT ON (r.job_id, r.fence) r.job_id, r.worker, r.started_at "
        "FROM chaos_runs r JOIN jobs j ON j.id = r.job_id "
        "WHERE j.queue = %s ORDER BY r.job_id, r.fence, r.started_at",
        [queue],
    ):
        starts.setdefault(j, []).append((w, at))
    faults = session.sql(
        "SELECT kind, worker, extract(epoch FROM at) FROM chaos_faults WHERE run = %s ORDER BY at",
        [queue],
    )
    causes: Counter[str] = Counter()
    for job_id, status, attempts, *_ in jobs:
        lost = attempts if status == "dead" else attempts - 1
        runs = sorted(starts.get(job_id, []), key=lambda run: run[1])
        lost_runs = runs if status == "dead" else runs[:-1]  # a done job's last run finished it
        causes["cut before the handler started"] += max(0, lost - len(lost_runs))
        for n, (worker, at) in enumerate(lost_runs[:lost]):
            begun = at.timestamp() - 1.0
            until = runs[n + 1][1].timestamp() if n + 1 < len(runs) else math.inf
            kind = next(
                (
                    k
                    for k, w, at_ in faults
                    if (w == worker or k == "restart") and begun <= float(at_) <= until
                ),
                "unattributed",
            )
            causes[kind] += 1
    return causes


def summary(report: Report) -> str:
    """The report as a few lines of text, ending with PASS or FAIL."""
    f = report.faults
    kinds = ", ".join(f"{k} {f[k]}" for k in KINDS if k != "restart" or report.restart_enabled)
    lines = [
        f"faults injected: {kinds} ({report.backends_terminated} sessions terminated)"
        + ("" if report.restart_enabled else "; restart skipped: --dsn given"),
        "jobs: "
        + ", ".join(f"{n} {s}" for s, n in sorted(report.statuses.items()))
        + f"; {report.rerun_jobs} ran more than once ({report.extra_attempts} extra attempts,"
        f" at most {report.bound} explainable: {HELD} per kill, stop and terminate"
        + (f", {HELD * report.workers} per restart)" if report.restart_enabled else ")"),
        "lost attempts by likely cause: "
        + (", ".join(f"{k} {n}" for k, n in report.causes.most_common()) or "none"),
        f"results overwritten by a newer fence: {report.superseded_writes}; "
        f"late writes refused (worker logs): {report.refused_in_logs}",
    ]
    if report.skipped:
        lines.append("skipped: " + "; ".join(report.skipped))
    for name, problem in report.checks.items():
        lines.append(
            f"  {'FAIL' if problem else 'ok  '} {name}" + (f": {problem}" if problem else "")
        )
    lines.append(f"{'PASS' if report.ok else 'FAIL'} in {report.seconds:.0f}s")
    if not report.ok:
        lines.append(f"worker logs: {report.log_dir}")
    return "\n".join(lines)
