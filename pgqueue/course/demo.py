"""``pgqueue demo``: the paused-worker story, told by a real database in a few seconds."""

from __future__ import annotations

import time

from ..events import Event, EventLog
from ..job import Job
from ..queue import Queue
from ..worker import Worker
from .faults import FaultyWorker

QUEUE = "demo"

_SAY = {
    "claim": "claims job {job_id} and gets fence {fence}",
    "pause": "freezes (a GC pause, a VM migration) for {detail} s",
    "reap": "reaper: the lease ran out, job {job_id} is {detail} again",
    "fenced-write": "writes the report with fence {fence}: accepted",
    "fenced-write-rejected": "writes the report with fence {fence}: REFUSED (stale fence)",
    "complete": "completes job {job_id} with fence {fence}: accepted",
    "complete-rejected": "completes job {job_id} with fence {fence}: REFUSED (0 rows)",
    "lease-lost": "heartbeat finds job {job_id} gone: fence {fence} is stale",
}


def run_demo(dsn: str, *, pause: float = 2.0, lease: float = 1.0, tidy: bool = False) -> EventLog:
    """Worker A claims and freezes past its lease; B takes over; A's late writes bounce."""
    with Queue(dsn) as q:
        q.install()
        q.conn.execute(
            "CREATE TABLE IF NOT EXISTS demo_reports (id int PRIMARY KEY, body text, fence bigint);"
            # Job.fenced_write stores the job id too; a table left by an older demo lacks it.
            "ALTER TABLE demo_reports ADD COLUMN IF NOT EXISTS job_id bigint"
        )
        q.conn.execute("DELETE FROM demo_reports")
        q.conn.execute("DELETE FROM jobs WHERE queue = %s", [QUEUE])
        job_id = q.enqueue({"report": 1}, queue=QUEUE)

        def write_report(job: Job) -> None:
            job.fenced_write("demo_reports", {"id": 1}, {"body": f"written by fence {job.fence}"})

        events = EventLog()
        b_starts = lease * 1.6
        print(
            f"lease {lease:g} s: a worker that does not renew it in time loses the job.\n"
            f"A freezes for {pause:g} s right after its claim (its lease ends while it "
            f"sleeps); B starts at {b_starts:.1f} s.\n"
        )
        common = dict(queue=QUEUE, dsn=dsn, lease=lease, poll_interval=0.1, reap_interval=0.2)
        a = FaultyWorker(write_report, name="A", events=events, **common)  # type: ignore[arg-type]
        a.pause_on_next_claim(pause)
        a.start()
        time.sleep(b_starts)
        b = Worker(write_report, name="B", events=events, **common).start()  # type: ignore[arg-type]
        time.sleep(pause)
        a.stop(grace=2)
        b.stop(grace=2)

        for t, worker, line in _story(events.events(), lease):
            print(f"{t - events.started:6.2f}s  {worker:>2}  {line}")
        body, fence = q.conn.execute("SELECT body, fence FROM demo_reports").fetchone() or ("", 0)
        status, final = q.conn.execute(
            "SELECT status, fence FROM jobs WHERE id = %s", [job_id]
        ).fetchone() or ("?", 0)
        print(f"\njob {job_id}: {status}, fence {final}; report: {body!r} (fence {fence})")
        print("A woke up late, but every write it made carried fence 1 and changed nothing.")
        if tidy:  # leave nothing of the demo in a database that is not its own
            q.conn.execute("DROP TABLE demo_reports")
            q.conn.execute("DELETE FROM jobs WHERE queue = %s", [QUEUE])
    return events


def _story(events: list[Event], lease: float) -> list[tuple[float, str, str]]:
    """The timeline's lines: what the events say, plus when A's lease ends and when it
    wakes (known from its claim and its pause, so marked 'about')."""
    lines = [(e.t, e.worker, _SAY[e.kind].format(**e._asdict())) for e in events if e.kind in _SAY]
    claims = {e.worker: e for e in events if e.kind == "claim"}
    for e in events:
        if e.kind == "pause" and e.worker in claims:
            claim, seconds = claims[e.worker], float(e.detail)
            lines.append(
                (claim.t + lease, e.worker, f"(about now its lease on job {claim.job_id} ends)")
            )
            lines.append((e.t + seconds, e.worker, f"wakes up after {seconds:g} s, unaware"))
    return sorted(lines, key=lambda line: line[0])
