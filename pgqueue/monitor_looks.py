"""What one look of ``pgqueue.monitor`` sees (counts by queue, leases, schedules, limits)
and the few words it says of them: shared by the watch (``monitor.py``) and its figure
(``monitor_figure.py``), so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


# -- what a look sees ---------------------------------------------------------------------
@dataclass(frozen=True)
class Lease:
    """A running job as a look saw it."""

    id: int
    queue: str
    fence: int
    attempt: int
    left: float  # seconds of lease left; negative: it ran out, the reaper may take the job
    running_for: float | None  # seconds since this attempt began


@dataclass(frozen=True)
class Counts:
    """One queue at one look. ``finished``: jobs done or cancelled since the previous look
    (0 on the first), derived from the counts and the jobs added meanwhile."""

    ready: int = 0
    running: int = 0
    dead: int = 0
    finished: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.ready + other.ready,
            self.running + other.running,
            self.dead + other.dead,
            self.finished + other.finished,
        )


@dataclass(frozen=True)
class ScheduleLook:
    """A periodic schedule as a look saw it: the last slot handled and the next one."""

    name: str
    queue: str
    last_slot: datetime
    next_slot: datetime | None


@dataclass(frozen=True)
class LimitLook:
    """A limited queue as a look saw it: its limit per group and, busiest first, its groups'
    running jobs that hold a slot (group, jobs)."""

    queue: str
    per_group: int
    running: tuple[tuple[str, int], ...]

    @property
    def full(self) -> list[str]:
        """The groups running their whole limit: their next jobs wait."""
        return [group for group, jobs in self.running if jobs >= self.per_group]


@dataclass(frozen=True)
class Snapshot:
    """One look at the table: ``t`` seconds after the first look (the database's clock),
    the counts by queue, and the running jobs whose leases end first (at most ``bars``)."""

    t: float
    at: datetime  # the database's now()
    seconds: float  # since the previous look (0 on the first)
    queues: dict[str, Counts]
    leases: tuple[Lease, ...]
    schedules: tuple[ScheduleLook, ...] = ()  # the periodic schedules of the queues watched
    limits: tuple[LimitLook, ...] = ()  # the per-group limits of the queues watched

    @property
    def total(self) -> Counts:
        """The counts summed over the queues watched."""
        return sum(self.queues.values(), Counts())

    @property
    def rate(self) -> float | None:
        """Jobs finished per second since the previous look (None on the first look)."""
        return self.total.finished / self.seconds if self.seconds > 0 else None


def kept_jobs(counts: Counts) -> int:
    """The jobs of a queue still in the table's live or dead states."""
    return counts.ready + counts.running + counts.dead


def side_notes(look: Snapshot) -> list[str]:
    """What a look says of schedules and limits, in a few words each."""
    said = [
        f"{s.name} next {s.next_slot:%H:%M:%S}" if s.next_slot else f"{s.name} ends"
        for s in look.schedules
    ]
    for limit in look.limits:
        full = limit.full
        said.append(
            f"{limit.queue} limit {limit.per_group}/group: "
            + (f"{len(full)} group(s) full ({', '.join(full[:3])})" if full else "no group full")
        )
    return said
