"""A worker's options: one frozen dataclass, checked once, shared by ``Worker``,
``AsyncWorker`` and the engine under both."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypedDict

from . import defaults
from .db import pgbouncer_mode, resolve_dsn
from .errors import BadInput
from .inputs import MAX_BACKOFF, MAX_LEASE, checked_lease, checked_seconds, queue_names
from .tasks import Tasks

if TYPE_CHECKING:
    from typing_extensions import Unpack


class WorkerKeywords(TypedDict, total=False):
    """The keyword arguments of ``Worker`` and ``AsyncWorker`` (see ``WorkerOptions.of``)."""

    queue: str | Sequence[str] | None
    dsn: str | None
    concurrency: int
    batch: int
    lease: float
    poll_interval: float
    listen: bool
    listen_dsn: str | None
    pgbouncer: bool | None
    reap_interval: float
    backoff: float
    timeout: float | None
    complete_in_batches: bool
    flush_after: float
    connections: int | None
    burst: bool
    name: str
    record_events: bool
    metrics_port: int | None
    metrics_addr: str


def whole(what: str, value: object, lower: int, upper: int) -> int:
    """``value`` if it is a whole number from ``lower`` to ``upper``, else a one-line error."""
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise BadInput(f"{what} must be a whole number from {lower} to {upper}, got {value!r}")
    return value


def _interval(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
        raise BadInput(f"{what} must be a positive number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise BadInput(f"{what} must be a finite number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class WorkerOptions:
    """What a worker was asked to do; ``WorkerOptions.of(...)`` checks every value once
    (a one-line ``BadInput`` naming the option) and fills in what follows from the others."""

    queues: tuple[str, ...]
    dsn: str
    concurrency: int = 1
    batch: int = defaults.BATCH
    lease: float = defaults.LEASE
    poll_interval: float = defaults.POLL_INTERVAL
    listen: bool = True
    listen_dsn: str | None = None
    pgbouncer: bool = False
    reap_interval: float = defaults.REAP_INTERVAL
    backoff: float = defaults.BACKOFF
    timeout: float | None = None
    complete_in_batches: bool = True
    flush_after: float = defaults.FLUSH_AFTER
    connections: int = 1  # connections lent to async handlers at once
    burst: bool = False
    name: str = "worker"
    record_events: bool = True
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port)
    # ... on this address only: loopback unless told, so a worker's metrics (queue names,
    # counts) are not served to whoever reaches the host.
    metrics_addr: str = "127.0.0.1"
    tasks: Tasks | None = field(default=None, compare=False)

    @classmethod
    def of(cls, handler: Any, **given: Unpack[WorkerKeywords]) -> WorkerOptions:
        """Check a worker's keyword arguments; what a claim or fail would refuse later is
        refused here. An option not given takes the default of its field above, except
        those whose default is worked out: ``queue`` (the registry's queues, else
        "default"), ``dsn`` (``resolve_dsn``), ``pgbouncer`` (detected) and ``connections``
        (``min(concurrency, 10)``)."""
        unknown = sorted(set(given) - set(WorkerKeywords.__annotations__))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} for a worker")
        kw: dict[str, Any] = {f.name: f.default for f in fields(cls)} | dict(given)
        concurrency, batch, timeout = kw["concurrency"], kw["batch"], kw["timeout"]
        connections, name, metrics_port = given.get("connections"), kw["name"], kw["metrics_port"]
        if not callable(handler):
            raise BadInput(f"handler must be callable, got {handler!r}")
        whole("concurrency", concurrency, 1, 10_000)
        whole("batch", batch, 1, 10_000)
        if connections is not None:
            whole("connections", connections, 1, 10_000)
        if timeout is not None and not checked_seconds("timeout", timeout, upper=MAX_LEASE) > 0:
            raise BadInput("timeout must be more than 0 seconds (or None for no timeout)")
        if not isinstance(name, str) or not name.strip():
            raise BadInput(f"name must be a non-empty string, got {name!r}")
        if metrics_port is not None:
            whole("metrics_port", metrics_port, 0, 65535)
        metrics_addr = kw["metrics_addr"]
        if not isinstance(metrics_addr, str) or not metrics_addr.strip():
            raise BadInput(
                f"metrics_addr must be an address to listen on, such as 127.0.0.1 or 0.0.0.0, "
                f"got {metrics_addr!r}"
            )
        tasks = handler if isinstance(handler, Tasks) else None
        queue = given.get("queue")
        if queue is None:
            queue = (tasks.queues or ["default"]) if tasks else "default"
        return cls(
            queues=tuple(queue_names(queue)),
            dsn=resolve_dsn(given.get("dsn")),
            concurrency=concurrency,
            batch=batch,
            lease=checked_lease(kw["lease"]),
            poll_interval=_interval("poll_interval", kw["poll_interval"]),
            listen=bool(kw["listen"]),
            listen_dsn=kw["listen_dsn"],
            # Behind PgBouncer in transaction mode a LISTEN would be lost with its server
            # connection: listen only on a direct one (listen_dsn), else poll.
            pgbouncer=pgbouncer_mode(given.get("pgbouncer")),
            reap_interval=_interval("reap_interval", kw["reap_interval"]),
            backoff=checked_seconds("backoff", kw["backoff"], upper=MAX_BACKOFF),
            timeout=None if timeout is None else float(timeout),
            complete_in_batches=bool(kw["complete_in_batches"]),
            flush_after=checked_seconds("flush_after", kw["flush_after"], upper=60.0),
            connections=min(concurrency, 10) if connections is None else connections,
            burst=bool(kw["burst"]),
            name=name,
            record_events=bool(kw["record_events"]),
            metrics_port=metrics_port,
            metrics_addr=metrics_addr.strip(),
            tasks=tasks,
        )

    @property
    def queue(self) -> str | list[str]:
        """The queue, or the list of queues in preference order."""
        return self.queues[0] if len(self.queues) == 1 else list(self.queues)

    @property
    def app_name(self) -> str:
        """How the worker's sessions show in ``pg_stat_activity``."""
        return f"pgqueue worker {self.name}"
