"""``FaultyWorker``: a Worker that can be frozen or killed on cue, to replay the failure stories.

The production ``Worker`` carries no teaching code: it only calls two no-op seams,
``_gate()`` (every thread passes it between steps) and ``_after_claim(jobs)``. This
subclass fills them in. A pause holds every thread at its next gate, so the worker sends
no heartbeats and makes no progress, then carries on as if no time had passed: a GC
pause or a VM migration. A crash halts it at once: it writes nothing more, like SIGKILL.
"""

from __future__ import annotations

import time
from typing import Any

from ..job import Job
from ..worker import Handler, Worker


class FaultyWorker(Worker):
    """A ``Worker`` with ``pause``, ``pause_on_next_claim``, ``crash`` and
    ``crash_on_next_claim``, for the notebooks and tests."""

    _paused_until = 0.0
    _pause_on_claim: float | None = None
    _pause_in_handler: float | None = None
    _crash_on_claim = False

    def __init__(self, handler: Handler, **options: Any) -> None:
        def frozen_first(job: Job) -> Any:
            # The seed's story: the pause strikes after the job has started, so nothing on
            # the worker's side can notice it; only the fence stops the late writes.
            if self._pause_in_handler is not None:
                seconds, self._pause_in_handler = self._pause_in_handler, None
                self.pause(seconds)
                self._gate()
            return handler(job)

        super().__init__(frozen_first, **options)

    def pause(self, seconds: float) -> None:
        """Freeze now, like a GC pause or VM migration: no heartbeats, no progress, and
        afterwards carry on as if no time had passed."""
        self._paused_until = time.monotonic() + seconds
        self.events.record("pause", self.name, detail=f"{seconds:g}")

    def pause_on_next_claim(self, seconds: float) -> None:
        """Freeze as the next claimed job starts: its handler has begun, then everything
        stops for ``seconds`` (heartbeats too)."""
        self._pause_on_claim = seconds

    def crash(self) -> None:
        """Die now, like SIGKILL: stop heartbeating, write nothing more, drop connections."""
        self._halt()
        self.events.record("crash", self.name)

    def crash_on_next_claim(self) -> None:
        """Die right after the next claim, holding its jobs."""
        self._crash_on_claim = True

    def _gate(self) -> None:
        while (left := self._paused_until - time.monotonic()) > 0:
            time.sleep(min(left, 0.02))

    def _after_claim(self, jobs: list[Job]) -> None:
        if self._crash_on_claim:
            self._crash_on_claim = False
            self.crash()
        elif self._pause_on_claim is not None:
            self._pause_in_handler, self._pause_on_claim = self._pause_on_claim, None
