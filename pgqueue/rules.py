"""What the worker engine decides, with no I/O and no clock of its own.

Rule 1: every decision of the engine that can be stated without a connection or an event
loop lives here: how many jobs to claim and may hold, whether a run is dry, whether a job
may start, what is late, which completions are due, what a row read back after a lost
reply says, which retry delay applies. Rule 2: nothing here imports asyncio, psycopg or
``time``; the time is an argument (seconds on the caller's monotonic clock) and the state
is the counts the engine passes. Rule 3: the engine (``engine.py``) does the I/O and calls
these, so each rule is tested in milliseconds (tests/fast/test_rules.py) and written once.

Theory of operation. A worker holds claims: a claim is *unfinished* while its handler may
still run, and *finishing* once its completion, fail or release is on its way. Plain
handlers hold at most ``batch`` unfinished claims a lane (as if each lane claimed its own
batch); async handlers a batch beside the handlers of all lanes but one. Finishing claims
do not count against that, so the next claim goes out beside a completion rather than after
it, but a worker holds at most twice as many in all, so a kill re-runs at most that many.
Under a backlog (the last claim came back full) a claim asks for all the room there is, in
whole batches for plain handlers, never more than the claim statement's own limit.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

MAX_CLAIM = 10_000  # the most jobs one claim statement takes

Action = Literal["complete", "fail", "release"]
Start = Literal["start", "release", "skip"]


class Phase(enum.IntEnum):
    """Where a worker's engine is; it only moves forward."""

    NEW = 0
    WORKING = 1
    STOPPING = 2  # no new claims; running handlers have the grace to finish
    LEAVING = 3  # grace over: no handler waited for, no heartbeat; last writes, bounded
    CLOSED = 4
    HALTED = 5  # crashed on purpose (the course's faults): nothing more is written


# -- holding and claiming --------------------------------------------------------------
def holds_at_most(batch: int, concurrency: int, *, plain: bool) -> tuple[int, int]:
    """The most jobs a worker holds: of those whose handler has not ended, and in all,
    counting those whose completion is on its way."""
    unfinished = batch * concurrency if plain else concurrency + batch - 1
    return unfinished, 2 * unfinished


def room_to_hold(batch: int, concurrency: int, *, plain: bool, held: int, finishing: int) -> int:
    """How many more jobs a worker holding ``held`` claims (``finishing`` of them on their
    way out) may claim now."""
    unfinished, in_all = holds_at_most(batch, concurrency, plain=plain)
    return min(unfinished - (held - finishing), in_all - held)


def claim_size(room: int, batch: int, *, deep: bool, plain: bool) -> int:
    """How many jobs the next claim asks for: at most ``batch``, or under a backlog
    (``deep``: the last claim came back full) as many as the worker may still hold, so one
    claim (one commit, and its WAL flush) tops up every lane; for plain handlers in whole
    batches, each a lane's; never over ``MAX_CLAIM`` (0: none now)."""
    if not deep:
        return min(room, batch)
    room = min(room, MAX_CLAIM)
    return room - room % batch if plain else room


def wants_jobs(size: int, *, waiting: int, busy: int, lanes: int, deep: bool) -> bool:
    """Whether to claim now: there is room, and a lane is free with no claimed job
    waiting for it, or under a backlog fewer jobs wait than there are lanes (claiming
    ahead, so no lane idles for a claim's round trip)."""
    if size <= 0:
        return False
    return (waiting == 0 and busy < lanes) or (deep and waiting < lanes)


def burst_dry(*, held_while_claiming: bool, reaped_back: int) -> bool:
    """Whether a burst run whose claim came back empty may end: only if the worker held
    nothing while that claim ran (a fail or release committed after the claim's snapshot
    makes its job runnable again) and the reaper, asked then, returned none of its queues'
    jobs (a crashed worker's job whose lease ran out is runnable too)."""
    return not held_while_claiming and reaped_back == 0


# -- one job's turn ----------------------------------------------------------------------
def may_start(*, working: bool, current: bool, lost: bool) -> Start:
    """Whether a claimed job may start now: ``release`` it if the worker is stopping (the
    attempt goes back), ``skip`` it if its claim is no longer this worker's or was lost
    before its turn (running it then could run it twice), else ``start``."""
    if not working:
        return "release"
    if not current or lost:
        return "skip"
    return "start"


