"""Prometheus metrics and OpenTelemetry spans of a real worker: real jobs on a real server,
the worker's own HTTP endpoint scraped and parsed, the gauges' plan on a big table, and
the bad inputs (a port in use or out of range, the package missing) as one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cli import PGQUEUE, ROOT, clean_env, pgqueue, user_error

from conftest import rows, wait_for
from pgqueue import AsyncWorker, BadInput, Job, Queue, Worker, statements, tracing
from pgqueue.engine import Phase

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
STATUSES = ("ready", "running", "dead")


def scrape(url: str) -> Samples:
    """Every sample the endpoint serves, parsed as Prometheus parses it."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def over(samples: Samples, name: str, bound: str, queue: str) -> float:
    """How many observations of histogram ``name`` were above ``bound`` seconds."""
    total = value(samples, f"{name}_count", queue=queue)
    return total - value(samples, f"{name}_bucket", queue=queue, le=bound)


@contextlib.contextmanager
def listening() -> Iterator[int]:
    """A port some other socket listens on, for the while."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("", 0))
        other.listen(1)
        yield other.getsockname()[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


# -- what a scrape shows ------------------------------------------------------------------
def test_a_scrape_shows_each_outcome_both_histograms_and_the_live_gauges(dsn: str) -> None:
    """Done, failed, dead, timed out and a refused late write (a paused handler whose job
    was cancelled under it), by queue; run and wait histograms; and ready, running and
    dead jobs and the oldest runnable job's age, read from the table."""
    entered, gate = threading.Event(), threading.Event()

    def handler(job: Job) -> None:
        kind = job.payload["kind"]
        if kind == "fail" or (kind == "flaky" and job.attempts == 1):
            raise ValueError(f"{kind} on attempt {job.attempts}")
        if kind == "slow":
            time.sleep(1.0)  # past the 0.3 s timeout
        if kind == "paused":
            entered.set()
            gate.wait(30)

    with Queue(dsn) as q:
        q.enqueue_many([{"kind": "ok"}] * 3, queue="m")
        q.enqueue({"kind": "flaky"}, queue="m")  # fails once, then done
        q.enqueue({"kind": "fail"}, queue="m", max_attempts=1)  # dead
        q.enqueue({"kind": "slow"}, queue="m", max_attempts=1)  # timed out, dead
        worker = Worker(
            handler,
            dsn=dsn,
            queue="m",
            metrics_port=0,
            timeout=0.3,
            backoff=0.01,
            poll_interval=0.1,
        ).start()
        try:
            assert worker.engine.metrics is not None
            url = worker.metrics_url  # the port it listens on, metrics_port=0 having chosen it
            assert url == worker.engine.metrics.url and not url.endswith(":0/metrics")
            wait_for(lambda: (worker.done, worker.failed) == (4, 3), what="the first jobs")
            # One lane, one job held at most: while the paused handler waits, a runnable
            # job enqueued a minute ago (by the server's clock) waits in the table.
            paused = q.enqueue({"kind": "paused"}, queue="m")
            assert entered.wait(10)
            (a_minute_ago,) = rows(dsn, "SELECT now() - interval '60 seconds'")[0]
            q.enqueue({"kind": "ok"}, queue="m", run_at=a_minute_ago)
            q.enqueue({"kind": "ok"}, queue="m", delay=3600)  # ready, not runnable yet
            live = scrape(url)
            assert value(live, "pgqueue_stats_up") == 1
            jobs = {s: value(live, "pgqueue_jobs", queue="m", status=s) for s in STATUSES}
            assert jobs == {"ready": 2, "running": 1, "dead": 2}
            assert 60 <= value(live, "pgqueue_oldest_ready_age_seconds", queue="m") < 3600
            assert value(live, "pgqueue_late_writes_refused_total", queue="m") == 0
            q.cancel(paused)  # the fence rises under the paused handler
            gate.set()  # ... which returns: its completion is refused
            wait_for(lambda: (worker.rejected, worker.done) == (1, 5), what="the refusal")

            after = scrape(url)
            counters = {
                name: value(after, f"pgqueue_{name}_total", queue="m")
                for name in (
                    "jobs_done",
                    "jobs_failed",
                    "jobs_dead",
                    "jobs_timed_out",
                    "late_writes_refused",
                    "writes_given_up",
                )
            }
            assert counters == {
                "jobs_done": 5,  # 3 ok, flaky's second attempt, the one due a minute ago
                "jobs_failed": 3,  # flaky's first attempt, fail, slow
                "jobs_dead": 2,  # fail, slow (one attempt each)
                "jobs_timed_out": 1,  # slow
                "late_writes_refused": 1,  # the paused handler's completion
                "writes_given_up": 0,
            }
            # 9 attempts claimed and run: 3 ok, flaky twice, fail, slow, paused, the late one
            assert value(after, "pgqueue_job_run_seconds_count", queue="m") == 9
            assert value(after, "pgqueue_job_wait_seconds_count", queue="m") == 9
            assert over(after, "pgqueue_job_run_seconds", "0.25", "m") >= 1  # slow: >= 0.3 s
            # The job due a minute ago waited at least that long; no other one near it.
            assert over(after, "pgqueue_job_wait_seconds", "30", "m") == 1
            assert value(after, "pgqueue_job_wait_seconds_sum", queue="m") >= 60
            assert "process_cpu_seconds_total" in {name for name, _ in after}
            # The gauges move with the table, at most every REFRESH seconds.
            wait_for(
                lambda: value(scrape(url), "pgqueue_jobs", queue="m", status="running") == 0,
                what="the gauges to see the table again",
            )
        finally:
            gate.set()
            worker.stop()
    with pytest.raises(OSError):  # stopped: the port is closed
        scrape(url)


