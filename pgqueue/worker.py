"""``Worker``: run ``handler(job)`` for queued jobs, in ``concurrency`` lanes at once.

A thin face over the engine (``engine.py``), which runs on an event loop of its own in a
background thread, so a notebook or a script keeps its own. Plain handlers run on lane
threads; ``async def`` ones (and the async tasks of a mixed ``Tasks`` registry) on the
engine's loop. ``Face`` is what ``Worker`` and ``AsyncWorker`` share: the options, the
counters and the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from .db import describe_dsn
from .engine import Engine, Phase, log
from .events import EventLog
from .job import Job
from .options import WorkerOptions
from .tasks import Tasks

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import WorkerKeywords

Handler = Callable[[Job], Any]

__all__ = ["Face", "Handler", "Worker", "counted"]

_COUNTERS = frozenset({"done", "failed", "dead", "timed_out", "rejected", "gave_up", "error"})


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 lane``, ``4 lanes``: a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class Face:
    """What both workers show: their options as attributes (``name``, ``queues``,
    ``lease``, ...), the engine's counters (``done``, ``failed``, ``dead``, ``timed_out``,
    ``rejected``, ``gave_up``), ``error``, ``events`` and ``in_flight``."""

    options: WorkerOptions
    engine: Engine
    # Whether run() logs its summary: the CLI prints it on stdout as its result instead
    # (logged too, a terminal showed it twice).
    _logs_summary: bool = True
    # Where the banner says the database came from; None: from the resolved DSN. The CLI
    # says which setting named it (PGQUEUE_DSN, ...), which the resolved DSN no longer tells.
    _where: str | None = None

    def _make(self, handler: Any, events: EventLog | None, options: WorkerKeywords) -> None:
        self.options = WorkerOptions.of(handler, **options)
        self.handler = handler
        self.engine = Engine(handler, self.options, events, self)

    def __getattr__(self, name: str) -> Any:
        if name in _COUNTERS:
            return getattr(self.__dict__["engine"], name)
        if name in WorkerOptions.__dataclass_fields__ or name in ("app_name", "queue"):
            return getattr(self.__dict__["options"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def events(self) -> EventLog:
        return self.engine.events

    @property
    def queues(self) -> list[str]:
        return list(self.options.queues)

    @property
    def tasks(self) -> Tasks | None:
        return self.options.tasks

    @property
    def stopping(self) -> bool:
        return self.engine.stopping

    @property
    def metrics_url(self) -> str | None:
        """Where the worker serves its Prometheus metrics (``metrics_port``), with the port
        it listens on once started (``metrics_port=0``: a free one); None without metrics."""
        metrics = self.engine.metrics
        return None if metrics is None else metrics.url

    @property
    def in_flight(self) -> list[Any]:
        """Jobs claimed and not yet finished by this worker."""
        return [claim.job for claim in list(self.engine.claims.values())]

    @property
    def finished(self) -> bool:
        """Whether the worker has stopped, or a burst run went dry with every job it held
        settled (its last completions are written in batches, after its handlers ended)."""
        engine = self.engine
        if engine.phase >= Phase.CLOSED:
            return True
        return engine.phase > Phase.NEW and not engine.working and not engine.claims

    def _banner(self, what: str) -> str:
        o = self.options
        where = self._where or describe_dsn(o.dsn)
        return (
            f"{o.name}: {where}; queues {', '.join(o.queues)}; {what}, "
            f"batch {o.batch}, lease {o.lease:g}s"
        )

    def _summary(self) -> str:
        """The last line of a run: what it did (the CLI's last line)."""
        return (
            f"{self.options.name}: {self.done} done, {self.failed} failed attempts "
            f"({self.dead} now dead, {self.timed_out} timed out), "
            f"{self.rejected} late writes refused"
        )

    @contextmanager
    def _told(self) -> Iterator[None]:
        """Around ``run()``: log its first line (the banner) and its last (the summary),
        on stderr if the application configured no logging (see ``console_logging``)."""
        with console_logging():
            try:
                yield
            finally:
                if self.engine.phase != Phase.NEW and self._logs_summary:  # say how it went
                    log.info("%s", self._summary())

    # -- seams: no-ops here; the course's FaultyWorker (pgqueue.course.faults) freezes
    # or kills the worker at these points to replay the failure stories ------------------
    def _gate(self) -> None:
        """A point every part of the worker passes between steps (a frozen process)."""

    def _after_claim(self, jobs: list[Any]) -> Any:
        """Called with each claimed batch, before any of it runs."""


class Worker(Face):
    """Run ``handler(job)`` for jobs of ``queue`` in ``concurrency`` lanes.

    ``start()``/``stop()`` for notebooks, ``run()`` to block until SIGINT/SIGTERM
    (or, with ``burst=True``, until no runnable job is left). With ``timeout``, a handler
    running longer is failed (the job retries with backoff, or goes dead) and its lane
    replaced; the stale handler can no longer complete the job or write with its fence.
    ``queue`` may list several queues: a preference order (see ``Queue.claim``). Finished
    jobs are completed in one fenced statement a batch (``complete_in_batches``), or
    sooner once the oldest has waited ``flush_after`` seconds; a crash in that window
    re-runs those jobs (at-least-once). Given a ``pgqueue.Tasks`` registry as handler, the
    worker runs every task's queue (unless ``queue`` says otherwise) with each task's own
    timeout and backoff; its ``async def`` tasks are awaited on the worker's loop.
    Each lane's handler gets a connection of its own as ``job.conn``, reset between jobs.
    """

    def __init__(
        self,
        handler: Handler | Tasks,
        *,
        events: EventLog | None = None,
        **options: Unpack[WorkerKeywords],
    ) -> None:
        self._make(handler, events, options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._signalled = False  # run() had SIGINT/SIGTERM

    def start(self) -> Worker:
        """Check the database (a bad DSN or a missing table fails here, in the caller's
        thread), start the engine on its own thread and return."""
        if self._thread is not None:
            raise RuntimeError(f"worker {self.options.name} was already started")
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve,
            args=(started,),
            daemon=True,
            name=f"pgqueue-{self.options.name}-engine",
        )
        self._thread.start()
        started.result()
        return self

    def _serve(self, started: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        try:
            banner = self._banner(counted(self.options.concurrency, "lane"))
            try:
                loop.run_until_complete(self.engine.start(banner))
            except BaseException as exc:
                started.set_exception(exc)
                return
            self._loop = loop
            started.set_result(None)
            loop.run_forever()  # until stop() has stopped the engine
        finally:
            loop.close()

    def stop(self, grace: float = 10.0) -> None:
        """Stop claiming; give back claimed jobs not yet started; let running handlers
        finish within ``grace`` seconds. A handler still running after that keeps its job
        until the lease runs out (then the reaper hands it to someone else)."""
        loop = self._loop
        if loop is None or self._closed:
            return
        self._closed = True
        done = asyncio.run_coroutine_threadsafe(self.engine.stop(grace), loop)
        while True:  # in slices, so a second signal can get through to the main thread
            try:
                done.result(timeout=0.1)
                break
            except concurrent.futures.TimeoutError:
                continue
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the lanes to end (with ``burst=True``: the queue ran dry)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._working():
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _working(self) -> bool:
        return self._loop is not None and self.engine.working and self.engine.phase < Phase.CLOSED

    def run(self, grace: float = 10.0) -> None:
        """Block until SIGINT/SIGTERM (or a dry queue with ``burst``), then stop gracefully;
        a second signal stops at once. The previous signal handlers are restored after."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            with self._told():
                self.start()
                while not self._signalled and not self.engine.stopping and self._working():
                    time.sleep(0.05)
                self.stop(grace)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.engine.error is not None:
            raise self.engine.error

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Remembered here too: a signal while the engine starts on its own thread could
        # otherwise fall between its two checks of the phase.
        again = self._signalled or self.engine.stopping
        self._signalled = True
        log_signal(self.options.name, again)
        self.engine.call_soon(self.engine.request_stop, again)
        if self._loop is None:  # not started yet: stop as soon as it is
            self.engine.request_stop()

    def _halt(self) -> None:
        """Stop at once and write nothing more: the leases run out, the reaper returns the jobs."""
        self.engine.halt()


@contextmanager
def console_logging() -> Iterator[None]:
    """While a worker runs: if the application configured no logging at all (the root logger
    has no handler, nor has ``pgqueue``'s but its NullHandler), print the package's log on
    stderr as the CLI does: the banner, each failed attempt, the summary. Otherwise change
    nothing: the application's logging decides."""
    package, root = logging.getLogger("pgqueue"), logging.getLogger()
    if root.handlers or any(not isinstance(h, logging.NullHandler) for h in package.handlers):
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    level = package.level
    package.addHandler(handler)
    if level == logging.NOTSET:
        package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(level)


def log_signal(name: str, again: bool) -> None:
    if again:
        log.warning("%s: second signal: stopping now, without waiting for handlers", name)
    else:
        log.warning("%s: stopping after the running handlers (again to force)", name)
