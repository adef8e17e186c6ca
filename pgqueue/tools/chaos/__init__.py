"""``pgqueue chaos``: real worker processes, real faults, and checks from the database alone.

M ``pgqueue worker pgqueue.tools.chaos:handler`` processes work through N jobs. Each job
records that its handler started (``chaos_runs``), sleeps a little, then writes its
result to ``chaos_results`` with a fenced write. While they run, a seeded schedule
injects faults: SIGKILL a worker (a replacement starts), SIGSTOP one for longer than
the lease (SIGCONT later), ``pg_terminate_backend`` a worker's sessions, and restart
the PostgreSQL server once (only on the throwaway server this command starts itself).

Afterwards, from the database alone: every job is ``done`` or ``dead``; fence =
attempts everywhere; every done job's result carries its final fence; the fences a
result row accepted only ever went up; and the extra attempts (jobs run more than
once) stay within what the faults can explain: each kill, stop or terminate costs at
most the one job its victim held, a restart at most one job per worker process.

The schedule is a function of the seed; what the processes were doing when a fault
lands is not, so two runs with one seed inject the same faults with different effects.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from ...db import connect, first_line, mask_dsn
from ...errors import BadInput, LeaseLost, PgQueueError
from ...job import Job
from ...queue import Queue
from ...server import EmbeddedServer

WORKER_ENV = "PGQUEUE_CHAOS_WORKER"  # tells the handler which worker process it runs in
KINDS = ("kill", "stop", "terminate", "restart")
APP_PREFIX = "pgqueue worker "  # Worker.app_name: how a worker's sessions are found

# The side tables the handler writes. Kept here, not in sql/, because they belong to
# this experiment, not to the queue. The trigger appends every accepted fence to
# ``history`` in commit order (the row lock orders the writers), so a stale write that
# got through after a newer one would show as a fence going down.
SIDE_TABLES = """
CREATE TABLE IF NOT EXISTS chaos_results (
  job_id  bigint   PRIMARY KEY,
  worker  text     NOT NULL,
  fence   bigint   NOT NULL,
  history bigint[] NOT NULL DEFAULT '{}'
);
CREATE OR REPLACE FUNCTION chaos_results_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    NEW.history := OLD.history || NEW.fence;
  ELSE
    NEW.history := ARRAY[NEW.fence];
  END IF;
  RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER chaos_results_history
  BEFORE INSERT OR UPDATE ON chaos_results
  FOR EACH ROW EXECUTE FUNCTION chaos_results_history();
