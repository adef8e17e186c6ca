"""pgqueue: PostgreSQL as a job queue, with leases, heartbeats, a reaper and fencing tokens.

>>> import pgqueue
>>> q = pgqueue.Queue()            # PGQUEUE_DSN, DATABASE_URL, or the embedded server
>>> q.install()
>>> q.enqueue({"to": "a@example.com"}, queue="emails")
"""

from __future__ import annotations

import logging

from .async_job import AsyncJob, async_fenced_write
from .async_queue import AsyncQueue
from .async_worker import AsyncWorker
from .db import async_connect, connect, mask_dsn, resolve_dsn
from .errors import (
    BadInput,
    ConnectError,
    FenceConflict,
    GiveUp,
    InstallBlocked,
    JobFailed,
    KeyRace,
    LeaseLost,
    NotInstalled,
    PgQueueError,
    RetryAfter,
    SlotRace,
)
from .events import Event, EventLog
from .inputs import MAX_RESULT_BYTES
from .job import Job, fenced_write
from .monitor import Monitor, monitor
from .params import LeftDead, Retried
from .queue import JobState, Limit, Queue, Reaped
from .server import EmbeddedServer, default_server
from .steps import StepState
from .tasks import Task, Tasks
from .worker import Worker

__version__ = "0.1.0"

# A library leaves logging to its host: without this, Python's last-resort handler
# prints every worker warning to stderr (into notebook outputs) even when the host
# configured nothing. The CLI configures logging itself.
logging.getLogger("pgqueue").addHandler(logging.NullHandler())

__all__ = [
    "MAX_RESULT_BYTES",
    "AsyncJob",
    "AsyncQueue",
    "AsyncWorker",
    "BadInput",
    "ConnectError",
    "EmbeddedServer",
    "Event",
    "EventLog",
    "FenceConflict",
    "GiveUp",
    "InstallBlocked",
    "Job",
    "JobFailed",
    "JobState",
    "KeyRace",
    "LeaseLost",
    "LeftDead",
    "Limit",
    "Monitor",
    "NotInstalled",
    "PgQueueError",
    "Queue",
    "Reaped",
    "Retried",
    "RetryAfter",
    "SlotRace",
    "StepState",
    "Task",
    "Tasks",
    "Worker",
    "__version__",
    "async_connect",
    "async_fenced_write",
    "connect",
    "default_server",
    "fenced_write",
    "mask_dsn",
    "monitor",
    "resolve_dsn",
]
