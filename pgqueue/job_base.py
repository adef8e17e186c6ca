"""What a claimed job is on either face: what the claim returned, whether this holder has
since lost it, and the checks and answers its writes share. ``Job`` (``job.py``) and
``AsyncJob`` (``async_job.py``) add the writes themselves."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg.pq import TransactionStatus

from .errors import BadInput, LeaseLost, PgQueueError

# Guards the lazy creation of ``Job.lost_event`` against a concurrent ``mark_lost``.
_LOST_LOCK = threading.Lock()


@dataclass
class JobBase:
    """One claim of a job. ``fence`` is this holder's token: every later write carries it."""

    id: int
    queue: str
    payload: dict[str, Any]
    fence: int
    attempts: int
    max_attempts: int
    lease_until: datetime | None
    # Seconds the job had been due (since its run_at: its enqueue, unless delayed or
    # retried) when this claim took it, by the server's clock. A float: the claim's reply
    # parses it for a tenth of what a timestamp costs.
    waited: float | None = field(default=None, repr=False, compare=False)
    # Set by whoever claimed the job: an event recorder (the connection is each face's).
    on_event: Callable[[str, JobBase], None] | None = field(default=None, repr=False, compare=False)
    # This holder's own view of its lease, on its monotonic clock: set from the moment the
    # claim was sent, pushed on by each heartbeat that took effect. Past it the job is lost
    # even if no statement said so (a keeper that cannot reach the server cannot learn it).
    deadline: float = field(default=math.inf, repr=False, compare=False)
    # What the last fenced write of the job itself left: 'done', 'ready' (retry in
    # ``retry_in`` seconds), 'dead'; 'running' while held.
    status: str = field(default="running", compare=False)
    retry_in: float | None = field(default=None, repr=False, compare=False)
    # A plain flag, and a threading.Event made only if someone asks for one: building an
    # Event per claimed job was the largest client cost of a Worker draining small jobs.
    _lost: bool = field(default=False, init=False, repr=False, compare=False)
    _lost_event: threading.Event | None = field(default=None, init=False, repr=False, compare=False)
    # Inside ``job.transaction()``: its commit checks and holds the claim, so a step there
    # takes no lock of its own (one held to COMMIT would starve the job's heartbeats).
    _holding: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def lost(self) -> bool:
        """True once a heartbeat or write found that someone else holds the job now, or
        once the lease ran out on this holder's clock with no heartbeat taking effect."""
        return self._lost or time.monotonic() >= self.deadline

    @property
    def lost_event(self) -> threading.Event:
        """A ``threading.Event`` set when the job is lost, for handlers that wait on it."""
        with _LOST_LOCK:
            if self._lost_event is None:
                self._lost_event = threading.Event()
                if self.lost:
                    self._lost_event.set()
            return self._lost_event

    def mark_lost(self) -> None:
        """Record that this holder's fence is stale (set by the worker, read by handlers)."""
        with _LOST_LOCK:
            self._lost = True
            if self._lost_event is not None:
                self._lost_event.set()

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLost`` if the job was taken over; call it between steps of long work."""
        if self._lost:
            raise LeaseLost(f"job {self.id}: fence {self.fence} is stale; discard this work")
        if self.lost:
            raise LeaseLost(
                f"job {self.id}: the lease ran out here before a heartbeat renewed it "
                "(another worker may hold it now); discard this work"
            )

    def _hold_params(self, lock_timeout: float) -> dict[str, Any]:
        """The parameters of ``transaction()``'s statements; raise if it cannot start."""
        if self._lost:
            raise LeaseLost(f"job {self.id}: fence {self.fence} is stale; no transaction opened")
        if isinstance(lock_timeout, bool) or not (
            isinstance(lock_timeout, int | float) and 0 < lock_timeout <= 86400
        ):
            raise BadInput(
                f"lock_timeout must be more than 0 and at most 86400 seconds, not {lock_timeout!r}"
            )
        # lock_timeout is set in whole milliseconds, as text (set_config takes text).
        return {"job": self.id, "fence": self.fence, "ms": str(max(1, round(lock_timeout * 1000)))}

    def _check_idle(self, status: TransactionStatus) -> None:
        """``transaction()`` commits its own transaction: it cannot be nested in another."""
        if status != TransactionStatus.IDLE:
            raise BadInput(
                f"job {self.id}: job.transaction() needs a connection with no transaction "
                "open (commit or roll back first, or write inside the one block)"
            )

    def _locked(self, lock_timeout: float) -> PgQueueError:
        """What a ``hold_for_commit`` that ran out of ``lock_timeout`` raises."""
        return PgQueueError(
            f"job {self.id}: its row stayed locked by another session for {lock_timeout:g} s, "
            "so the claim could not be checked before commit; the transaction was rolled back"
        )

    def _committed(self, held: bool) -> None:
        """After ``hold_for_commit`` (Job's or AsyncJob's): if the claim is over, mark the
        job lost and raise ``LeaseLost`` (inside the transaction, which rolls back)."""
        self._wrote(held)
        if not held:
            raise LeaseLost(
                f"job {self.id}: the claim with fence {self.fence} was over at commit "
                "(cancelled, failed, reaped or its lease ran out); the transaction was rolled back"
            )

    def _wrote(self, took_effect: bool, *, missing: bool = False) -> bool:
        """After a fenced write (Job's or AsyncJob's): a refusal means this holder's fence
        is stale, so the job is lost, unless the write found no row to update (``missing``),
        which says nothing about the claim; record how it went."""
        if not took_effect and not missing:
            self.mark_lost()
        if self.on_event:
            kind = "fenced-write" if took_effect else "fenced-write-rejected"
            self.on_event("fenced-write-missing" if missing else kind, self)
        return took_effect
