"""Prometheus metrics of a worker (``Worker(metrics_port=N)``, ``pgqueue worker --metrics-port N``).

What this worker did, by queue, counted on the engine's loop where each outcome is settled
(plain integers and bucket lists, no lock: a few hundred nanoseconds a job): jobs done,
failed attempts, jobs gone dead, handlers timed out, late writes refused, writes given up,
and histograms of run time (handler start to end) and of wait (the job's ``run_at``, its
enqueue time unless delayed or retried, to its claim, both by the database's clock).

What the table holds, by queue (ready, running and dead jobs, the oldest runnable job's
age) is read on a scrape, at most every ``REFRESH`` seconds, by ``Queue.stats()`` on a
connection of its own: through the partial indexes, so its cost does not grow with the
done jobs the table holds. ``prometheus_client`` is imported only here, only when asked for.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from .errors import BadInput, PgQueueError
from .queue import Queue

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

    from .claims import Claim
    from .job import Job
    from .options import WorkerOptions

log = logging.getLogger("pgqueue.worker")

REFRESH = 2.0  # seconds a read of the table serves scrapes before the next one reads again
STATS_TIMEOUT_MS = 5000  # a scrape never waits longer than this for the table's counts
# Seconds: from a millisecond job to an hour-long one (and waits of a backlog).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
STATUSES = ("ready", "running", "dead")


def needs_client() -> None:
    """A one-line ``BadInput`` unless ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise BadInput(
            "metrics_port needs prometheus-client: pip install prometheus-client "
            '(or pip install -e ".[metrics]" in your pgqueue clone)'
        ) from None


def check_port(port: int, addr: str = "127.0.0.1") -> None:
    """A one-line ``BadInput`` if nothing may listen on ``addr``:``port`` now (the CLI asks
    before it starts anything, so a port in use is one line)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with _port_errors(port, addr), socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        probe.bind((addr, port))
        probe.listen(1)


@contextlib.contextmanager
def _port_errors(port: int, addr: str) -> Iterator[None]:
    """Turn an ``OSError`` of listening on ``port`` into one line that says what to do."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "is in use (another process listens on it)"
        else:
            why = f"cannot be listened on ({exc.strerror or exc})"
        raise BadInput(
            f"metrics port {port} on {addr} {why}: choose another metrics_port "
            "(--metrics-port) or metrics_addr (--metrics-addr)"
        ) from None


class Histogram:
    """Counts of observations by bucket (``BUCKETS``, then +Inf) and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1  # le: the first bound >= it
        self.total += seconds

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """The buckets as Prometheus wants them (cumulative, ``le`` labels), and the sum."""
        counts, total = list(self.counts), self.total  # one copy: a consistent +Inf
        running, buckets = 0, []
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
            running += count
            buckets.append((bound, float(running)))
        return buckets, total


class QueueCounts:
    """What this worker did to one queue's jobs."""

    __slots__ = ("dead", "done", "failed", "given_up", "refused", "run", "timed_out", "wait")

    def __init__(self) -> None:
        self.done = self.failed = self.dead = self.timed_out = self.refused = self.given_up = 0
        self.run = Histogram()
        self.wait = Histogram()


# (attribute, metric name without _total, help)
_COUNTERS = (
    ("done", "pgqueue_jobs_done", "Jobs this worker completed (the completion accepted by fence)"),
    ("failed", "pgqueue_jobs_failed", "Failed attempts this worker recorded (retried or dead)"),
    (
        "dead",
        "pgqueue_jobs_dead",
        "Jobs this worker's failures sent dead (out of attempts, GiveUp)",
    ),
    ("timed_out", "pgqueue_jobs_timed_out", "Handlers failed for running past their timeout"),
    (
        "refused",
        "pgqueue_late_writes_refused",
        "Completions, failures and releases refused by fence (another holder has the job)",
    ),
    (
        "given_up",
        "pgqueue_writes_given_up",
        "Completions, failures and releases given up after retries (left to the lease)",
    ),
)