def not_ours(payload: object, runs: str | None) -> str | None:
    """Why a claimed job is not this worker's to run (None: it is). A job enqueued through
    the Django backend (``{"django": {"task": ...}}``) is run only by a worker whose handler
    runs Django tasks (``runs == "django"``: ``manage.py pgqueue_worker``); any other
    handler would 'complete' it without running its task. The error text says what to do."""
    django = payload.get("django") if isinstance(payload, dict) else None
    if runs != "django" and isinstance(django, dict) and isinstance(django.get("task"), str):
        return (
            f"PgQueueError: this job is the Django task {django['task']}, enqueued through "
            "pgqueue's django.tasks backend; only manage.py pgqueue_worker runs it, and this "
            "worker's handler is not that: nothing ran. Run pgqueue_worker for this queue, "
            "then retry the job (pgqueue retry-dead --id ID)"
        )
    return None


def late(started: float | None, timeout: float | None, now: float) -> bool:
    """Whether a handler started at ``started`` has run past its ``timeout``."""
    return started is not None and timeout is not None and now - started > timeout


def expired(deadline: float, now: float) -> bool:
    """Whether a claim's lease ran out on this holder's clock (no heartbeat renewed it)."""
    return now >= deadline


def beat_every(lease: float) -> float:
    """Seconds between heartbeats: a third of the lease, so two may be late or lost
    before the lease runs out."""
    return lease / 3


def task_or_worker(task_value: float | None, worker_value: float | None) -> float | None:
    """A per-task rule (timeout, backoff) where the task sets one, else the worker's."""
    return task_value if task_value is not None else worker_value


def flush_due(
    ages: Sequence[float], batches_left: Sequence[int], *, stopping: bool, flush_after: float
) -> list[int]:
    """Which buffered completions go out now (their indexes; ``ages`` in seconds, oldest
    first): all while stopping or once the oldest has waited ``flush_after``, else those
    whose batch is over."""
    if not ages:
        return []
    if stopping or ages[0] >= flush_after:
        return list(range(len(ages)))
    return [i for i, left in enumerate(batches_left) if left == 0]


# -- what a row read back after a lost reply says ----------------------------------------
class Held(NamedTuple):
    """What a holder knew of its claim: the job's fence and attempts when claimed."""

    fence: int
    attempts: int


class Row(NamedTuple):
    """A job's row as read back: status, fence, attempts and last error."""

    status: str
    fence: int
    attempts: int
    last_error: str | None


def took_effect(action: Action, held: Held, row: Row | None, error: str) -> bool | None:
    """After a retry, whether an earlier try committed although its reply was lost: True,
    False, or None where the row has moved on so that it cannot tell (another holder's
    claim or write came since). Only a state no other writer can produce counts as taken:
    a complete leaves ``done`` at this fence; a fail raises the fence by one with attempts
    unchanged (a claim after a reap raises both; another holder's fail, with the same error
    text, comes after such a claim); a release gives the attempt back, fence kept."""
    if row is None:
        return None  # pruned since: a finished job, so perhaps by this write
    if action == "complete":  # nothing changes a done row (but prune): exact either way
        return row.status == "done" and row.fence == held.fence
    if action == "fail":
        if row.fence == held.fence:
            return False  # a fail raises the fence: this one did not commit
        if row.fence == held.fence + 1 and row.attempts == held.attempts:
            return row.status in ("ready", "dead") and row.last_error == error
        return None
    return row.attempts == held.attempts - 1 if row.fence == held.fence else None


def end_kind(action: str, end: str) -> str:
    """The event a finished job records: its action, the action refused, a give-up, or an
    end whose reply was lost and cannot be told."""
    kinds = {"ok": action, "refused": f"{action}-rejected", "gave-up": "gave-up"}
    return kinds.get(end, f"{action}-unknown")


# -- reconnecting ------------------------------------------------------------------------
@dataclass
class Backoff:
    """One reconnect rule for every loop of the engine (psycopg_pool's
    ``AttemptWithBackoff``): each failure doubles the wait, up to ``cap``, with jitter so
    workers cut off together do not come back together; a success starts again."""

    first: float = 0.05
    cap: float = 2.0
    jitter: Callable[[], float] = field(default=random.random, repr=False)
    delay: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay = self.first

    def failed(self) -> float:
        """The seconds to wait before the next try (this one's delay, jittered to 50-150 %)."""
        wait = self.delay * (0.5 + self.jitter())
        self.delay = min(self.delay * 2, self.cap)
        return wait

    def succeeded(self) -> None:
        self.delay = self.first
