"""Benchmark 7, the worker as a user runs it: ``pgqueue worker`` in a subprocess, default
flags but ``--concurrency 4 --batch 10 --burst``, against the hand-written loop of
``drain.py`` and pgbench, all on the same SQL (``claim`` and ``complete_many`` of
``sql/queries.sql``), each run draining the same prefilled jobs.

Two clocks, both reported, nothing subtracted: ``span`` is first claim to last completion
as the database saw them (``min(started_at)`` to ``max(finished_at)``, the server's clock),
the rate a long-running worker keeps up; ``wall`` is the whole process, from launch to
exit, as a cron job or a ``--burst`` run pays it (the CLI's interpreter start-up and
imports, pgbench's and the hand loop's connection set-up)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ... import statements
from ...db import connect
from ...worker import Worker
from .drain import _client_cpu, hand_loop
from .runner import QUEUE, Bench, _count, _noop, _progress, _spread, prefill

# The handlers the subprocess workers import, as a user's module would hold them.
HANDLERS = '''\
"""Benchmark handlers: a no-op, and a fixed pure-Python loop (payload "n" iterations)."""


def noop(job):
    """Do nothing: the queue's own cost is all that is measured."""


def spin(job):
    """Burn CPU in pure Python, holding the GIL (about 20 ms at the calibrated "n")."""
    total = 0
    for i in range(job.payload["n"]):
        total += i * i
    return None
