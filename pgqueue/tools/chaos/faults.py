"""The chaos run's faults: the seeded schedule, and the injector that carries it out.

While the workers run, a seeded schedule injects faults: SIGKILL a worker (a replacement
starts), SIGSTOP one for longer than the lease (SIGCONT later), ``pg_terminate_backend``
a worker's sessions, and restart the PostgreSQL server once (only on the throwaway
server the run starts itself). Every fault injected is written to ``chaos_faults``.

The schedule is a function of the seed; what the processes were doing when a fault
lands is not, so two runs with one seed inject the same faults with different effects.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from ...server import EmbeddedServer
from .workers import APP_PREFIX, REAP_INTERVAL, Workers
from .workload import Session

KINDS = ("kill", "stop", "terminate", "restart")


# -- the schedule ------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``at`` seconds into the run, against worker slot ``slot``."""

    at: float
    kind: str
    slot: int = 0
    hold: float = 0.0  # stop: seconds until SIGCONT


WARMUP = 3.0  # seconds of calm before the first fault
MIN_GAP, MAX_GAP = 1.5, 3.5  # seconds between the first faults (one of each kind)


def stop_hold(lease: float, u: float) -> float:
    """How long a stopped worker stays frozen (``u`` in [0, 1]): always longer than its
    lease plus the reaper's interval, so another worker takes its job over."""
    return lease * (1.5 + u) + REAP_INTERVAL


def min_duration(lease: float) -> float:
    """The shortest run whose schedule fits every fault kind once."""
    return float(math.ceil(WARMUP + 3 * MAX_GAP + stop_hold(lease, 1.0) + 2))


def plan(
    seed: int, duration: float, workers: int, lease: float, *, restart: bool = True
) -> list[Fault]:
    """The fault schedule for ``seed``: every kind once first (in a seeded order), then
    random kills, stops and terminations until 85 % of ``duration``. Stops never overlap,
    so at least ``workers - 1`` workers are awake at any time."""
    rng = random.Random(seed)
    first = [k for k in KINDS if restart or k != "restart"]
    rng.shuffle(first)
    faults: list[Fault] = []
    t = WARMUP
    awake_at = 0.0  # when the last stopped worker resumes
    while True:
        guaranteed = len(faults) < len(first)
        kind = first[len(faults)] if guaranteed else rng.choice(("kill", "stop", "terminate"))
        if kind == "stop":
            t = max(t, awake_at + 0.5)
        if not guaranteed and t > 0.85 * duration:
            return faults
        hold = round(stop_hold(lease, rng.random()), 3) if kind == "stop" else 0.0
        faults.append(Fault(round(t, 3), kind, rng.randrange(workers), hold))
        if kind == "stop":
            awake_at = t + hold
        if len(faults) < len(first):
            t += rng.uniform(MIN_GAP, MAX_GAP)
        else:
            t += MIN_GAP + rng.expovariate(1 / max(2.0, lease))


# -- the injector ------------------------------------------------------------------------
class Injector:
    """Carries out the faults of a schedule against the workers, the sessions and the
    server, and tallies what it did (or could not do)."""

    def __init__(
        self,
        workers: Workers,
        session: Session,
        server: EmbeddedServer | None,
        queue: str,
        say: Callable[[str], None],
    ) -> None:
        self.workers = workers
        self.session = session
        self.server = server  # None: not ours to restart
        self.queue = queue
        self.say = say
        self.counts: Counter[str] = Counter()  # kind -> times injected
        self.backends_terminated = 0
        self.skipped: list[str] = []  # faults that found no target

    def record(self, kind: str, worker: str | None, at: datetime | None, detail: str = "") -> None:
        """Write the fault into ``chaos_faults`` (database time) and count it."""
        self.session.sql(
            "INSERT INTO chaos_faults (run, kind, worker, at, detail) "
            "VALUES (%s, %s, %s, coalesce(%s, now()), %s)",
            [self.queue, kind, worker, at, detail],
        )
        self.counts[kind] += 1

    def inject(self, fault: Fault, elapsed: float) -> None:
        """Carry out one fault of the schedule."""
        slot = self.workers.slots[fault.slot]
        proc = slot.proc
        assert proc is not None
        workers = self.workers
        if fault.kind == "kill":
            workers.killed.add(proc.pid)
            workers.signal(proc, signal.SIGKILL)
            proc.wait()
            workers.stopped.pop(proc.pid, None)
            self.record("kill", slot.name, None)
            self.say(f"{elapsed:6.1f}s kill      {slot.name} (pid {proc.pid}); replacing it")
            workers.spawn(slot)
        elif fault.kind == "stop":
            if proc.pid in workers.stopped:
                self.skipped.append(f"stop at {fault.at}s: {slot.name} already stopped")
                return
            workers.signal(proc, signal.SIGSTOP)
            workers.stopped[proc.pid] = time.monotonic() + fault.hold
            self.record("stop", slot.name, None, f"{fault.hold:g}s")
            self.say(f"{elapsed:6.1f}s stop      {slot.name} for {fault.hold:.1f}s")
        elif fault.kind == "terminate":
            ended = 0
            for _ in range(20):  # a worker that is reconnecting has no session for a moment
                rows = self.session.sql(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                    "FROM pg_stat_activity WHERE application_name = %s",
                    [APP_PREFIX + slot.name],
                )
                ended = int(rows[0][0])
                if ended:
                    break
                workers.tend(0.1)
            if not ended:
                self.skipped.append(f"terminate at {fault.at}s: {slot.name} had no session")
                return
            self.backends_terminated += ended
            self.record("terminate", slot.name, None, f"{ended} sessions")
            self.say(f"{elapsed:6.1f}s terminate {slot.name}: {ended} sessions")
        elif fault.kind == "restart":
            assert self.server is not None
            workers.wait_for_sessions(5.0)  # a worker starting up would give up, not retry
            before = self.session.sql("SELECT now()")[0][0]
            self.session.close()
            self.server.restart()
            self.record("restart", None, before)
            self.say(f"{elapsed:6.1f}s restart   the PostgreSQL server")
