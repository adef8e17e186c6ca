"""Test helpers for code that uses pgqueue: a throwaway database per test, the enqueued jobs
run inline through the real claim, complete and fail statements, and what was enqueued
asserted with a readable failure. See docs/testing.md.

With pytest, installing pgqueue registers the fixtures (the ``pytest11`` entry point):

- ``pgqueue_dsn``: a DSN for a fresh database of the test's own with the pgqueue table
  installed, cloned from a template made once per session (CREATE DATABASE ... TEMPLATE:
  milliseconds), dropped after the test;
- ``pgqueue_queue``: a ``Queue`` on that database;
- ``pgqueue_databases``: the session's ``Databases`` (to make more databases).

The server is the one ``PGQUEUE_DSN`` names (its user must be allowed to create databases),
else a throwaway embedded server, fsync off, started once per session and removed after.

Without pytest: ``Databases``, ``drain`` and ``assert_enqueued`` are plain Python. pytest is
imported only by ``pytest_configure``, which only pytest calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import types
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus

from .errors import BadInput
from .handlers import LEFT_OPEN, Done, Failure, failure_of, is_coroutine_function, outcome_of
from .job import Job
from .queue import JobState, Queue
from .server import EmbeddedServer
from .tasks import Tasks

if TYPE_CHECKING:
    import pytest

__all__ = ["Databases", "Drained", "assert_enqueued", "drain"]

MAX_RUNS = 1_000  # drain's default bound on handler runs: a handler that enqueues for ever


# -- throwaway databases -----------------------------------------------------------------
class Databases:
    """Fresh databases with the pgqueue table, each cloned from a template installed once:
    on the server ``admin_dsn`` names (its user may create databases), else on a
    throwaway embedded server started here (fsync off) and stopped by ``close()``."""

    def __init__(self, admin_dsn: str | None = None) -> None:
        self._home: Path | None = None
        self._server: EmbeddedServer | None = None
        if admin_dsn is None:
            self._home = Path(tempfile.mkdtemp(prefix="pgqueue-testing-"))
            self._home.chmod(0o755)  # as root, the server runs as another user who must reach it
            self._server = EmbeddedServer(self._home, durable=False)
            admin_dsn = self._server.start()
        self.admin_dsn = admin_dsn
        # A name of this session's own: sessions side by side (pytest-xdist's workers on one
        # PGQUEUE_DSN) each clone their own template.
        self.template = f"pgqueue_template_{uuid.uuid4().hex[:12]}"
        self._made: list[str] = []
        self._create(self.template)
        with Queue(make_conninfo(admin_dsn, dbname=self.template)) as q:
            q.install()

    @classmethod
    def from_environment(cls) -> Databases:
        """On the server of ``PGQUEUE_DSN`` if it is set, else on a throwaway embedded one."""
        return cls(os.environ.get("PGQUEUE_DSN") or None)

    def create(self) -> str:
        """A new database with the pgqueue table installed; its DSN."""
        name = f"pgqueue_test_{uuid.uuid4().hex[:12]}"
        self._create(name, template=self.template)
        return make_conninfo(self.admin_dsn, dbname=name)

    def drop(self, dsn: str) -> None:
        """Drop a database ``create`` made (its connections are cut)."""
        name = psycopg.conninfo.conninfo_to_dict(dsn).get("dbname")
        if isinstance(name, str) and name in self._made:
            self._drop(name)

    def close(self) -> None:
        """Drop every database made here and the template; stop the server if it is ours."""
        for name in reversed(self._made):
            with contextlib.suppress(psycopg.Error):
                self._drop(name)
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.stop()
            self._server = None
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def __enter__(self) -> Databases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self, name: str, template: str | None = None) -> None:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(statement)
        self._made.append(name)

    def _drop(self, name: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        self._made.remove(name)


# -- running the enqueued jobs inline ------------------------------------------------------
@dataclass
class Drained:
    """What ``drain`` did. Ids are job ids; a job retried and then done is in ``failed``
    (once per failed attempt) and in ``done``."""

    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # one entry per failed attempt
    dead: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # failed, to retry later: not waited for
    lost: list[int] = field(default_factory=list)  # a write refused: another holder has it
    errors: dict[int, str] = field(default_factory=dict)  # each job's last error
    results: dict[int, Any] = field(default_factory=dict)  # what each done job's handler returned

    @property
    def counts(self) -> dict[str, int]:
        """How many jobs ended each way, and how many attempts failed."""
        return {
            "done": len(self.done),
            "failed": len(self.failed),
            "dead": len(self.dead),
            "pending": len(self.pending),
            "lost": len(self.lost),
        }

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {what}" for what, n in self.counts.items())
        errors = "; ".join(f"job {i}: {e}" for i, e in self.errors.items())
        return counts + (f" ({errors})" if errors else "")


def drain(
    queue: Queue,
    handler: Callable[[Job], Any] | Tasks,
    *,
    queues: str | Sequence[str] | None = None,
    backoff: float = 1.0,
    batch: int = 10,
    lease: float = 60.0,
    max_runs: int = MAX_RUNS,
) -> Drained:
    """Run the jobs of ``queues`` that are runnable now, in this thread, through the queue's
    own ``claim``, ``complete`` and ``fail`` (so fences, attempts, backoff, dead jobs and
    stored results are the real ones), until none is; return what happened. Never sleeps:
    a job that failed and retries later (``backoff * 2**attempts`` seconds, as a worker
    would; ``backoff=0``: at once, so it runs again here until done or dead) is reported
    ``pending``, as are none of the jobs that were not due. A handler is a plain function
    of the job, or a ``Tasks`` registry (its queues by default, each task's own backoff);
    what it returns is stored as the job's result; ``GiveUp`` and ``RetryAfter`` work as
    in a worker. There is no timeout and no second lane: one job runs at a time."""
    if is_coroutine_function(handler):
        raise BadInput(
            "drain runs plain functions; run an async def handler with "
            "pgqueue.AsyncWorker(handler, burst=True) instead"
        )
    names = _queue_names(handler, queues)
    if not isinstance(max_runs, int) or max_runs < 1:
        raise BadInput(f"max_runs must be a whole number >= 1, got {max_runs!r}")
    report, runs, outcome = Drained(), 0, dict[int, str]()
    while jobs := queue.claim(names, limit=batch, lease=lease):
        for job in jobs:
            if runs >= max_runs:
                queue.release(job)  # given back unrun: the attempt does not count
                continue
            runs += 1
            _run_one(queue, handler, job, backoff, report, outcome)
        if runs >= max_runs:
            raise RuntimeError(
                f"drain ran {runs} handlers and the queues are not dry (a handler that "
                f"enqueues more jobs each time?); so far: {report}; raise max_runs to go on"
            )
    report.pending = [i for i, end in outcome.items() if end == "ready"]
    return report


def _queue_names(
    handler: Callable[[Job], Any] | Tasks, queues: str | Sequence[str] | None
) -> list[str]:
    if queues is None:
        if isinstance(handler, Tasks):
            if not handler.queues:
                raise BadInput("the Tasks registry has no task: nothing to drain")
            return handler.queues
        return ["default"]
    return [queues] if isinstance(queues, str) else list(queues)


def _run_one(
    queue: Queue,
    handler: Callable[[Job], Any] | Tasks,
    job: Job,
    backoff: float,
    report: Drained,
    outcome: dict[int, str],
) -> None:
    """Run one claimed job and end it as a worker would: complete, or fail with backoff."""
    task_backoff, value = backoff, None
    if isinstance(handler, Tasks):
        with contextlib.suppress(LookupError):  # an unknown task fails below, as in a worker
            task = handler.for_job(job)
            if task.backoff is not None:
                task_backoff = task.backoff
            if is_coroutine_function(task.fn):
                queue.release(job)
                raise BadInput(
                    f"task {task.name!r} is async def: drain runs plain tasks; run it with "
                    "pgqueue.AsyncWorker(tasks, burst=True)"
                )
    try:
        value = handler(job)
        ended: Done | Failure | None = outcome_of(value)
    except (KeyboardInterrupt, SystemExit):
        queue.release(job)  # stopping the test run: the job was not done
        raise
    except BaseException as exc:  # user code: whatever it raised fails the job
        ended = failure_of(exc)
    conn = queue.conn
    if conn.info.transaction_status != TransactionStatus.IDLE:
        conn.rollback()  # the handler left the queue's connection in a transaction
        ended = LEFT_OPEN
    if isinstance(ended, Failure):
        took = queue.fail(
            job, ended.error, backoff=task_backoff, delay=ended.delay, give_up=ended.give_up
        )
        if not took:
            report.lost.append(job.id)
            return
        report.failed.append(job.id)
        report.errors[job.id] = ended.error
        outcome[job.id] = job.status
        if job.status == "dead":
            report.dead.append(job.id)
        return
    result = value if isinstance(ended, Done) else None
    if not queue.complete(job, result):
        report.lost.append(job.id)
        return
    report.done.append(job.id)
    outcome[job.id] = "done"
    if result is not None:
        report.results[job.id] = result


# -- asserting what was enqueued -----------------------------------------------------------
def assert_enqueued(
    jobs: Queue,
    /,
    *,
    queue: str | None = None,
    payload: Mapping[str, Any] | None = None,
    status: str | Sequence[str] | None = None,
    count: int | None = None,
) -> list[JobState]:
    """Assert that jobs were enqueued in the database of ``jobs`` (a ``Queue``): at least
    one (or exactly ``count``) job of queue ``queue`` (any, if not given) whose payload
    contains ``payload`` (a subset: nested objects are subsets too) and, if given, whose
    ``status`` is one of those; return the matching jobs (``JobState``). The failure says
    what was looked for and lists the jobs that are there."""
    queue_name = queue
    statuses = [status] if isinstance(status, str) else list(status or [])
    there = _jobs(jobs, queue_name)
    matching = [
        job
        for job in there
        if (not statuses or job.status in statuses)
        and (payload is None or _contains(job.payload, payload))
    ]
    if (count is None and matching) or (count is not None and len(matching) == count):
        return matching
    wanted = ["a job" if count is None else f"{count} job(s)"]
    wanted.append(f"on queue {queue_name!r}" if queue_name is not None else "on any queue")
    if payload is not None:
        wanted.append(f"with a payload containing {json.dumps(payload, default=str)}")
    if statuses:
        wanted.append(f"with status {' or '.join(statuses)}")
    found = f"{len(matching)} match" + ("" if len(matching) == 1 else "es")
    shown = "".join(
        f"\n  job {j.id} on {j.queue!r}, {j.status}: {json.dumps(j.payload, default=str)}"
        for j in there[:20]
    )
    more = f"\n  ... and {len(there) - 20} more" if len(there) > 20 else ""
    where = "there" if queue_name is None else f"on {queue_name!r}"
    listing = (
        f"; the {len(there)} job(s) {where}:{shown}{more}" if there else f"; no job is {where}"
    )
    raise AssertionError(f"expected {' '.join(wanted)}: {found}{listing}")


def _jobs(queue: Queue, queue_name: str | None) -> list[JobState]:
    """Every job (of one queue), oldest first, as ``Queue.get`` gives it. The ids come from
    a query of its own (``Queue`` has no statement that lists jobs), on the queue's
    connection, so it sees what a transaction open on it has enqueued."""
    query = "SELECT id FROM jobs WHERE %(queue)s::text IS NULL OR queue = %(queue)s ORDER BY id"
    ids = [row[0] for row in queue.conn.execute(query, {"queue": queue_name}).fetchall()]
    states = [queue.get(i) for i in ids]
    return [s for s in states if s is not None]


def _contains(value: Any, expected: Any) -> bool:
    """Whether ``value`` has everything ``expected`` has (objects: a subset, recursively)."""
    if isinstance(expected, Mapping):
        return isinstance(value, Mapping) and all(
            k in value and _contains(value[k], v) for k, v in expected.items()
        )
    return bool(value == expected)


# -- the pytest plugin ---------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    """Register the fixtures (pytest calls this: the ``pytest11`` entry point names this
    module). The only place pytest is imported."""
    if not config.pluginmanager.has_plugin(_FIXTURES):
        config.pluginmanager.register(_fixtures(), _FIXTURES)


_FIXTURES = "pgqueue.testing.fixtures"


def _fixtures() -> types.ModuleType:
    """The fixtures, in a module of their own made here (pytest reads fixtures from plugin
    modules), so that importing pgqueue.testing imports no pytest."""
    import pytest

    @pytest.fixture(scope="session")
    def pgqueue_databases() -> Iterator[Databases]:
        """The session's throwaway databases (see ``pgqueue.testing.Databases``)."""
        with Databases.from_environment() as databases:
            yield databases

    @pytest.fixture
    def pgqueue_dsn(pgqueue_databases: Databases) -> Iterator[str]:
        """A DSN for a fresh database of this test's own, with the pgqueue table."""
        dsn = pgqueue_databases.create()
        yield dsn
        pgqueue_databases.drop(dsn)

    @pytest.fixture
    def pgqueue_queue(pgqueue_dsn: str) -> Iterator[Queue]:
        """A ``Queue`` on this test's database."""
        with Queue(pgqueue_dsn) as q:
            yield q

    module = types.ModuleType(_FIXTURES, "pgqueue.testing's pytest fixtures")
    for fixture in (pgqueue_databases, pgqueue_dsn, pgqueue_queue):
        setattr(module, fixture.__name__, fixture)
    return module