'''
HANDLER_MODULE = "bench_handlers"
CLI_FLAGS = ["--concurrency", "4", "--batch", "10"]
SYSTEMS = ("cli-worker", "worker-library", "hand-loop", "pgbench")


@contextlib.contextmanager
def handler_dir() -> Iterator[Path]:
    """A temporary directory holding ``bench_handlers.py`` (the worker's working directory)."""
    with tempfile.TemporaryDirectory(prefix="pgqueue-bench-handlers-") as tmp:
        (Path(tmp) / f"{HANDLER_MODULE}.py").write_text(HANDLERS, encoding="utf-8")
        yield Path(tmp)


def pgqueue_command() -> list[str]:
    """``pgqueue`` as a user types it: the console script beside this interpreter, else
    ``python -m pgqueue``."""
    script = Path(sys.executable).with_name("pgqueue")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgqueue"]


def _clean_env(dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "DATABASE_URL"))}
    env["PGQUEUE_DSN"] = dsn  # not on the command line: DSNs can hold passwords
    return env


def run_cli(dsn: str, handler: str, flags: Sequence[str], cwd: Path) -> tuple[float, float, str]:
    """Run ``pgqueue worker bench_handlers:<handler> --queue bench <flags> --burst`` to the
    end; return its wall seconds, its start (``time.time()``) and its output."""
    cmd = [*pgqueue_command(), "worker", f"{HANDLER_MODULE}:{handler}", "--queue", QUEUE]
    cmd += [*flags, "--burst"]
    launched = time.time()
    started = time.perf_counter()
    result = subprocess.run(
        cmd, cwd=cwd, env=_clean_env(dsn), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[1:])} exited {result.returncode}: {result.stderr[-500:]}"
        )
    return wall, launched, result.stdout + result.stderr


def db_span(dsn: str) -> tuple[float, float, float]:
    """First claim to last completion in seconds, and both moments (epoch seconds),
    from the jobs' ``started_at``/``finished_at`` (the server's clock)."""
    with connect(dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM min(started_at))::float8,"
            " extract(epoch FROM max(finished_at))::float8 FROM jobs"
        ).fetchone()
    assert row is not None and row[0] is not None and row[1] is not None
    return row[1] - row[0], row[0], row[1]


# pgbench runs the Worker's own statements, taken from sql/queries.sql: the claim, whose
# rows come back as arrays (one per column, so the reply carries the same data) into
# \gset variables, then complete_many with the ids and fences. The claim's row of NULLs
# for a queue with a per-group limit is left out: the benchmark's queue has none.
_CLAIM_TAIL = (
    "(SELECT id, queue, payload, fence, attempts, max_attempts, lease_until,\n"
    "        extract(epoch FROM now() - run_at)::float8 AS waited\n"
    " FROM claimed\n ORDER BY priority DESC, run_at, id)\n"
    "UNION ALL\n"
    "SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM limited WHERE yes;"
)
_CLAIM_ARRAYS = (
    "SELECT coalesce(array_agg(id ORDER BY priority DESC, run_at, id), '{{}}') AS ids,\n"
    "  coalesce(array_agg(queue), '{{}}') AS queues,\n"
    "  coalesce(array_agg(payload), '{{}}') AS payloads,\n"
    "  coalesce(array_agg(fence ORDER BY priority DESC, run_at, id), '{{}}') AS fences,\n"
    "  coalesce(array_agg(attempts), '{{}}') AS attempts,\n"
    "  coalesce(array_agg(max_attempts), '{{}}') AS max_attempts,\n"
    "  coalesce(array_agg(lease_until), '{{}}') AS leases,\n"
    "  coalesce(array_agg(extract(epoch FROM now() - run_at)), '{{}}') AS waits\n"
    "FROM claimed \\gset"
)


def pgbench_script(batch: int, lease: float = 30.0) -> str:
    """The pgbench script: ``claim`` and ``complete_many`` exactly as in queries.sql (the
    claim's closing SELECT aggregated into arrays for ``\\gset``)."""
    claim = statements.query("claim")
    if _CLAIM_TAIL not in claim:
        raise RuntimeError("the claim in queries.sql changed: update cli_worker.pgbench_script")
    claim = claim.replace(_CLAIM_TAIL, _CLAIM_ARRAYS.format())
    claim = claim.replace("%(queue)s", f"'{QUEUE}'").replace("%(limit)s", str(batch))
    claim = claim.replace("%(lease)s", repr(float(lease)))
    complete = statements.query("complete_many")
    complete = complete.replace("%(ids)s", ":ids").replace("%(fences)s", ":fences")
    return f"{claim.strip()}\n{complete.strip().rstrip(';')};\n"


def pgbench_run(pgbench: Path, dsn: str, clients: int, batch: int, n_jobs: int) -> float:
    """Drain the prefilled queue with ``pgbench_script`` from ``clients`` connections (two
    pgbench threads), enough runs per client to empty it; return wall seconds."""
    per_client = -(-n_jobs // (clients * batch))
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(pgbench_script(batch))
    try:
        cmd = [str(pgbench), "-n", "-M", "prepared", "-f", script.name]
        cmd += ["-c", str(clients), "-j", str(min(2, clients)), "-t", str(per_client), dsn]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        started = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        elapsed = time.perf_counter() - started
    finally:
        os.unlink(script.name)
    if result.returncode != 0:
        raise RuntimeError(f"pgbench failed: {(result.stderr or result.stdout).strip()[-500:]}")
    return elapsed


def cli_worker_once(
    dsn: str, system: str, n_jobs: int, cwd: Path, pgbench: Path | None = None
) -> dict[str, float]:
    """Prefill ``n_jobs`` no-op jobs and drain them with ``system``; return span and wall
    jobs/s, start-up and exit seconds (CLI only, else 0) and client CPU us per job."""
    prefill(dsn, n_jobs)
    cpu = _client_cpu()
    launched, startup, exit_s = time.time(), 0.0, 0.0
    if system == "cli-worker":
        wall, launched, out = run_cli(dsn, "noop", CLI_FLAGS, cwd)
        if f" {n_jobs} done" not in out:
            raise RuntimeError(f"cli worker: unexpected summary: {out.strip()[-300:]}")
    elif system == "worker-library":
        # The CLI's Worker, built as cmd_worker builds it, in this process: what the CLI
        # process adds (interpreter, imports, exit) is the difference.
        worker = Worker(
            _noop, queue=QUEUE, dsn=dsn, concurrency=4, batch=10, burst=True, record_events=False
        )
        started = time.perf_counter()
        worker.run()
        wall = time.perf_counter() - started
    elif system == "hand-loop":
        wall = hand_loop(dsn, 4, 10, batched=True)
    elif system == "pgbench":
        wall = pgbench_run(pgbench or Path("pgbench"), dsn, 4, 10, n_jobs)
    else:
        raise ValueError(f"unknown system {system!r}")
    cpu = _client_cpu() - cpu
    if (done := _count(dsn, "done")) != n_jobs:
        raise RuntimeError(f"{system}: {done} of {n_jobs} jobs done")
    span, first, last = db_span(dsn)
    if system in ("cli-worker", "worker-library"):
        startup, exit_s = first - launched, launched + wall - last
    return {
        "span": n_jobs / span,
        "wall": n_jobs / wall,
        "startup": startup,
        "exit": exit_s,
        "cpu": cpu / n_jobs * 1e6,
    }


def empty_queue_run(dsn: str, cwd: Path) -> tuple[float, float]:
    """The CLI worker's fixed cost: a run against an empty queue (start, connect, one
    claim, exit); its wall seconds and CPU seconds."""
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs")
    cpu = _client_cpu()
    wall, _, _ = run_cli(dsn, "noop", CLI_FLAGS, cwd)
    return wall, _client_cpu() - cpu


def _ratios(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-repetition ratios a[i] / b[i]."""
    return _spread([x / y for x, y in zip(a, b, strict=True)])


def bench_cli_worker(
    bench: Bench, *, n_jobs: int | None = None, repeats: int | None = None
) -> list[dict[str, Any]]:
    """Drain jobs/s of the CLI worker, the same Worker in this process, the hand loop and
    pgbench, interleaved (rotated order), with ratios taken within each repetition; and the
    CLI's run against an empty queue (its fixed cost)."""
    n_jobs = n_jobs or (5_000 if bench.quick else 20_000)
    repeats = repeats or bench.repeats + (0 if bench.quick else 2)
    dsn = bench.database("bench_cli_worker")
    pgbench = bench.pgbench()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
    empty: list[tuple[float, float]] = []
    bar = _progress((len(SYSTEMS) + 1) * repeats, "cli worker", bench.progress)
    try:
        with handler_dir() as cwd:
            for rep in range(repeats):
                k = rep % len(SYSTEMS)
                for system in SYSTEMS[k:] + SYSTEMS[:k]:
                    bar.set_postfix_str(system)
                    runs[system].append(cli_worker_once(dsn, system, n_jobs, cwd, pgbench))
                    bar.update()
                bar.set_postfix_str("cli-worker, empty queue")
                empty.append(empty_queue_run(dsn, cwd))
                bar.update()
    finally:
        bar.close()
    series = {s: {k: [r[k] for r in rs] for k in rs[0]} for s, rs in runs.items()}
    rows = []
    for system in SYSTEMS:
        s = series[system]
        med, lo, hi = _spread(s["span"])
        wmed, wlo, whi = _spread(s["wall"])
        row: dict[str, Any] = {
            "system": system,
            "command": COMMANDS[system],
            "concurrency": 4,
            "batch": 10,
            "n_jobs": n_jobs,
            "runs": len(s["span"]),
            "jobs_per_s_median": round(med, 1),
            "jobs_per_s_min": round(lo, 1),
            "jobs_per_s_max": round(hi, 1),
            "wall_jobs_per_s_median": round(wmed, 1),
            "wall_jobs_per_s_min": round(wlo, 1),
            "wall_jobs_per_s_max": round(whi, 1),
        }
        for other in SYSTEMS[1:]:
            key = other.replace("-", "_")
            r = _ratios(s["span"], series[other]["span"])
            row |= {f"ratio_to_{key}{t}": round(v, 3) for t, v in zip(RANGE, r, strict=True)}
            row[f"wall_ratio_to_{key}"] = round(_ratios(s["wall"], series[other]["wall"])[0], 3)
        timed = system in ("cli-worker", "worker-library")
        row["startup_s_median"] = round(_spread(s["startup"])[0], 3) if timed else ""
        row["exit_s_median"] = round(_spread(s["exit"])[0], 3) if timed else ""
        row["client_cpu_us_per_job"] = round(_spread(s["cpu"])[0], 1)
        cli = system == "cli-worker"
        row["empty_queue_s_median"] = round(_spread([e[0] for e in empty])[0], 3) if cli else ""
        row["empty_queue_cpu_s_median"] = round(_spread([e[1] for e in empty])[0], 3) if cli else ""
        rows.append(row)
    return rows


RANGE = ("", "_min", "_max")
COMMANDS = {
    "cli-worker": f"pgqueue worker {HANDLER_MODULE}:noop --queue {QUEUE} "
    + " ".join(CLI_FLAGS)
    + " --burst (PGQUEUE_DSN set; listen, poll 2 s, batched completion: the defaults)",
    "worker-library": "Worker(noop, concurrency=4, batch=10, burst=True, record_events=False), "
    "other arguments default (as cmd_worker builds it), .run() in the benchmark process",
    "hand-loop": "drain.hand_loop: 4 threads, claim 10, complete_many (queries.sql), "
    "autocommit, prepared",
    "pgbench": "pgbench -n -M prepared -c 4 -j 2 -t N: claim + complete_many from "
    "queries.sql (claim rows returned as arrays)",
}
