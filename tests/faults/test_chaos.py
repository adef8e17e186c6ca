"""The chaos run: real worker processes, real faults, promises checked from the database.

The long soak is ``pgqueue chaos --duration 600``; here a short run (about a minute)
with every fault kind injected at least once, and cheap checks of the schedule and CLI.
"""

from __future__ import annotations

import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import psycopg
import pytest

from pgqueue import Job, Queue, fenced_write
from pgqueue.tools import chaos

PGQUEUE = str(Path(sys.executable).with_name("pgqueue"))


def test_schedule_is_a_function_of_the_seed() -> None:
    """Same seed, same faults; another seed, another schedule."""
    assert chaos.plan(5, 60, 4, 2.0) == chaos.plan(5, 60, 4, 2.0)
    assert chaos.plan(5, 60, 4, 2.0) != chaos.plan(6, 60, 4, 2.0)


@pytest.mark.parametrize("seed", range(40))
def test_schedule_injects_every_fault_kind_once_in_time(seed: int) -> None:
    """Whatever the seed: every kind within 85 % of the shortest allowed run, one restart,
    stops longer than the lease and never overlapping, victims among the workers."""
    lease = 1.0 + seed % 4
    duration = chaos.min_duration(lease)
    faults = chaos.plan(seed, duration, 3, lease)
    assert {f.kind for f in faults} == set(chaos.KINDS)
    assert [f.kind for f in faults].count("restart") == 1
    assert all(f.at <= 0.85 * duration for f in faults)
    assert all(0 <= f.slot < 3 for f in faults)
    stops = [f for f in faults if f.kind == "stop"]
    assert all(f.hold > lease + chaos.REAP_INTERVAL for f in stops)
    assert all(a.at + a.hold < b.at for a, b in pairwise(stops))


def test_schedule_without_a_server_of_its_own_has_no_restart() -> None:
    """With --dsn the server is not ours to restart."""
    faults = chaos.plan(3, 60, 4, 2.0, restart=False)
    assert {f.kind for f in faults} == {"kill", "stop", "terminate"}


@pytest.mark.parametrize(
    "args",
    [
        ["--duration", "5"],
        ["--workers", "1"],
        ["--lease", "0"],
        ["--lease", "nan"],
        ["--jobs", "0"],
        ["--seed", "x"],
    ],
)
def test_bad_options_exit_2_with_one_line(args: list[str]) -> None:
    """Bad options: exit code 2, a short message, no traceback, nothing started."""
    result = subprocess.run(
        [PGQUEUE, "chaos", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_chaos_run_keeps_every_promise(tmp_path: Path) -> None:
    """Three workers, about 45 s of kills, stops, cut sessions and a server restart:
    every job done or dead, fence >= attempts, every done job's result at its final
    fence, accepted fences only going up, re-runs within what the faults explain."""
    lines: list[str] = []
    report = chaos.run(
        chaos.Config(seed=7, duration=45, workers=3, lease=3.0, log_dir=tmp_path),
        say=lines.append,
    )
    text = "\n".join([*lines, chaos.summary(report)])
    print(text)
    assert report.ok, text
    assert all(report.faults[kind] >= 1 for kind in chaos.KINDS), text
    assert report.backends_terminated >= 1
    assert sum(report.statuses.values()) == report.jobs
    assert report.extra_attempts <= report.bound
    # every lost attempt is put down to a fault (none left unexplained)
    assert report.causes["unattributed"] == 0, text
    # every process the run started is gone
    assert _processes_mentioning(report.queue) == []


def test_what_a_fence_cannot_stop_and_what_an_idempotency_key_does(dsn: str) -> None:
    """The limits, shown plainly. A paused holder whose late write lands *before* the new
    holder writes is accepted (the fence orders writes; it cannot know who holds the job
    now), and anything outside the database, like an e-mail, happens twice. A unique
    idempotency key on the side effect (here: the job id) is what makes it happen once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE reports (id bigint PRIMARY KEY, body text, fence bigint)")
        conn.execute("CREATE TABLE outbox (idempotency_key text PRIMARY KEY, body text)")
        conn.execute("CREATE TABLE sent (body text)")  # an e-mail API that checks nothing
        queue = Queue(conn)
        job_id = queue.enqueue({"to": "a@example.com"})
        [a] = queue.claim(lease=30)
        conn.execute("UPDATE jobs SET lease_until = now() - interval '1 second'")  # A froze
        queue.reap()
        [b] = queue.claim(lease=30)
        assert (a.fence, b.fence) == (1, 2)

        def side_effects(job: Job, who: str) -> None:
            fenced_write(conn, "reports", {"id": job.id}, {"body": who}, job.fence)
            conn.execute("INSERT INTO sent VALUES (%s)", [who])
            conn.execute(
                "INSERT INTO outbox VALUES (%s, %s) ON CONFLICT DO NOTHING",
                [f"welcome-email:{job.id}", who],
            )

        side_effects(a, "A (stale)")  # lands first: the fence cannot refuse it
        side_effects(b, "B")
        assert not queue.complete(a) and queue.complete(b)  # one accepted completion
        # the fenced table ends at the newest fence ...
        assert conn.execute("SELECT body, fence FROM reports").fetchall() == [("B", 2)]
        # ... the unchecked side effect happened twice, the keyed one once
        assert conn.execute("SELECT count(*) FROM sent").fetchone() == (2,)
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (1,)
        assert conn.execute("SELECT status FROM jobs WHERE id = %s", [job_id]).fetchone() == (
            "done",
        )
