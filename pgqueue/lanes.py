"""Plain lanes: the threads that run plain (non-async) handlers for the engine.

A hop from the event loop to a thread and back costs more CPU than the whole of a
hand-written claim loop's cost per job (162 µs against 44 µs in ``data/bench_drivers.csv``).
So the lanes do not wait to be handed each job: each lane thread takes the next claimed job
itself, runs its handler on the lane's own connection, and drops the outcome in a box that
the engine's loop empties in one go (one wake-up for as many outcomes as came in meanwhile).
Every write to the database stays the engine's: a lane only decides whether a job may
start, and runs it.

A lane whose handler hangs past its timeout is retired by the engine: the job is failed
there and then, a new lane takes the retired one's place, and the old thread ends whenever
the handler returns (its outcome is dropped: the job was already failed).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable

import psycopg

from .claims import Claim
from .handlers import LEFT_OPEN, ClientState, Failure, Outcome, failure_of, reset

# Outcomes of a job that was not started: lost before its turn, or the worker is stopping.
SKIPPED = Failure("skipped")
RELEASED = Failure("released")

Run = Callable[[Claim, Callable[[], psycopg.Connection]], Outcome]


class Lane:
    """One lane thread: what it runs now, since when, and whether it was retired."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.current: Claim | None = None
        self.retired = False
        self.thread: threading.Thread | None = None


class PlainLanes:
    """``concurrency`` threads taking plain jobs from ``waiting`` (a deque the engine's
    dispatcher fills): each runs ``start(claim)`` (an outcome instead: do not run it) then
    ``run(claim, connection)`` and leaves ``(claim, outcome)`` in ``done`` (a ``Failure``,
    a ``Done`` carrying the result's JSON, or None); ``wake()`` is
    called on the first outcome after the engine last emptied the box."""

    def __init__(
        self,
        name: str,
        concurrency: int,
        *,
        start: Callable[[Claim], Failure | None],
        run: Run,
        wake: Callable[[], None],
        connect: Callable[[], psycopg.Connection],
        pgbouncer: bool,
        room: Callable[[], bool],
    ) -> None:
        self.name = name
        self.concurrency = concurrency
        self.waiting: deque[Claim] = deque()
        self.done: list[tuple[Claim, Outcome]] = []
        self.busy = 0
        self.open = True  # False: take no more jobs (stopping)
        self._start = start
        self._run = run
        self._wake = wake
        self._connect = connect
        self._pgbouncer = pgbouncer
        self._room = room  # whether the worker has a free slot (a mixed registry shares them)
        self._cond = threading.Condition()
        self.lock = self._cond  # held while a slot is taken (by the engine's async jobs too)
        self._woken = False
        self._lanes: list[Lane] = []
        self._made = 0

    # -- the engine's side ------------------------------------------------------------
    def add(self, claims: list[Claim]) -> None:
        """Hand claimed jobs to the lanes (starting the threads on first use)."""
        with self._cond:
            self.waiting.extend(claims)
            if not self._lanes:
                for _ in range(self.concurrency):
                    self._spawn()
            self._cond.notify(len(claims))

    def take_done(self) -> list[tuple[Claim, Outcome]]:
        """The outcomes that came in since the last call."""
        with self._cond:
            done, self.done = self.done, []
            self._woken = False
        return done

    def running(self) -> list[tuple[Lane, Claim]]:
        with self._cond:
            return [(lane, lane.current) for lane in self._lanes if lane.current is not None]

    def retire(self, lane: Lane, claim: Claim) -> bool:
        """Stop waiting for a lane whose handler of ``claim`` hangs: a new lane takes its
        place. False if that handler has just returned (nothing to retire)."""
        with self._cond:
            if lane.retired or lane.current is not claim:
                return False
            lane.retired = True
            self._lanes.remove(lane)
            self.busy -= 1  # the job's slot is free again: the hung handler keeps none
            if self.open:
                self._spawn()
            self._cond.notify()
            return True

    def drain(self) -> list[Claim]:
        """Take back the jobs no lane has started (stopping: they are given back)."""
        with self._cond:
            left = list(self.waiting)
            self.waiting.clear()
            return left

    def close(self) -> None:
        """Take no more jobs; idle threads end now, busy ones after their job."""
        with self._cond:
            self.open = False
            self._cond.notify_all()

    def ring(self) -> None:
        """Wake idle lanes (a slot may have come free)."""
        with self._cond:
            self._cond.notify_all()

    # -- the lane threads ---------------------------------------------------------------
    def _spawn(self) -> None:
        self._made += 1
        lane = Lane(self.name if self.concurrency == 1 else f"{self.name}.{self._made}")
        lane.thread = threading.Thread(
            target=self._serve, args=(lane,), daemon=True, name=f"pgqueue-{lane.name}"
        )
        self._lanes.append(lane)
        lane.thread.start()

    def _next(self, lane: Lane) -> Claim | None:
        with self._cond:
            while True:
                if not self.open or lane.retired:
                    return None
                if self.waiting and self._room():
                    claim = self.waiting.popleft()
                    self.busy += 1
                    lane.current = claim
                    return claim
                self._cond.wait(0.5)

    def _serve(self, lane: Lane) -> None:
        conn: psycopg.Connection | None = None
        state: ClientState | None = None  # the connection's client state as it was opened
        asked = False  # the handler asked for the connection: reset it after the job

        def connection() -> psycopg.Connection:
            nonlocal conn, asked, state
            if conn is None:
                conn = self._connect()
                state = ClientState.of(conn)
            asked = True
            return conn

        try:
            while (claim := self._next(lane)) is not None:
                outcome: Outcome = self._start(claim)
                if outcome is None:
                    try:
                        outcome = self._run(claim, connection)
                    except BaseException as exc:  # the lane's connection could not be opened
                        outcome = failure_of(exc)
                    if conn is not None and asked:
                        asked = False
                        assert state is not None
                        keep, left_open = reset(conn, self._pgbouncer, state)
                        if not keep:
                            with contextlib.suppress(Exception):
                                conn.close()
                            conn = None
                        if left_open and not isinstance(outcome, Failure):
                            outcome = LEFT_OPEN
                with self._cond:
                    if lane.retired:
                        return  # timed out: the engine failed the job already
                    lane.current = None
                    self.busy -= 1
                    self.done.append((claim, outcome))
                    wake, self._woken = not self._woken, True
                    if self.waiting:
                        self._cond.notify()
                if wake:
                    self._wake()
        except RuntimeError:
            pass  # the engine's loop has closed: nobody waits for this lane any more
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
