"""Live updates: LISTEN as a hint, polling behind it.

One connection per dashboard process listens on ``pgqueue`` (a job was added, sent by the
insert trigger) and ``pgqueue_done`` (a job someone waits for ended), and each open page
gets a server-sent event ``change`` at most every ``SPACING`` seconds after one. The pages
fetch their data every few seconds anyway: an installation without the NOTIFY trigger, a
PgBouncer in between or a lost connection only makes them a little slower to change, never
wrong. A stream ends after ``STREAM_FOR`` seconds (the browser opens the next one), so a
stop of the server never waits long for open pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import psycopg

from .store import Store, sql

log = logging.getLogger("pgqueue.dashboard")

SPACING = 0.5  # seconds: at most two events a second, however many jobs are added
KEEPALIVE = 15.0  # seconds between comments on a quiet stream (proxies drop idle ones)
STREAM_FOR = 60.0  # seconds a stream lasts; the browser's EventSource reconnects
RETRY_MS = 2000  # what the browser waits before it reconnects


class Listener:
    """The one LISTEN connection, started by the first page that asks, and a bell."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.heard = 0  # notifications heard since the start
        self._bell = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._listen())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def wait(self, timeout: float) -> bool:
        """Wait for the next notification, at most ``timeout`` seconds; whether one came."""
        bell = self._bell
        try:
            await asyncio.wait_for(bell.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _ring(self) -> None:
        self.heard += 1
        bell, self._bell = self._bell, asyncio.Event()
        bell.set()

    async def _listen(self) -> None:
        pause = 0.5
        while True:
            try:
                dsn = await self.store.resolved_dsn()
                conn = await psycopg.AsyncConnection.connect(
                    dsn, autocommit=True, application_name="pgqueue dashboard listen"
                )
                async with conn:
                    await conn.execute(sql()["listen_jobs"])
                    await conn.execute(sql()["listen_done"])
                    pause = 0.5
                    async for _ in conn.notifies():
                        self._ring()
            except psycopg.Error as exc:  # the pages poll meanwhile
                log.warning("dashboard: LISTEN lost (%s); again in %.1f s", exc, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 30.0)


async def stream(listener: Listener) -> AsyncIterator[str]:
    """The server-sent events of one page: ``change`` after a notification, comments to
    keep the stream open, for ``STREAM_FOR`` seconds."""
    listener.start()
    loop = asyncio.get_running_loop()
    end = loop.time() + STREAM_FOR
    yield f"retry: {RETRY_MS}\n\n"
    while (left := end - loop.time()) > 0:
        if await listener.wait(min(KEEPALIVE, left)):
            yield f"event: change\ndata: {listener.heard}\n\n"
            await asyncio.sleep(SPACING)
        else:
            yield ": still here\n\n"
