"""The ``pgqueue`` command. Exit codes: 0 ok, 1 runtime error, 2 usage or bad input."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from . import defaults
from .commands import (
    UsageError,
    cmd_cancel,
    cmd_enqueue,
    cmd_init,
    cmd_limit,
    cmd_pause,
    cmd_prune,
    cmd_reap,
    cmd_resume,
    cmd_retry_dead,
    cmd_show,
    cmd_stats,
)
from .db import describe_dsn, first_line, mask_dsn, resolve_dsn
from .errors import BadInput, PgQueueError
from .install import DEFAULT_LOCK_TIMEOUT


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (used as the console script's status)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: --processes reuses it
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
    )
    if args.pgbouncer:
        os.environ["PGQUEUE_PGBOUNCER"] = "1"  # every Queue and Worker of this command
    try:
        return int(args.func(args) or 0)
    except (UsageError, BadInput) as exc:
        return _fail(args, exc, 2)
    except PgQueueError as exc:
        return _fail(args, exc, 1)
    except BrokenPipeError:
        # `pgqueue stats | head -1`: the reader left; say nothing more, and keep Python
        # from complaining about the closed stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except psycopg.Error as exc:
        return _fail(args, f"{type(exc).__name__}: {first_line(exc)}", 1)
    except OSError as exc:  # PermissionError, a full disk, ...
        return _fail(args, f"{type(exc).__name__}: {exc}", 1)
    except KeyboardInterrupt:
        return 130


def _fail(args: argparse.Namespace, error: object, code: int) -> int:
    print(f"pgqueue {args.command}: {error}", file=sys.stderr)
    return code


class DefaultsHelp(argparse.HelpFormatter):
    """Help that shows each option's default (``--lease ... (default: 30.0)``), unless its
    text already says it or there is none to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgqueue",
        description="PostgreSQL as a job queue: SKIP LOCKED claims, leases, fencing tokens.",
        epilog="Database: --dsn, else PGQUEUE_DSN, else DATABASE_URL, else libpq's PGHOST/"
        "PGSERVICE/PGDATABASE, else an embedded server. Exit codes: 0 ok, 1 runtime error, "
        "2 usage or bad input, 3 server status: stopped.",
    )
    parser.add_argument("--dsn", help="libpq connection string or URL")
    parser.add_argument(
        "--pgbouncer",
        action="store_true",
        help="the DSN is PgBouncer in transaction mode: no prepared statements, no LISTEN "
        "(also PGQUEUE_PGBOUNCER=1)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int | None], help: str):
        p = sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelp)
        p.set_defaults(func=func)
        return p

    p = command("init", cmd_init, "create or upgrade the jobs table and its indexes (idempotent)")
    p.add_argument(
        "--notify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--no-notify drops the NOTIFY trigger (cheaper enqueues under many producers; "
        "workers poll), --notify adds it; neither keeps what is installed (a new table gets it)",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=DEFAULT_LOCK_TIMEOUT,
        metavar="SECONDS",
        help="how long a change may wait for a lock on jobs, then stop with who holds it "
        f"(default {DEFAULT_LOCK_TIMEOUT:g})",
    )

    p = command("enqueue", cmd_enqueue, "add jobs: one JSON object, or one per stdin line")
    p.add_argument("queue", nargs="?", help="queue name (or give it with --queue)")
    p.add_argument("payload", nargs="?", help="JSON object; omit to read one per line of stdin")
    p.add_argument(
        "--queue",
        "-q",
        dest="queue_option",
        metavar="QUEUE",
        help="queue name, as `pgqueue worker --queue` takes it (instead of the positional)",
    )
    p.set_defaults(usage_error=p.error)  # a queue missing or named twice: usage, exit 2
    p.add_argument("--delay", type=float, default=0.0, help="seconds before the job may run")
    p.add_argument("--max-attempts", type=int, default=5, help="attempts before it goes dead")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    p.add_argument("--key", help="unique key: while a live job of the queue holds it, add nothing")
    p.add_argument(
        "--group", help="the jobs' group (a tenant, say): see `pgqueue limit` (default: none)"
    )

    p = command(
        "limit",
        cmd_limit,
        "show or set a queue's per-group limit: at most N running jobs of one group at once, "
        "on every worker",
    )
    p.add_argument("queue", nargs="?", help="queue name (omit to list every limit)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--per-group", type=int, metavar="N", help="at most N running per group")
    how.add_argument("--remove", action="store_true", help="remove the queue's limit")

    p = command(
        "pause",
        cmd_pause,
        "pause a queue: from their next claim on, no worker on any host claims from it "
        "(running jobs go on; enqueues go on)",
    )
    p.add_argument("queue", nargs="?", help="queue name (omit to list the paused queues)")
    p = command("resume", cmd_resume, "let workers claim from a paused queue again")
    p.add_argument("queue", help="queue name")

    p = command("worker", cmd_worker, "run a worker: MODULE:FUNCTION is called with each job")
    p.add_argument(
        "handler",
        help="import path of the handler (myapp.jobs:send_email) or of a pgqueue.Tasks "
        "registry (myapp:tasks)",
    )
    p.add_argument(
        "--queue",
        "-q",
        action="append",
        help="queue to work on; repeat for several, in order of preference "
        "(default: a registry's queues, else 'default')",
    )
    p.add_argument(
        "--concurrency", "-c", type=int, default=1, help="lanes (threads; async: handlers at once)"
    )
    p.add_argument("--batch", type=int, default=1, help="jobs per claim")
    p.add_argument("--lease", type=float, default=defaults.LEASE, help="lease in seconds")
    p.add_argument(
        "--poll", type=float, default=defaults.POLL_INTERVAL, help="poll interval in seconds"
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=defaults.BACKOFF,
        help="retry after BACKOFF*2^attempts s",
    )
    p.add_argument(
        "--reap-interval",
        type=float,
        default=defaults.REAP_INTERVAL,
        help="seconds between reaps",
    )
    p.add_argument(
        "--timeout",
        type=float,
        help="fail a handler running longer than this many seconds (default: no timeout)",
    )
    p.add_argument(
        "--complete-each",
        action="store_true",
        help="complete each job in its own statement (default: one fenced statement a batch)",
    )
    p.add_argument(
        "--flush-after",
        type=float,
        default=defaults.FLUSH_AFTER,
        help="seconds a finished job may wait for its batch's completion",
    )
    p.add_argument("--no-listen", action="store_true", help="poll only, no LISTEN/NOTIFY")
    p.add_argument(
        "--listen-dsn", help="a direct connection for LISTEN (with --pgbouncer); else polling"
    )
    p.add_argument("--burst", action="store_true", help="exit when no runnable job is left")
    p.add_argument(
        "--name",
        default=f"worker-{os.getpid()}",
        help="name in logs and events (default: worker-<its process id>)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes, each with --concurrency threads, under one supervisor that "
        "forwards signals and restarts one that dies; 1: this process, no supervisor",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics on port N at /metrics (needs prometheus-client, the "
        "metrics extra)",
    )
    p.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address the metrics listen on (default 127.0.0.1, this host only; "
        "0.0.0.0 for every interface, so a scraper on another host can reach them)",
    )

    command("reap", cmd_reap, "return jobs with expired leases to the queue (or mark them dead)")

    p = command(
        "stats",
        cmd_stats,
        "ready, running and dead jobs by queue (finished ones estimated), and each periodic "
        "schedule's last and next slot",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--exact", action="store_true", help="count every status (reads the table)")

    p = command("prune", cmd_prune, "delete (or archive) finished jobs, in short batches")
    p.add_argument("--older-than", type=float, default=0.0, help="seconds since the job finished")
    p.add_argument("--archive", action="store_true", help="move them to jobs_archive")
    p.add_argument("--batch", type=int, default=10_000, help="jobs looked at per transaction")

    p = command("retry-dead", cmd_retry_dead, "give dead jobs more attempts")
    p.add_argument("queue", nargs="?", help="queue name (default 'default'; with --id: any)")
    p.add_argument("--id", type=int, action="append", dest="ids", help="only this job; repeat")
    p.add_argument("--extra", type=int, default=1, help="attempts to add")

    p = command(
        "cancel", cmd_cancel, "cancel jobs: a ready one never runs, a running one is fenced"
    )
    p.add_argument("ids", type=int, nargs="+", metavar="ID", help="job ids")

    p = command("show", cmd_show, "one job as it is now, with its result and durable steps")
    p.add_argument("id", type=int, metavar="ID", help="job id")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("server", cmd_server, "manage the embedded PostgreSQL server")
    p.add_argument("action", choices=["start", "stop", "status", "dsn"])

    p = command("demo", cmd_demo, "replay the paused-worker story and show the fence at work")
    p.add_argument("--pause", type=float, default=2.0, help="seconds worker A stays frozen")

    for name, (module, doc) in PLUGINS.items():
        # The plugin parses its own options. argparse's REMAINDER drops a leading option
        # such as --help (bpo-17050), so this parser treats no argument as an option.
        p = sub.add_parser(name, help=doc, description=doc, add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda a, module=module: _plugin(module, a.rest, a.dsn))
    return parser


# Commands with options of their own live in their own modules.
PLUGINS: dict[str, tuple[str, str]] = {
    "bench": ("pgqueue.tools.bench", "run the benchmarks and write CSV under data/"),
    "chaos": ("pgqueue.tools.chaos", "run workers under injected faults and check the promises"),
    "dashboard": (
        "pgqueue.contrib.dashboard.cli",
        "serve the web dashboard on 127.0.0.1 (needs pgqueue[dashboard]; docs/dashboard.md)",
    ),
}


def _plugin(module: str, rest: list[str], dsn: str | None) -> int:
    if dsn and "--dsn" not in rest:  # `pgqueue --dsn X bench` means the same as `bench --dsn X`
        rest = ["--dsn", dsn, *rest]
    return int(importlib.import_module(module).main(rest) or 0)


def load_handler(spec: str) -> Callable[..., Any]:
    """Import ``module:function``; a one-line UsageError if that is not possible."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"handler must look like module:function, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise UsageError(f"{module_name!r} has no function {attr!r}")
    return handler


def cmd_worker(args: argparse.Namespace) -> int | None:
    if not 1 <= args.processes <= 64:
        raise UsageError(f"--processes must be from 1 to 64, got {args.processes}")
    if args.processes > 1 and args.metrics_port is not None:
        raise UsageError(
            "--metrics-port serves one process: with --processes, run each worker with a "
            "port of its own instead"
        )
    if args.processes > 1:
        from .supervisor import Supervisor, child_argv, restart_limits

        resolve_dsn(args.dsn)  # start the embedded server (if it is the one) once, here
        supervisor = Supervisor(
            child_argv(args.argv),
            args.processes,
            name=args.name,
            burst=args.burst,
            **restart_limits(),
        )
        return supervisor.run()

    import asyncio

    from .async_worker import AsyncWorker, is_async_handler
    from .worker import Worker

    handler = load_handler(args.handler)
    dsn = resolve_dsn(args.dsn)
    is_async = is_async_handler(handler)  # async def: the asyncio worker, one event loop
    worker = (AsyncWorker if is_async else Worker)(
        handler,  # type: ignore[arg-type]
        queue=args.queue,
        dsn=dsn,
        concurrency=args.concurrency,
        batch=args.batch,
        lease=args.lease,
        poll_interval=args.poll,
        backoff=args.backoff,
        reap_interval=args.reap_interval,
        timeout=args.timeout,
        listen=not args.no_listen,
        listen_dsn=args.listen_dsn,
        burst=args.burst,
        name=args.name,
        complete_in_batches=not args.complete_each,
        flush_after=args.flush_after,
        record_events=False,  # nobody draws a timeline of a command-line worker
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
    )
    if args.metrics_port is not None:
        from .metrics import check_port

        check_port(args.metrics_port, args.metrics_addr)  # in use: one line, before anything starts
    logging.getLogger("pgqueue").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    # The worker's first line (the banner) and its notes come from its log, with the time,
    # -v or not. Its last line, the summary, is this command's output, on stdout: the worker
    # does not log it as well (with -v both were shown, and the banner twice).
    # -v: DEBUG too, where a failed attempt's traceback is logged after its one line.
    logging.getLogger("pgqueue.worker").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    worker._logs_summary = False
    worker._where = describe_dsn(args.dsn)
    if isinstance(worker, AsyncWorker):
        asyncio.run(worker.run())
    else:
        worker.run()
    print(
        f"{args.name}: {worker.done} done, {worker.failed} failed attempts "
        f"({worker.dead} now dead, {worker.timed_out} timed out), "
        f"{worker.rejected} late writes refused"
    )


def cmd_server(args: argparse.Namespace) -> int:
    from .server import default_server

    server = default_server()
    if args.action == "start":
        print(server.start())
    elif args.action == "stop":
        print("stopped" if server.stop() else "not running")
    elif args.action == "status":
        running = server.is_running()
        print(f"{'running' if running else 'stopped'}: {server.home}")
        print(f"in use: {describe_dsn(args.dsn)}")
        return 0 if running else 3
    else:
        print(server.dsn())
    return 0


def cmd_demo(args: argparse.Namespace) -> None:
    from .course.demo import run_demo
    from .course.lab import scratch_database

    dsn = resolve_dsn(args.dsn)
    logging.getLogger("pgqueue.worker").setLevel(logging.ERROR)  # the story says it all
    try:
        # A database of its own, dropped afterwards: nothing is left in yours.
        with scratch_database("pgqueue_demo", dsn) as target:
            print(f"database: {mask_dsn(target)} (dropped afterwards)")
            run_demo(target, pause=args.pause)
    except psycopg.errors.InsufficientPrivilege:
        print(f"database: {mask_dsn(dsn)} (no right to create one; the demo tidies up)")
        run_demo(dsn, pause=args.pause, tidy=True)
    from .server import default_server

    server = default_server()
    if dsn == server.dsn():  # no DSN configured: the demo started (or found) this one
        print(
            f"\nThe embedded PostgreSQL server is still running (data in {server.data}), "
            f"for the course and the next command.\nStop it with: {_this_command()} server stop"
        )


def _this_command() -> str:
    """How to run this command again: ``pgqueue`` if that is the one on PATH, else as it was
    run (``.venv/bin/pgqueue`` from ``make demo``), or ``python -m pgqueue``."""
    script = Path(sys.argv[0])
    if script.name != "pgqueue":
        return "python -m pgqueue"
    on_path = shutil.which("pgqueue")
    return "pgqueue" if on_path and Path(on_path).resolve() == script.resolve() else str(script)
