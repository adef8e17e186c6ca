"""How the engine's tasks reach the server and each other: a ``Link`` is one of the
engine's connections, reopened with ``rules.Backoff`` (never lent to a handler); the
``Bell`` wakes the tasks waiting on it (a lane is free, a stop, a notification)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import psycopg

from . import rules
from .async_queue import AsyncQueue
from .errors import ConnectError
from .options import WorkerOptions
from .rules import Phase

log = logging.getLogger("pgqueue.worker")

# What a lost connection raises: logged as a warning, and the loop carries on.
DISCONNECTS = (psycopg.OperationalError, psycopg.InterfaceError, ConnectError)


class Owner(Protocol):
    """What a link reads of the engine that owns it."""

    options: WorkerOptions
    phase: Phase
    session_dsn: str  # the DSN with the session's limits (dropped if a pooler refuses them)


class Bell:
    """Wakes the tasks waiting on it; the generation number closes the check-then-wait race.
    (A future and a timer a wait, no task: the dispatcher waits often.)"""

    def __init__(self) -> None:
        self.generation = 0
        self._waiters: list[asyncio.Future[None]] = []

    def ring(self) -> None:
        self.generation += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _wake(waiter)

    async def wait(self, seen: int, timeout: float) -> None:
        if self.generation != seen:
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if waiter in self._waiters:  # woken by its timer, or cancelled: not by a ring
                self._waiters.remove(waiter)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Link:
    """One of the engine's connections, reopened with capped exponential backoff."""

    def __init__(self, engine: Owner) -> None:
        self.engine = engine
        self.queue: AsyncQueue | None = None
        self._opening: asyncio.Lock | None = None

    async def get(self) -> AsyncQueue:
        if self.queue is not None:
            return self.queue
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # tasks sharing a link open one connection, not several
            backoff = rules.Backoff()
            while self.queue is None:
                o = self.engine.options
                try:
                    self.queue = await self._open()
                except ConnectError as exc:
                    if self.engine.phase >= Phase.STOPPING:
                        raise
                    wait = backoff.failed()
                    log.warning("%s: %s; retrying in %.1fs", o.name, exc, wait)
                    await asyncio.sleep(wait)
        return self.queue

    async def _open(self) -> AsyncQueue:
        engine, o = self.engine, self.engine.options
        try:
            return await AsyncQueue(
                engine.session_dsn, application_name=o.app_name, pgbouncer=o.pgbouncer
            ).open()
        except ConnectError:
            if engine.session_dsn == o.dsn:
                raise
        # Refused with the session limits: a pooler (PgBouncer refuses startup options)
        # that --pgbouncer does not name. Without them, once, and from then on.
        queue = await AsyncQueue(o.dsn, application_name=o.app_name, pgbouncer=o.pgbouncer).open()
        engine.session_dsn = o.dsn
        log.info("%s: the server refused session limits at connect; going on without", o.name)
        return queue

    async def drop(self) -> None:
        queue, self.queue = self.queue, None
        if queue is not None:
            with contextlib.suppress(Exception):  # already broken; nothing to release
                await queue.close()
