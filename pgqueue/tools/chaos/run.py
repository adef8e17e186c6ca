"""The chaos run's orchestration: ``Config``, the run loop (``run``) and the CLI (``main``).

One run starts a throwaway embedded server (unless ``--dsn`` names one), enqueues the
workload (``workload``), starts M worker processes (``workers``), carries out the
seeded fault schedule while they work (``faults``), drains the queue, stops every
process it started, and judges the result from the database alone (``checks``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

from ...db import first_line, mask_dsn
from ...errors import BadInput, PgQueueError
from ...server import EmbeddedServer
from .checks import Report, check, idle_in_transaction, summary
from .faults import Injector, min_duration, plan
from .workers import Workers, slot_kind
from .workload import Session, enqueue_jobs

KINDS_OF_WORKER = ("threads", "async", "mixed")  # threaded Workers, AsyncWorkers, or both


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
    kind: str = "threads"  # which workers: threads, async, or mixed (every other one async)

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
        if self.kind not in KINDS_OF_WORKER:
            raise BadInput(f"kind must be one of {', '.join(KINDS_OF_WORKER)}, got {self.kind!r}")
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


class _Run:
    """One chaos run: owns the server it starts and, through ``Workers``, every process."""

    def __init__(self, config: Config, say: Callable[[str], None]) -> None:
        self.config = config
        self.say = say
        self.server: EmbeddedServer | None = None
        self.home: Path | None = None
        self.session = Session(config.dsn or "")
        self.queue = f"chaos-{config.seed}-{os.getpid()}-{int(time.time())}"
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pgqueue-chaos-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers = Workers(
            config.workers, self.queue, config.lease, self.log_dir, self.session, say, config.kind
        )
        self.report = Report(
            config.seed,
            self.queue,
            config.workers,
            config.job_count,
            config.lease,
            restart_enabled=config.dsn is None,
            log_dir=str(self.log_dir),
        )

    def setup(self) -> None:
        """Start the throwaway server if needed, install the tables and enqueue the jobs."""
        if not self.session.dsn:
            self.home = Path(tempfile.mkdtemp(prefix="pgqueue-chaos-"))
            self.home.chmod(0o755)  # as root, the server runs as a user that must reach it
            self.server = EmbeddedServer(self.home, durable=False)
            self.session.dsn = self.server.start()
        enqueue_jobs(
            self.session.dsn,
            self.queue,
            self.config.job_count,
            self.config.mean_sleep,
            self.config.seed,
        )

    def sample_idle_in_transaction(self) -> None:
        """Keep the most worker sessions seen idle in a transaction."""
        self.report.idle_in_transaction = max(
            self.report.idle_in_transaction, idle_in_transaction(self.session)
        )

    def remaining(self) -> int:
        """Jobs of the run that are neither done nor dead."""
        rows = self.session.sql(
            "SELECT count(*) FROM jobs WHERE queue = %s AND status NOT IN ('done', 'dead')",
            [self.queue],
        )
        return int(rows[0][0])

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> Report:
        """Start, inject, drain, stop everything, check; always clean up."""
        began = time.monotonic()
        config = self.config
        workers = self.workers
        try:
            self.setup()
            where = "a throwaway embedded server" if self.server else mask_dsn(self.session.dsn)
            kinds = [slot_kind(config.kind, s.index) for s in workers.slots]
            self.say(
                f"pgqueue chaos: seed {config.seed}, {config.duration:g}s, {config.workers} "
                f"workers ({kinds.count('threads')} threaded, {kinds.count('async')} async), "
                f"{config.job_count} jobs (~{config.mean_sleep:.2f}s each), "
                f"lease {config.lease:g}s, on {where}"
            )
            if not self.server:
                self.say("  (no restart fault: it needs the throwaway server; omit --dsn)")
            for slot in workers.slots:
                workers.spawn(slot)
            workers.wait_for_sessions(60.0)
            schedule = plan(
                config.seed,
                config.duration,
                config.workers,
                config.lease,
                restart=self.server is not None,
            )
            injector = Injector(workers, self.session, self.server, self.queue, self.say)
            start = time.monotonic()
            for fault in schedule:
                while (wait := start + fault.at - time.monotonic()) > 0:
                    self.sample_idle_in_transaction()
                    workers.tend(min(wait, 1.0))
                injector.inject(fault, time.monotonic() - start)
            while time.monotonic() < start + config.duration or workers.stopped:
                self.sample_idle_in_transaction()
                workers.tend(0.5)
            self.drain(max(30.0, 10 * config.lease))
            workers.stop()
            # what was injected and seen, then what the database says
            self.report.faults = injector.counts
            self.report.backends_terminated = injector.backends_terminated
            self.report.skipped = injector.skipped
            self.report.unexpected_exits = workers.unexpected_exits
            check(self.report, self.session)
        finally:
            self.cleanup()
        self.report.seconds = time.monotonic() - began
        return self.report

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until no job of the run is ready or running."""
        deadline = time.monotonic() + timeout
        while (left := self.remaining()) and time.monotonic() < deadline:
            self.workers.tend(0.5)
        if left:
            self.say(f"  ! {left} jobs still unfinished after {timeout:g}s of draining")

    def cleanup(self) -> None:
        """Kill every process this run started that is still alive, stop the server."""
        self.workers.kill_all()
        with contextlib.suppress(Exception):
            self.session.close()
        if self.server is not None:
            with contextlib.suppress(PgQueueError):
                self.server.stop()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)


def run(config: Config, say: Callable[[str], None] | None = None) -> Report:
    """Run one chaos experiment (see the module docstring) and return its report."""
    config.validate()
    return _Run(config, say or (lambda line: print(line, flush=True))).run()


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
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--async",
        dest="kind",
        action="store_const",
        const="async",
        default="threads",
        help="run AsyncWorkers (a coroutine handler) instead of threaded Workers",
    )
    kind.add_argument(
        "--mixed",
        dest="kind",
        action="store_const",
        const="mixed",
        help="every other worker an AsyncWorker, the rest threaded",
    )
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
        kind=args.kind,
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
