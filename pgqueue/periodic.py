"""Periodic jobs: every worker ticks, none leads, and the database keeps one job per slot.

>>> @tasks.periodic(cron="*/5 * * * *")      # five-field cron, in UTC
... def cleanup(job):
...     ...
>>> @tasks.periodic(every=30, catch_up="all")  # seconds, slots aligned to the Unix epoch
... def sample(job):
...     ...

A worker running a periodic task's queue calls ``tick`` about once a second. A tick reads
the server's clock and each schedule's last slot (``schedule_clock``), computes the
candidate slots from the cron expression or the period here, and sends the due ones to
``schedule_tick``, one statement that decides on the database clock: the slots after the
schedule's last slot and not after ``now()``, under the schedule row's lock (SKIP LOCKED:
another worker ticking it now has it, so this one does nothing). Each slot chosen takes its
row in ``pgqueue_slots`` first, whose primary key (schedule, slot) lets exactly one job
exist per slot, and the job is added in the same statement. So any number of workers on
any number of hosts make one job per slot, a paused worker included.

A slot more than ``GRACE`` seconds old when a tick finds it was missed (every worker was
down or stalled): ``catch_up`` says which missed slots still get a job: ``"latest"`` (the
default) the newest one, ``"all"`` each one, the newest ``CATCH_UP_ALL`` at most, ``"none"``
none. A schedule seen for the first time starts at its newest slot: its first job is for
the slot after that.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from .errors import BadInput
from .params import job_params

TICK = 1.0  # seconds between a worker's ticks
GRACE = 2.0  # seconds: a slot found older than this was missed (two ticks of every worker)
MARGIN = 1.0  # seconds of slots past the clock read that a tick sends (the statement comes later)
CATCH_UP_ALL = 100  # catch_up="all": at most this many slots a tick, the newest
KEEP_SLOTS = timedelta(days=1)  # slot rows older than a schedule's last slot by this go
MAX_EVERY = 366 * 86400.0  # seconds
CATCH_UP = ("latest", "all", "none")
MISSED_SENT = {"latest": 1, "all": CATCH_UP_ALL, "none": 0}  # missed slots a tick sends
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Schedule:
    """When a task's jobs are made: a cron expression or a period, and what to do with
    missed slots. Its jobs are ``{"task": task, "kwargs": {}, "schedule": name, "slot": ...}``."""

    name: str
    task: str
    queue: str
    cron: str | None
    every: float | None
    catch_up: str
    max_attempts: int
    priority: int

    @classmethod
    def of(
        cls,
        name: object,
        task: str,
        queue: str,
        *,
        cron: object,
        every: object,
        catch_up: object,
        max_attempts: int,
        priority: int,
    ) -> Schedule:
        """Check a schedule's arguments; a one-line ``BadInput`` for any that is wrong."""
        if (cron is None) == (every is None):
            raise BadInput(
                "a periodic task needs cron= (five fields, e.g. '*/5 * * * *') or every= "
                f"(seconds), one of the two; got cron={cron!r}, every={every!r}"
            )
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise BadInput(f"a schedule's name is a non-empty text of at most 200, got {name!r}")
        if catch_up not in CATCH_UP:
            raise BadInput(f"catch_up must be 'latest', 'all' or 'none', got {catch_up!r}")
        job_params(queue, 0.0, None, max_attempts, priority)  # what an enqueue would refuse
        schedule = cls(
            name, task, queue, _cron(cron), _every(every), catch_up, max_attempts, priority
        )
        schedule.next_after(datetime.now(timezone.utc))  # a cron that never fires says so
        return schedule

    @property
    def spec(self) -> str:
        """The schedule in words: ``cron */5 * * * *`` or ``every 30s``."""
        return f"cron {self.cron}" if self.cron is not None else f"every {self.every:g}s"

    def slots_before(self, t: datetime) -> Iterator[datetime]:
        """This schedule's slots at or before ``t``, newest first."""
        if self.every is not None:
            n = math.floor((t - EPOCH).total_seconds() / self.every)
            while True:
                yield EPOCH + timedelta(seconds=n * self.every)
                n -= 1
        from croniter import croniter

        # Strictly before its start, so start a microsecond after ``t``: ``t`` itself counts.
        it = croniter(self.cron, t.astimezone(timezone.utc) + timedelta(microseconds=1))
        while True:
            yield it.get_prev(datetime)

    def next_after(self, t: datetime) -> datetime:
        """This schedule's first slot after ``t``."""
        if self.every is not None:
            n = math.floor((t - EPOCH).total_seconds() / self.every) + 1
            return EPOCH + timedelta(seconds=n * self.every)
        from croniter import CroniterBadDateError, croniter

        try:
            return croniter(self.cron, t.astimezone(timezone.utc)).get_next(datetime)
        except CroniterBadDateError:
            raise BadInput(f"cron {self.cron!r} never fires (no such date): fix it") from None