def test_the_claim_says_how_long_each_job_had_been_due(queue: Queue, dsn: str) -> None:
    """``Job.waited``: the claim's own ``now() - run_at``, the server's clock only."""
    (a_minute_ago,) = rows(dsn, "SELECT now() - interval '60 seconds'")[0]
    queue.enqueue({}, queue="w", run_at=a_minute_ago)
    [job] = queue.claim("w")
    assert job.waited is not None and 60 <= job.waited < 3600


def test_an_async_worker_counts_its_jobs_the_same_way(dsn: str) -> None:
    async def handler(job: Job) -> None:
        if job.payload["fail"]:
            raise ValueError("boom")

    async def main() -> Samples:
        worker = AsyncWorker(handler, dsn=dsn, queue="a", metrics_port=0, backoff=0.01)
        await worker.start()
        try:
            assert worker.engine.metrics is not None
            while (worker.done, worker.dead) != (3, 1):
                await asyncio.sleep(0.05)
            return await asyncio.to_thread(scrape, worker.engine.metrics.url)
        finally:
            await worker.stop()

    with Queue(dsn) as q:
        q.enqueue_many([{"fail": False}] * 3, queue="a")
        q.enqueue({"fail": True}, queue="a", max_attempts=1)
    samples = asyncio.run(asyncio.wait_for(main(), 30))
    assert value(samples, "pgqueue_jobs_done_total", queue="a") == 3
    assert value(samples, "pgqueue_jobs_dead_total", queue="a") == 1
    assert value(samples, "pgqueue_job_run_seconds_count", queue="a") == 4
    assert value(samples, "pgqueue_jobs", queue="a", status="dead") == 1