class WorkerMetrics:
    """One worker's metrics: counted by the engine (``claimed``, ``settled``,
    ``timed_out``, on its loop), served by ``serve()`` on a thread of
    ``prometheus_client``'s, read back by ``collect()`` on each scrape."""

    def __init__(self, options: WorkerOptions) -> None:
        assert options.metrics_port is not None
        needs_client()  # at the worker's construction, as the options' checks are
        self.options = options
        self.port = options.metrics_port  # the one listened on, once serving (0: any free)
        self.address = options.metrics_addr
        self.queues: dict[str, QueueCounts] = {name: QueueCounts() for name in options.queues}
        self._server: WSGIServer | None = None
        self._lock = threading.Lock()  # one read of the table at a time, one connection
        self._stats: Queue | None = None
        self._rows: list[dict[str, Any]] | None = None
        self._read_at = -float("inf")

    # -- counted by the engine, on its loop -------------------------------------------
    def _of(self, queue: str) -> QueueCounts:
        counts = self.queues.get(queue)
        if counts is None:  # (a queue outside the worker's list: not expected, but kept)
            counts = self.queues[queue] = QueueCounts()
        return counts

    def claimed(self, jobs: Sequence[Job]) -> None:
        """Each claimed job's wait: from its ``run_at`` to its claim, as the claim's
        statement measured it on the server's clock (``Job.waited``)."""
        for job in jobs:
            if job.waited is not None:
                self._of(job.queue).wait.observe(job.waited if job.waited > 0.0 else 0.0)

    def settled(self, action: str, ends: Iterable[tuple[Claim, str]]) -> None:
        """Jobs whose complete, fail or release ended ``ok``, ``refused`` or ``gave-up``;
        the run time of each whose handler began."""
        now = time.monotonic()
        for claim, end in ends:
            counts = self._of(claim.job.queue)
            if end == "ok":
                if action == "complete":
                    counts.done += 1
                elif action == "fail":
                    counts.failed += 1
                    counts.dead += claim.job.status == "dead"
            elif end == "refused":
                counts.refused += 1
            else:
                counts.given_up += 1
            if claim.started is not None and action != "release":
                counts.run.observe((claim.ended or now) - claim.started)

    def timed_out(self, job: Job) -> None:
        self._of(job.queue).timed_out += 1

    # -- served --------------------------------------------------------------------------
    def serve(self) -> None:
        """Listen on the port (a one-line ``BadInput`` if it is taken), on a daemon thread."""
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.gc_collector import GCCollector
        from prometheus_client.platform_collector import PlatformCollector
        from prometheus_client.process_collector import ProcessCollector

        registry = CollectorRegistry(auto_describe=False)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)
        registry.register(self)  # type: ignore[arg-type]
        with _port_errors(self.port, self.address):
            self._server, _ = start_http_server(self.port, addr=self.address, registry=registry)
        self.port = self._server.server_port
        log.info("%s: metrics on %s", self.options.name, self.url)

    def close(self) -> None:
        """Stop listening and close the connection the scrapes read through (blocks up to
        half a second: call it off the loop)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            stats, self._stats = self._stats, None
            if stats is not None:
                stats.close()

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def collect(self) -> Iterator[Metric]:
        """Every metric, for a scrape (on the HTTP server's thread)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        queues = list(self.queues.items())
        for attribute, name, help_text in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["queue"])
            for queue, counts in queues:
                counter.add_metric([queue], getattr(counts, attribute))
            yield counter
        for attribute, name, help_text in (
            ("run", "pgqueue_job_run_seconds", "Handler run time, from its start to its end"),
            ("wait", "pgqueue_job_wait_seconds", "Wait from the job's run_at to its claim"),
        ):
            histogram = HistogramMetricFamily(name, help_text, labels=["queue"])
            for queue, counts in queues:
                buckets, total = getattr(counts, attribute).cumulative()
                histogram.add_metric([queue], buckets, total)
            yield histogram
        rows = self._live()
        up = GaugeMetricFamily(
            "pgqueue_stats_up", "1 if the last read of the jobs table for the gauges worked"
        )
        up.add_metric([], 0.0 if rows is None else 1.0)
        yield up
        if rows is not None:
            yield from _gauges([q for q, _ in queues], rows)

    def _live(self) -> list[dict[str, Any]] | None:
        """The table's live counts, read again if the last read is ``REFRESH`` old; None if
        the database cannot be read now (logged; the next scrape tries again)."""
        with self._lock:
            if time.monotonic() - self._read_at < REFRESH:
                return self._rows
            try:
                if self._stats is None:
                    o = self.options
                    name = f"{o.app_name} metrics"
                    self._stats = Queue(o.dsn, application_name=name, pgbouncer=o.pgbouncer)
                with self._stats.conn.transaction():  # SET LOCAL: safe behind any pooler
                    self._stats.conn.execute(f"SET LOCAL statement_timeout = {STATS_TIMEOUT_MS}")
                    self._rows = [r for r in self._stats.stats() if not r["estimated"]]
            except (psycopg.Error, PgQueueError) as exc:
                log.warning("%s: metrics: reading the jobs table: %s", self.options.name, exc)
                stats, self._stats, self._rows = self._stats, None, None
                if stats is not None:
                    stats.close()
            self._read_at = time.monotonic()
            return self._rows


def _gauges(queues: list[str], rows: list[dict[str, Any]]) -> Iterator[Metric]:
    from prometheus_client.core import GaugeMetricFamily

    found = {(r["queue"], r["status"]): r for r in rows}
    jobs = GaugeMetricFamily(
        "pgqueue_jobs",
        "Jobs of the queue by status, counted through the partial indexes",
        labels=["queue", "status"],
    )
    oldest = GaugeMetricFamily(
        "pgqueue_oldest_ready_age_seconds",
        "How long the oldest runnable ready job has waited (0: none waits)",
        labels=["queue"],
    )
    for queue in queues:
        for status in STATUSES:
            row = found.get((queue, status))
            jobs.add_metric([queue, status], row["jobs"] if row else 0)
        ready = found.get((queue, "ready"))
        oldest.add_metric([queue], (ready and ready["oldest_ready_seconds"]) or 0.0)
    yield jobs
    yield oldest