CREATE TABLE IF NOT EXISTS chaos_runs (
  job_id     bigint      NOT NULL,
  fence      bigint      NOT NULL,
  worker     text        NOT NULL,
  started_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_faults (
  run    text        NOT NULL,
  kind   text        NOT NULL,
  worker text,
  at     timestamptz NOT NULL,
  detail text        NOT NULL DEFAULT ''
);
"""


# -- the handler the worker processes run ----------------------------------------------
def handler(job: Job) -> None:
    """Record the start, sleep ``payload["sleep"]`` seconds, then write the result with
    the job's fence; raise ``LeaseLost`` if the database refused the write as stale."""
    assert job.conn is not None
    worker = os.environ.get(WORKER_ENV, f"pid {os.getpid()}")
    job.conn.execute(
        "INSERT INTO chaos_runs (job_id, fence, worker) VALUES (%s, %s, %s)",
        (job.id, job.fence, worker),
    )
    time.sleep(float(job.payload.get("sleep", 0.1)))
    if not job.fenced_write("chaos_results", {"job_id": job.id}, {"worker": worker}):
        raise LeaseLost(f"job {job.id}: result with fence {job.fence} refused as stale")


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
REAP_INTERVAL = 1.0  # the workers' --reap-interval


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


# -- the run -----------------------------------------------------------------------------
@dataclass
class Config:
    """What to run: the seed fixes the fault schedule and the jobs' sleeps."""

    seed: int = 1
    duration: float = 60.0
    workers: int = 4
    jobs: int | None = None  # default: enough work to keep the workers busy throughout
    lease: float = 2.0
    dsn: str | None = None  # None: a throwaway embedded server (and a restart fault)
    log_dir: Path | None = None  # None: a temporary directory, removed after a clean run

    def validate(self) -> None:
        """Raise ``BadInput`` (one line, nothing started) for values the run cannot use."""
        if isinstance(self.workers, bool) or not isinstance(self.workers, int):
            raise BadInput(f"--workers must be a whole number, got {self.workers!r}")
        if not 2 <= self.workers <= 32:
            raise BadInput(f"--workers must be from 2 to 32, got {self.workers}")
        if not isinstance(self.lease, int | float) or not 0.5 <= self.lease <= 60:
            raise BadInput(f"--lease must be from 0.5 to 60 seconds, got {self.lease!r}")
        shortest = min_duration(self.lease)
        if not isinstance(self.duration, int | float) or not shortest <= self.duration <= 86400:
            raise BadInput(
                f"--duration must be from {shortest:g} to 86400 seconds with a "
                f"{self.lease:g} s lease (every fault kind once), got {self.duration!r}"
            )
        if self.jobs is not None and not 1 <= self.jobs <= 1_000_000:
            raise BadInput(f"--jobs must be from 1 to 1000000, got {self.jobs!r}")

    @property
    def job_count(self) -> int:
        """N: by default about 0.3 s of work per job for the whole run."""
        return self.jobs or max(20, int(self.duration * self.workers / 0.3))

    @property
    def mean_sleep(self) -> float:
        """Seconds a job's handler sleeps on average: the work spreads over the run,
        and stays well inside the lease so healthy workers never lose one."""
        spread = 0.8 * self.duration * self.workers / self.job_count
        return min(max(spread, 0.02), self.lease / 4)


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


@dataclass
class _Slot:
    index: int
    generation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    name: str = ""


class _Run:
    """One chaos run: owns every process it starts and stops each one by PID."""

    def __init__(self, config: Config, say: Callable[[str], None]) -> None:
        self.config = config
        self.say = say
        self.rng = random.Random(config.seed)
        self.server: EmbeddedServer | None = None
        self.home: Path | None = None
        self.dsn = config.dsn or ""
        self.queue = f"chaos-{config.seed}-{os.getpid()}-{int(time.time())}"
        self.slots = [_Slot(i) for i in range(config.workers)]
        self.started: list[subprocess.Popen[bytes]] = []  # every process, for cleanup
        self.killed: set[int] = set()  # PIDs we SIGKILLed on purpose
        self.stopped: dict[int, float] = {}  # PID -> monotonic time to SIGCONT
        self.conn: psycopg.Connection | None = None
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pgqueue-chaos-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.report = Report(
            config.seed,
            self.queue,
            config.workers,
            config.job_count,
            config.lease,
            restart_enabled=config.dsn is None,
            log_dir=str(self.log_dir),
        )

    # -- database ------------------------------------------------------------------------
    def db(self) -> psycopg.Connection:
        """The controller's own session, reopened after a restart or a cut."""
        if self.conn is not None and not self.conn.closed and not self.conn.broken:
            return self.conn
        deadline = time.monotonic() + 10  # a restart takes a second or two
        while True:
            try:
                self.conn = connect(self.dsn, application_name="pgqueue chaos")
                return self.conn
            except PgQueueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def sql(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement, retrying once on a fresh session if the old one was cut."""
        for attempt in (1, 2):
            try:
                cur = self.db().execute(query, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if attempt == 2:
                    raise
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
        return []

    # -- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        """Start the throwaway server if needed, install the tables and enqueue the jobs."""
        if not self.dsn:
            self.home = Path(tempfile.mkdtemp(prefix="pgqueue-chaos-"))
            self.home.chmod(0o755)  # as root, the server runs as a user that must reach it
            self.server = EmbeddedServer(self.home, durable=False)
            self.dsn = self.server.start()
        with Queue(self.dsn) as q:
            q.install()
            q.conn.execute(SIDE_TABLES)
            sleeps = [
                round(self.config.mean_sleep * (0.5 + self.rng.random()), 3)
                for _ in range(self.config.job_count)
            ]
            q.enqueue_many(
                [{"n": n, "sleep": s} for n, s in enumerate(sleeps)],
                queue=self.queue,
                max_attempts=25,
            )

    def worker_command(self, name: str) -> list[str]:
        """The real CLI worker; the DSN travels in the environment, not in ``ps``."""
        script = Path(sys.executable).with_name("pgqueue")
        base = (
            [str(script)]
            if script.exists()
            else [
                sys.executable,
                "-c",
                "import sys; from pgqueue.cli import main; sys.exit(main())",
            ]
        )
        return [
            *base,
            "worker",
            "pgqueue.tools.chaos:handler",
            "--queue",
            self.queue,
            "--lease",
            str(self.config.lease),
            "--poll",
            "0.5",
            "--reap-interval",
            str(REAP_INTERVAL),
            "--backoff",
            "0.05",
            "--name",
            name,
        ]

    def spawn(self, slot: _Slot) -> None:
        """Start the next worker process of ``slot`` in a process group of its own."""
        slot.generation += 1
        slot.name = f"chaos-{slot.index}.{slot.generation}"
        env = {**os.environ, "PGQUEUE_DSN": self.dsn, WORKER_ENV: slot.name}
        env.pop("DATABASE_URL", None)
        with open(self.log_dir / f"{slot.name}.log", "wb") as log:
            slot.proc = subprocess.Popen(
                self.worker_command(slot.name),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: signals reach only it
            )
        self.started.append(slot.proc)

    def wait_for_sessions(self, timeout: float) -> None:
        """Wait until every awake worker has a session open (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            names = {
                APP_PREFIX + s.name
                for s in self.slots
                if s.proc and s.proc.poll() is None and s.proc.pid not in self.stopped
            }
            seen = {
                r[0]
                for r in self.sql(
                    "SELECT DISTINCT application_name FROM pg_stat_activity "
                    "WHERE application_name = ANY(%s)",
                    [list(names)],
                )
            }
            if names <= seen:
                return
            self.tend(0.2)

    # -- signals, by PID only ------------------------------------------------------------
    @staticmethod
    def signal(proc: subprocess.Popen[bytes], sig: int) -> bool:
        """Send ``sig`` to the process group of ``proc`` if it has not been reaped."""
        if proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
            return True
        return False

    def tend(self, seconds: float) -> None:
        """Sleep, resuming stopped workers when due and replacing any that exited."""
        until = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            for proc in [p for p in self.started if p.pid in self.stopped]:
                if now >= self.stopped[proc.pid]:
                    self.signal(proc, signal.SIGCONT)
                    del self.stopped[proc.pid]
            for slot in self.slots:
                if slot.proc and slot.proc.poll() is not None and slot.proc.pid not in self.killed:
                    tail = _tail(self.log_dir / f"{slot.name}.log")
                    self.report.unexpected_exits.append(
                        f"{slot.name} exited with {slot.proc.returncode}: {tail}"
                    )
                    self.say(f"  ! {slot.name} exited by itself ({slot.proc.returncode}); replaced")
                    self.spawn(slot)
            if now >= until:
                return
            time.sleep(min(0.1, until - now))

    def record(self, kind: str, worker: str | None, at: datetime | None, detail: str = "") -> None:
        """Write the fault into ``chaos_faults`` (database time) and count it."""
        self.sql(
            "INSERT INTO chaos_faults (run, kind, worker, at, detail) "
            "VALUES (%s, %s, %s, coalesce(%s, now()), %s)",
            [self.queue, kind, worker, at, detail],
        )
        self.report.faults[kind] += 1

    def inject(self, fault: Fault, elapsed: float) -> None:
        """Carry out one fault of the schedule."""
        slot = self.slots[fault.slot]
        proc = slot.proc
        assert proc is not None
        if fault.kind == "kill":
            self.killed.add(proc.pid)
            self.signal(proc, signal.SIGKILL)
            proc.wait()
            self.stopped.pop(proc.pid, None)
            self.record("kill", slot.name, None)
            self.say(f"{elapsed:6.1f}s kill      {slot.name} (pid {proc.pid}); replacing it")
            self.spawn(slot)
        elif fault.kind == "stop":
            if proc.pid in self.stopped:
                self.report.skipped.append(f"stop at {fault.at}s: {slot.name} already stopped")
                return
            self.signal(proc, signal.SIGSTOP)
            self.stopped[proc.pid] = time.monotonic() + fault.hold
            self.record("stop", slot.name, None, f"{fault.hold:g}s")
            self.say(f"{elapsed:6.1f}s stop      {slot.name} for {fault.hold:.1f}s")
        elif fault.kind == "terminate":
            ended = 0
            for _ in range(20):  # a worker that is reconnecting has no session for a moment
                rows = self.sql(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                    "FROM pg_stat_activity WHERE application_name = %s",
                    [APP_PREFIX + slot.name],
                )
                ended = int(rows[0][0])
                if ended:
                    break
                self.tend(0.1)
            if not ended:
                self.report.skipped.append(f"terminate at {fault.at}s: {slot.name} had no session")
                return
            self.report.backends_terminated += ended
            self.record("terminate", slot.name, None, f"{ended} sessions")
            self.say(f"{elapsed:6.1f}s terminate {slot.name}: {ended} sessions")
        elif fault.kind == "restart":
            assert self.server is not None
            self.wait_for_sessions(5.0)  # a worker starting up would give up, not retry
            before = self.sql("SELECT now()")[0][0]
            if self.conn is not None:
                self.conn.close()
            self.server.restart()
            self.record("restart", None, before)
            self.say(f"{elapsed:6.1f}s restart   the PostgreSQL server")

    def sample_idle_in_transaction(self) -> None:
        rows = self.sql(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE state LIKE 'idle in transaction%%' AND application_name LIKE %s",
            [APP_PREFIX + "chaos-%"],
        )
        self.report.idle_in_transaction = max(self.report.idle_in_transaction, int(rows[0][0]))

    def remaining(self) -> int:
        rows = self.sql(
            "SELECT count(*) FROM jobs WHERE queue = %s AND status NOT IN ('done', 'dead')",
            [self.queue],
        )
        return int(rows[0][0])

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> Report:
        """Start, inject, drain, stop everything, check; always clean up."""
        began = time.monotonic()
        config = self.config
        try:
            self.setup()
            where = "a throwaway embedded server" if self.server else mask_dsn(self.dsn)
            self.say(
                f"pgqueue chaos: seed {config.seed}, {config.duration:g}s, {config.workers} "
                f"workers, {config.job_count} jobs (~{config.mean_sleep:.2f}s each), "
                f"lease {config.lease:g}s, on {where}"
            )
            if not self.server:
                self.say("  (no restart fault: it needs the throwaway server; omit --dsn)")
            for slot in self.slots:
                self.spawn(slot)
            self.wait_for_sessions(60.0)
            schedule = plan(
                config.seed,
                config.duration,
                config.workers,
                config.lease,
                restart=self.server is not None,
            )
            start = time.monotonic()
            for fault in schedule:
                while (wait := start + fault.at - time.monotonic()) > 0:
                    self.sample_idle_in_transaction()
                    self.tend(min(wait, 1.0))
                self.inject(fault, time.monotonic() - start)
            while time.monotonic() < start + config.duration or self.stopped:
                self.sample_idle_in_transaction()
                self.tend(0.5)
            self.drain(max(30.0, 10 * config.lease))
            self.stop_workers()
            self.check()
        finally:
            self.cleanup()
        self.report.seconds = time.monotonic() - began
        return self.report

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until no job of the run is ready or running."""
        deadline = time.monotonic() + timeout
        while (left := self.remaining()) and time.monotonic() < deadline:
            self.tend(0.5)
        if left:
            self.say(f"  ! {left} jobs still unfinished after {timeout:g}s of draining")

    def stop_workers(self) -> None:
        """SIGTERM every worker (a graceful stop), then SIGKILL any that linger."""
        for slot in self.slots:
            if slot.proc:
                self.killed.add(slot.proc.pid)  # exits from here on are ours
                self.signal(slot.proc, signal.SIGCONT)
                self.signal(slot.proc, signal.SIGTERM)
        for slot in self.slots:
            if slot.proc:
                try:
                    slot.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.signal(slot.proc, signal.SIGKILL)
                    slot.proc.wait()

    def cleanup(self) -> None:
        """Kill every process this run started that is still alive, stop the server."""
        for proc in self.started:
            self.signal(proc, signal.SIGCONT)
            self.signal(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        if self.server is not None:
            with contextlib.suppress(PgQueueError):
                self.server.stop()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    # -- the checks ----------------------------------------------------------------------
    def check(self) -> None:
        """Judge the run from the database (and the workers' logs for tracebacks)."""
        r = self.report
        jobs = self.sql(
            "SELECT j.id, j.status, j.attempts, j.max_attempts, j.fence, c.fence, c.history "
            "FROM jobs j LEFT JOIN chaos_results c ON c.job_id = j.id "
            "WHERE j.queue = %s ORDER BY j.id",
            [self.queue],
        )
        r.statuses = Counter(row[1] for row in jobs)
        r.rerun_jobs = sum(row[2] > 1 for row in jobs)
        r.extra_attempts = sum(max(row[2] - 1, 0) for row in jobs)
        r.superseded_writes = sum(len(row[6]) - 1 for row in jobs if row[6])
        r.bound = (
            r.faults["kill"]
            + r.faults["stop"]
            + r.faults["terminate"]
            + r.faults["restart"] * self.config.workers
        )

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
        r.checks["fence = attempts"] = failing(
            [j for j in jobs if j[4] != j[2]], "fence != attempts"
        )
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
        tracebacks = [p.name for p in sorted(self.log_dir.glob("*.log")) if "Traceback" in _read(p)]
        r.checks["no traceback in worker logs"] = ", ".join(tracebacks)
        r.refused_in_logs = sum(
            _read(p).count("refused: fence") for p in self.log_dir.glob("*.log")
        )
        r.causes = self.attribute(jobs)

    def attribute(self, jobs: list[tuple[Any, ...]]) -> Counter[str]:
        """Name the likely fault behind each lost attempt: the first fault against the
        worker that started it (or a restart) between its start and the next attempt's."""
        runs = {
            (j, f): (w, at)
            for j, f, w, at in self.sql(
                "SELECT DISTINCT ON (r.job_id, r.fence) r.job_id, r.fence, r.worker, "
                "r.started_at FROM chaos_runs r JOIN jobs j ON j.id = r.job_id "
                "WHERE j.queue = %s ORDER BY r.job_id, r.fence, r.started_at",
                [self.queue],
            )
        }
        faults = self.sql(
            "SELECT kind, worker, extract(epoch FROM at) FROM chaos_faults "
            "WHERE run = %s ORDER BY at",
            [self.queue],
        )
        causes: Counter[str] = Counter()
        for job_id, status, attempts, *_ in jobs:
            last_lost = attempts if status == "dead" else attempts - 1
            for fence in range(1, last_lost + 1):
                holder = runs.get((job_id, fence))
                if holder is None:
                    causes["cut before the handler started"] += 1
                    continue
                begun = holder[1].timestamp() - 1.0
                after = runs.get((job_id, fence + 1))
                until = after[1].timestamp() if after else math.inf
                kind = next(
                    (
                        k
                        for k, w, at in faults
                        if (w == holder[0] or k == "restart") and begun <= float(at) <= until
                    ),
                    "unattributed",
                )
                causes[kind] += 1
        return causes


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _tail(path: Path) -> str:
    lines = [line for line in _read(path).splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def run(config: Config, say: Callable[[str], None] | None = None) -> Report:
    """Run one chaos experiment (see the module docstring) and return its report."""
    config.validate()
    return _Run(config, say or (lambda line: print(line, flush=True))).run()


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
        f" at most {report.bound} explainable: one per kill, stop and terminate"
        + (f", {report.workers} per restart)" if report.restart_enabled else ")"),
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


def main(argv: Sequence[str] | None = None) -> int:
    """``pgqueue chaos``: exit 0 if every check passed, 1 if one failed, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="pgqueue chaos",
        description="Run real workers under injected faults (kill, stop, cut sessions, "
        "restart the server) and check the queue's promises from the database.",
    )
    parser.add_argument("--seed", type=int, default=1, help="fixes the fault schedule")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (M)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs (N); default fills the run")
    parser.add_argument("--lease", type=float, default=2.0, help="the workers' lease, seconds")
    parser.add_argument(
        "--dsn",
        help="use this database instead of a throwaway embedded server: no restart fault; "
        "it keeps a chaos-SEED-... queue and the chaos_* tables afterwards",
    )
    parser.add_argument("--log-dir", type=Path, help="keep the worker logs here")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    config = Config(
        seed=args.seed,
        duration=args.duration,
        workers=args.workers,
        jobs=args.jobs,
        lease=args.lease,
        dsn=args.dsn,
        log_dir=args.log_dir,
    )
    try:
        report = run(config)
    except BadInput as exc:
        print(f"pgqueue chaos: {exc}", file=sys.stderr)
        return 2
    except (PgQueueError, psycopg.Error, OSError) as exc:
        print(f"pgqueue chaos: {first_line(exc)}", file=sys.stderr)
        return 1
    print(summary(report), flush=True)
    if report.ok and args.log_dir is None:
        shutil.rmtree(report.log_dir, ignore_errors=True)
    return 0 if report.ok else 1