def _cron(cron: object) -> str | None:
    if cron is None:
        return None
    from croniter import croniter

    fields = cron.split() if isinstance(cron, str) else []
    if len(fields) != 5 or not croniter.is_valid(" ".join(fields)):
        raise BadInput(
            f"cron {cron!r} does not parse: give five fields, minute hour day month weekday "
            "(e.g. '*/5 * * * *' for every five minutes, in UTC)"
        )
    return " ".join(fields)


def _every(every: object) -> float | None:
    if every is None:
        return None
    if (
        isinstance(every, bool)
        or not isinstance(every, numbers.Real)
        or not math.isfinite(every)
        or not 1 <= every <= MAX_EVERY
    ):
        raise BadInput(f"every is the seconds between runs, from 1 to {MAX_EVERY:g}, got {every!r}")
    return float(every)


def candidates(schedule: Schedule, last: datetime | None, now: datetime) -> list[datetime]:
    """The slots a tick sends for ``schedule``, oldest first, given its ``last`` slot and the
    server's clock ``now`` (None: a schedule seen for the first time). Those after ``last``
    up to ``MARGIN`` past ``now``, of which the missed ones (older than ``GRACE``) only as
    many as ``catch_up`` may make (a new schedule: one, its starting slot), then the first
    slot after them (the next slot, for stats). The statement decides which are due."""
    allowed = 1 if last is None else MISSED_SENT[schedule.catch_up]
    top = now + timedelta(seconds=MARGIN)
    on_time_from = now - timedelta(seconds=GRACE)
    found: list[datetime] = []
    for slot in schedule.slots_before(top):
        if last is not None and slot <= last:
            break
        if slot < on_time_from:
            if allowed == 0:
                break
            allowed -= 1
        found.append(slot)
    found.reverse()
    found.append(schedule.next_after(top))
    return found


def due(slots: Iterable[datetime], last: datetime, now: datetime) -> bool:
    """Whether a tick at ``now`` has anything to send: a slot after ``last``, not after now."""
    return any(last < slot <= now for slot in slots)


def schedules_for(tasks: Any, queues: Sequence[str]) -> list[Schedule]:
    """The schedules a worker of these queues ticks: its ``Tasks`` registry's, on its queues."""
    found = getattr(tasks, "schedules", None) or {}
    return [s for s in found.values() if s.queue in queues]


def tick_params(schedule: Schedule, slots: Sequence[datetime]) -> dict[str, Any]:
    """What ``schedule_tick`` (and ``schedule_add``) is sent for one schedule."""
    return {
        "name": schedule.name,
        "task": schedule.task,
        "queue": schedule.queue,
        "spec": schedule.spec,
        "slots": list(slots),
        "catch_up": schedule.catch_up,
        "grace": GRACE,
        "bound": CATCH_UP_ALL,
        "keep": KEEP_SLOTS,
        "max_attempts": schedule.max_attempts,
        "priority": schedule.priority,
    }


class Ticker(Protocol):
    """What a tick needs of an ``AsyncQueue`` (its three periodic statements)."""

    async def schedule_clock(
        self, names: Sequence[str]
    ) -> tuple[datetime, dict[str, datetime]]: ...

    async def schedule_add(self, schedule: Schedule, slots: Sequence[datetime]) -> bool: ...

    async def schedule_tick(self, schedule: Schedule, slots: Sequence[datetime]) -> int: ...


async def tick(queue: Ticker, schedules: Sequence[Schedule]) -> int:
    """Make the jobs of every due slot of ``schedules`` that no other worker made; return
    how many this tick made. One read of the clock and the last slots, then one statement
    per schedule with a slot due; a new schedule's row is added (no job)."""
    if not schedules:
        return 0
    now, last = await queue.schedule_clock([s.name for s in schedules])
    made = 0
    for schedule in schedules:
        if schedule.name not in last:
            await queue.schedule_add(schedule, candidates(schedule, None, now))
            continue
        slots = candidates(schedule, last[schedule.name], now)
        if due(slots, last[schedule.name], now):
            made += await queue.schedule_tick(schedule, slots)
    return made
