"""``AsyncWorker``: run ``await handler(job)`` on the caller's event loop.

A thin face over the engine (``engine.py``), the same program as ``Worker``'s: the same
arguments, counters and guarantees, on the loop that awaits ``start()`` or ``run()``.
Handlers borrow a connection only when they ask (``await job.connection()``,
``job.fenced_write``), from a pool of at most ``connections``, reset when given back.
A handler that blocks the loop (``time.sleep``, long CPU work) freezes the whole worker,
heartbeats included, like a SIGSTOP: its leases run out and the reaper returns its jobs.
Plain tasks of a mixed ``Tasks`` registry run on lane threads, as in ``Worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .async_job import AsyncJob
from .engine import Phase
from .errors import BadInput
from .events import EventLog
from .handlers import is_coroutine_function
from .tasks import Tasks
from .worker import Face, counted, log_signal

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import WorkerKeywords

AsyncHandler = Callable[[AsyncJob], Awaitable[Any]]

__all__ = ["AsyncHandler", "AsyncWorker", "is_async_handler"]


def is_async_handler(handler: object) -> bool:
    """Whether ``handler`` is for the AsyncWorker: a coroutine function (or an object whose
    ``__call__`` is one), or a ``Tasks`` registry whose every task is."""
    if isinstance(handler, Tasks):
        return bool(handler.tasks) and all(
            is_coroutine_function(t.fn) for t in handler.tasks.values()
        )
    return is_coroutine_function(handler)


class AsyncWorker(Face):
    """Run ``await handler(job)`` for jobs of ``queue``, ``concurrency`` at once, on this
    event loop: the threaded ``Worker``'s arguments, counters and guarantees.

    ``await run()`` until SIGINT/SIGTERM (or, with ``burst=True``, until no runnable job is
    left); ``await start()`` and ``await stop()`` for notebooks and applications with a loop
    of their own. Whatever a handler raises (``BaseException`` too) fails its job; with
    ``timeout`` a handler running longer is cancelled and its job failed. Given a
    ``pgqueue.Tasks`` registry, it runs every task's queue with each task's own timeout
    and backoff. ``connections``: at most that many connections lent to handlers at once
    (default ``min(concurrency, 10)``).
    """

    def __init__(
        self,
        handler: AsyncHandler | Tasks,
        *,
        events: EventLog | None = None,
        **options: Unpack[WorkerKeywords],
    ) -> None:
        if not isinstance(handler, Tasks) and not is_coroutine_function(handler):
            raise BadInput(
                f"handler must be an async def function for AsyncWorker, got {handler!r}: "
                "run plain functions with pgqueue.Worker"
            )
        self._make(handler, events, options)

    async def start(self) -> AsyncWorker:
        """Check the database (a bad DSN or a missing table fails here), start the engine
        on the running loop and return."""
        what = counted(self.options.concurrency, "handler") + " at once (asyncio)"
        await self.engine.start(self._banner(what))
        return self

    async def join(self, timeout: float | None = None) -> None:
        """Wait for the dispatcher and its handlers to end (with ``burst=True``: the queue
        ran dry), at most ``timeout`` seconds."""
        await self.engine.join(timeout)

    async def stop(self, grace: float = 10.0) -> None:
        """Stop claiming; give back claimed jobs not yet started; let running handlers
        finish within ``grace`` seconds and complete their jobs. Handlers still running
        after that are cancelled and their jobs left to their leases. A second caller waits
        for the first one's stop."""
        await self.engine.stop(grace)

    async def run(self, grace: float = 10.0) -> None:
        """Work until SIGINT/SIGTERM (or a dry queue with ``burst``), then stop gracefully; a
        second signal stops at once. On the main thread the signals are this worker's for
        the run (``loop.add_signal_handler``); the previous handlers are restored after."""
        loop = asyncio.get_running_loop()
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                before = signal.getsignal(sig)
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(sig, self._on_signal)
                    previous[sig] = before
        try:
            with self._told():
                try:
                    await self.start()
                    await self.engine.serve()
                    await self.stop(grace)
                finally:
                    if self.engine.phase < Phase.CLOSED:  # cancelled: stop now; leases run out
                        self.engine.request_stop(force=True)
                        await asyncio.shield(self.stop(0.0))
        finally:
            for sig, before in previous.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, before if before is not None else signal.SIG_DFL)
        if self.engine.error is not None:
            raise self.engine.error

    def _on_signal(self) -> None:
        again = self.engine.stopping
        log_signal(self.options.name, again)
        self.engine.request_stop(force=again)