def test_the_gauges_read_the_partial_indexes_not_the_table(dsn: str) -> None:
    """300,000 done jobs and a few live ones: the statement the gauges run reads
    through jobs_ready_idx, jobs_lease_idx and jobs_dead_idx, never a sequential scan of
    jobs, and touches a small part of the table's pages; a scrape counts the live ones."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO jobs (queue, payload, status, attempts, fence, started_at, finished_at)"
            " SELECT 'm', '{}', 'done', 1, 1, now(), now() FROM generate_series(1, 300000)"
        )
        conn.execute(
            "INSERT INTO jobs (queue, payload, status, run_at, attempts, fence, lease_until,"
            " last_error, finished_at)"
            " SELECT 'm', '{}', s, now() + interval '1 hour', 1, 1,"
            "  CASE s WHEN 'running' THEN now() + interval '1 hour' END,"
            "  CASE s WHEN 'dead' THEN 'boom' END, CASE s WHEN 'dead' THEN now() END"
            " FROM unnest(array['ready', 'running', 'dead']) AS s, generate_series(1, 20)"
        )
        conn.execute("ANALYZE jobs")
        (pages,) = conn.execute("SELECT relpages FROM pg_class WHERE relname = 'jobs'").fetchone()
        ((plan,),) = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statements.query("stats")
        ).fetchone()
    nodes = list(_nodes(plan["Plan"]))
    scans = {(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes}
    assert not [s for s in scans if s[0] == "Seq Scan"], json.dumps(plan, indent=1)
    used = {index for _, _, index in scans}
    assert {"jobs_ready_idx", "jobs_lease_idx", "jobs_dead_idx"} <= used, scans
    touched = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert pages > 1000 and touched < pages / 20, (touched, pages)

    worker = Worker(lambda job: None, dsn=dsn, queue="m", metrics_port=0).start()
    try:
        assert worker.engine.metrics is not None
        samples = scrape(worker.engine.metrics.url)
    finally:
        worker.stop()
    assert {s: value(samples, "pgqueue_jobs", queue="m", status=s) for s in STATUSES} == {
        "ready": 20,
        "running": 20,
        "dead": 20,
    }


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def test_the_cli_worker_serves_metrics_on_its_port(dsn: str) -> None:
    with Queue(dsn) as q:
        q.enqueue_many([{"n": n} for n in range(5)], queue="cm")
    port = free_port()
    command = [PGQUEUE, "worker", "tests.handlers:noop", "--queue", "cm"]
    command += ["--metrics-port", str(port)]
    with subprocess.Popen(
        command,
        env=clean_env(PGQUEUE_DSN=dsn),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:

            def done() -> float:
                with contextlib.suppress(OSError):  # not listening yet
                    return value(
                        scrape(f"http://localhost:{port}/metrics"),
                        "pgqueue_jobs_done_total",
                        queue="cm",
                    )
                return 0.0

            assert wait_for(lambda: done() == 5, what="five jobs done, as scraped")
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "5 done" in out


# -- bad input: one line, and nothing started -----------------------------------------------
@pytest.mark.parametrize("port", [-1, 65536, "9100", True, 9100.0])
def test_a_metrics_port_out_of_range_is_one_line(dsn: str, port: Any) -> None:
    with pytest.raises(BadInput, match=r"^metrics_port must be a whole number from 0 to 65535"):
        Worker(lambda job: None, dsn=dsn, metrics_port=port)


def test_a_metrics_port_in_use_stops_the_worker_before_it_claims(dsn: str) -> None:
    with Queue(dsn) as q:
        job_id = q.enqueue({}, queue="m")
    with listening() as port:
        worker = Worker(lambda job: None, dsn=dsn, queue="m", metrics_port=port)
        with pytest.raises(BadInput) as caught:
            worker.start()
        message = str(caught.value)
        assert message == (
            f"metrics port {port} on 127.0.0.1 is in use (another process listens on it): "
            "choose another metrics_port (--metrics-port) or metrics_addr (--metrics-addr)"
        )
        assert worker.engine.phase == Phase.NEW and worker.engine._tasks == []

        async def main() -> None:
            async def handler(job: Job) -> None: ...

            aworker = AsyncWorker(handler, dsn=dsn, queue="m", metrics_port=port)
            with pytest.raises(BadInput, match=f"^metrics port {port} on 127.0.0.1 is in use"):
                await aworker.start()
            assert aworker.engine.phase == Phase.NEW

        asyncio.run(main())
        command = ["worker", "tests.handlers:noop", "-q", "m", "--metrics-port", str(port)]
        result = pgqueue(*command, dsn=dsn)
        assert user_error(result, 2) == f"pgqueue worker: {message}"
    assert rows(dsn, "SELECT status, attempts FROM jobs WHERE id = %s", [job_id]) == [("ready", 0)]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--metrics-port", "70000"], "metrics_port must be a whole number from 0 to 65535"),
        (["--metrics-port", "9100", "--processes", "2"], "--metrics-port serves one process"),
    ],
)
def test_the_cli_refuses_a_bad_metrics_port_in_one_line(
    dsn: str, args: list[str], expected: str
) -> None:
    result = pgqueue("worker", "tests.handlers:noop", *args, dsn=dsn)
    assert user_error(result, 2).startswith(f"pgqueue worker: {expected}")


def test_without_prometheus_client_a_metrics_port_is_one_line(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(
        BadInput,
        match=r'prometheus-client \(or pip install -e "\.\[metrics\]" in your pgqueue clone\)$',
    ):
        Worker(lambda job: None, dsn=dsn, metrics_port=0)
    Worker(lambda job: None, dsn=dsn)  # without a port the package is never imported


# -- OpenTelemetry ------------------------------------------------------------------------
@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An SDK tracer provider with an in-memory exporter, as the configured provider of
    this test only (the global one can be set once a process)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter
    provider.shutdown()


def test_each_job_runs_in_a_process_span_with_the_messaging_attributes(
    dsn: str, spans: Any
) -> None:
    from opentelemetry import trace

    def handler(job: Job) -> None:
        with trace.get_tracer("app").start_as_current_span("inner"):
            if job.payload["fail"]:
                raise ValueError("boom")

    with Queue(dsn) as q:
        ok = q.enqueue({"fail": False}, queue="t")
        bad = q.enqueue({"fail": True}, queue="t", max_attempts=1)
    Worker(handler, dsn=dsn, queue="t", burst=True).run()
    finished = spans.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)
    jobs = {span.attributes["messaging.message.id"]: span for span in by_name["process t"]}
    assert set(jobs) == {str(ok), str(bad)}
    for span in jobs.values():
        assert span.kind == trace.SpanKind.CONSUMER
        assert {k: v for k, v in span.attributes.items() if k.startswith("messaging.")} == {
            "messaging.system": "pgqueue",
            "messaging.destination.name": "t",
            "messaging.message.id": span.attributes["messaging.message.id"],
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
        }
        assert span.attributes["pgqueue.job.attempt"] == 1
    assert jobs[str(ok)].status.status_code == trace.StatusCode.UNSET
    assert jobs[str(bad)].status.status_code == trace.StatusCode.ERROR
    assert "ValueError: boom" in (jobs[str(bad)].status.description or "")
    # The handler's own spans are children of its job's span.
    parents = {span.parent.span_id for span in by_name["inner"] if span.parent}
    assert parents == {span.context.span_id for span in jobs.values()}


def test_an_async_handler_timed_out_ends_its_span_as_an_error(dsn: str, spans: Any) -> None:
    from opentelemetry import trace

    async def handler(job: Job) -> None:
        await asyncio.sleep(job.payload["sleep"])

    with Queue(dsn) as q:
        quick = q.enqueue({"sleep": 0}, queue="t")
        hung = q.enqueue({"sleep": 30}, queue="t", max_attempts=1)
    asyncio.run(AsyncWorker(handler, dsn=dsn, queue="t", timeout=0.2, burst=True).run())
    status = {
        s.attributes["messaging.message.id"]: s.status.status_code
        for s in spans.get_finished_spans()
    }
    assert status == {str(quick): trace.StatusCode.UNSET, str(hung): trace.StatusCode.ERROR}


def test_without_a_tracer_provider_or_the_package_there_is_no_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry import trace

    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    assert tracing.job_spans() is tracing.no_span  # installed, nothing configured
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # not installed
    assert tracing.job_spans() is tracing.no_span


def test_metrics_url_is_none_without_metrics_and_says_the_chosen_port_with_them(
    dsn: str,
) -> None:
    assert Worker(lambda job: None, dsn=dsn, queue="m").metrics_url is None

    async def noop(job: Job) -> None:
        pass

    assert AsyncWorker(noop, dsn=dsn, queue="m").metrics_url is None
    worker = Worker(lambda job: None, dsn=dsn, queue="m", metrics_port=0).start()
    try:
        url = worker.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert not url.endswith(":0/metrics")  # the port listened on, not the 0 asked for
        assert ("pgqueue_stats_up", ()) in scrape(url)
    finally:
        worker.stop()
