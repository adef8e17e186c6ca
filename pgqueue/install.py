"""What ``install()`` changes, decided from the catalog alone, for ``Queue`` and
``AsyncQueue`` alike: plain functions from what is there to the statements that add what
is missing (``sql/schema.sql``), and the one-line error for a lock it could not get.

Two kinds of step. Brief ones (create the table, add columns, add the status check
``NOT VALID``, the NOTIFY trigger; the limits, periodic and steps tables, which lock
nothing in use) run together in one transaction under a lock timeout: each of the others
needs a strong lock on ``jobs`` for a moment, and none may queue the fleet behind a long
transaction. Slow ones (validate the check, build an index) run one statement at a time
outside any transaction with locks that let claims and completions go on: an index is built
``CONCURRENTLY``, the check is validated under SHARE UPDATE EXCLUSIVE.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, NamedTuple

from psycopg import sql

from . import statements
from .errors import BadInput, InstallBlocked, PgQueueError

DEFAULT_LOCK_TIMEOUT = 5.0  # seconds a DDL statement of install() may wait for a lock
MAX_LOCK_TIMEOUT = 3600.0
INDEXES = ("jobs_ready_idx", "jobs_lease_idx", "jobs_dead_idx", "jobs_key_idx", "jobs_slot_idx")
ASIDE = "{}_old"  # where an index of an older definition waits while its successor is built


class Index(NamedTuple):
    """An index on ``jobs`` as the catalog shows it."""

    name: str
    valid: bool  # False: left by an interrupted build (or one running now)
    definition: str  # pg_get_indexdef
    building: bool  # a CREATE INDEX is running on it now


@dataclass(frozen=True)
class Catalog:
    """What ``install()`` finds, read from the catalog (no lock on ``jobs``)."""

    jobs: bool
    archive: bool
    jobs_columns: frozenset[str]
    archive_columns: frozenset[str]
    status_check_valid: bool | None  # None: no status check
    limits: bool  # pgqueue_limits exists
    notify_function: bool
    notify_trigger: bool
    schedules: bool  # the periodic tables
    slots: bool
    steps: bool  # the durable steps' tables
    steps_archive: bool
    waiters: bool  # pgqueue_waiters: the jobs a Queue.result waits for
    paused: bool  # pgqueue_paused: the queues no worker claims from
    indexes: dict[str, Index]


class Step(NamedTuple):
    """One statement of ``install()`` and what it does, in words for its caller."""

    what: str
    statement: sql.Composable
    concurrent: bool = False  # must run outside any transaction block


class Installation(NamedTuple):
    """What ``install()`` did (``changed``: nothing on a current table) and whether the
    NOTIFY trigger is installed now."""

    changed: list[str]
    notify: bool


def block(name: str) -> str:
    """One named block of ``sql/schema.sql``."""
    return _blocks()[name]


@cache
def _blocks() -> dict[str, str]:
    return statements.parse(statements.schema())


@cache
def added_columns() -> frozenset[str]:
    """The columns added after the first release (``add_columns``)."""
    return frozenset(re.findall(r"ADD COLUMN IF NOT EXISTS (\w+)", block("add_columns")))


@cache
def _signature(name: str) -> str:
    """What an index's definition must contain to be current: its key columns."""
    found = re.search(r"ON jobs (\(.*?\))\s+WHERE", block(name))
    if found is None:
        raise LookupError(f"schema.sql: {name} has no `ON jobs (...) WHERE`")
    return found.group(1) + " WHERE"


def _current(index: Index) -> bool:
    unique = "CREATE UNIQUE INDEX" in block(index.name)
    return (
        index.valid
        and _signature(index.name) in index.definition
        and index.definition.startswith("CREATE UNIQUE INDEX") == unique
    )


def catalog(found: Sequence[Any], indexes: Iterable[Sequence[Any]]) -> Catalog:
    """The replies of ``installed`` and ``installed_indexes`` as one ``Catalog``."""
    jobs, archive, jobs_columns, archive_columns, check, limits, function, trigger, *rest = found
    schedules, slots, steps, steps_archive, waiters, paused = rest
    return Catalog(
        jobs=jobs,
        archive=archive,
        jobs_columns=frozenset(jobs_columns),
        archive_columns=frozenset(archive_columns),
        status_check_valid=check,
        limits=limits,
        notify_function=function,
        notify_trigger=trigger,
        schedules=schedules,
        slots=slots,
        steps=steps,
        steps_archive=steps_archive,
        waiters=waiters,
        paused=paused,
        indexes={row[0]: Index(*row) for row in indexes},
    )


def _step(what: str, name: str, *, concurrent: bool = False, **names: str) -> Step:
    text = block(name)
    statement = sql.SQL(text).format(**{k: sql.Identifier(v) for k, v in names.items()})
    return Step(what, statement if names else sql.SQL(text), concurrent)


def brief_steps(found: Catalog, notify: bool | None) -> list[Step]:
    """The steps that need a strong lock on ``jobs`` for a moment, for one transaction.
    ``notify``: True adds the trigger, False drops it, None keeps what is installed (a
    new table gets it)."""
    if not found.jobs:
        steps = [_step("created the jobs table", "jobs_table")]
        # A new, empty table: its indexes are built at once, in this transaction.
        steps += [
            Step(f"created {name}", sql.SQL(block(name).replace(" CONCURRENTLY", "")))
            for name in INDEXES
        ]
        steps.append(_step("created jobs_archive", "archive_table"))
        steps.append(_step("created pgqueue_limits", "limits_table"))
        if notify is not False:
            steps.append(_step("created the NOTIFY function", "notify_function"))
            steps.append(_step("created the NOTIFY trigger", "notify_trigger"))
        return steps + _periodic_steps(found) + _side_tables(found)
    steps = []
    if not added_columns() <= found.jobs_columns:
        missing = ", ".join(sorted(added_columns() - found.jobs_columns))
        steps.append(_step(f"added columns to jobs ({missing})", "add_columns"))
    if found.status_check_valid is None:
        steps.append(_step("added the status check (NOT VALID)", "add_status_check"))
    if not found.archive:
        steps.append(_step("created jobs_archive", "archive_table"))
    elif not added_columns() <= found.archive_columns:
        steps.append(_step("added columns to jobs_archive", "archive_columns"))
    if not found.limits:  # a new table, no lock on jobs
        steps.append(_step("created pgqueue_limits", "limits_table"))
    if notify and not found.notify_trigger:
        if not found.notify_function:
            steps.append(_step("created the NOTIFY function", "notify_function"))
        steps.append(_step("created the NOTIFY trigger", "notify_trigger"))
    elif notify is False and found.notify_trigger:
        steps.append(Step("dropped the NOTIFY trigger", sql.SQL(statements.query("notify_off"))))
    return steps + _periodic_steps(found) + _side_tables(found)


def _side_tables(found: Catalog) -> list[Step]:
    """The durable steps' tables, the results' waiters and the paused queues, if missing:
    new tables, so they lock nothing anyone uses."""
    steps = []
    if not found.steps:
        steps.append(_step("created pgqueue_steps (durable steps)", "steps_table"))
    if not found.steps_archive:
        steps.append(_step("created pgqueue_steps_archive (durable steps)", "steps_archive_table"))
    if not found.waiters:
        steps.append(_step("created pgqueue_waiters (results' notifications)", "waiters_table"))
    if not found.paused:
        steps.append(_step("created pgqueue_paused (paused queues)", "paused_table"))
    return steps


def _periodic_steps(found: Catalog) -> list[Step]:
    """The periodic tables, if missing: new tables, so they lock nothing anyone uses."""
    steps = []
    if not found.schedules:
        steps.append(_step("created pgqueue_schedules (periodic jobs)", "schedules_table"))
    if not found.slots:
        steps.append(_step("created pgqueue_slots (periodic jobs)", "slots_table"))
    return steps


def slow_steps(found: Catalog) -> list[Step]:
    """The steps that read the whole table, one statement each, none stopping writes:
    validate the status check, build each missing or outdated index ``CONCURRENTLY``
    (an outdated one keeps serving under another name until its successor is ready; one
    left INVALID by an interrupted build is dropped and built again)."""
    if not found.jobs:
        return []
    steps = []
    if found.status_check_valid is False:
        steps.append(_step("validated the status check", "validate_status_check"))
    for name in INDEXES:
        index, aside = found.indexes.get(name), ASIDE.format(name)
        set_aside = aside in found.indexes
        if index is not None and _current(index):
            if set_aside:
                steps.append(_drop(aside, f"dropped {aside}, which {name} replaced"))
            continue
        if index is not None and index.building:
            raise InstallBlocked(
                f"another session is building {name} now: run install again when it ends"
            )
        if index is not None and not index.valid:
            steps.append(_drop(name, f"dropped {name}, left INVALID by an interrupted build"))
        elif index is not None:
            if set_aside:  # older than what it replaced: the one set aside is not needed
                steps.append(_drop(aside, f"dropped {aside}"))
            steps.append(
                _step(f"set {name} aside as {aside}", "set_index_aside", index=name, aside=aside)
            )
            set_aside = True
        steps.append(_step(f"built {name} concurrently", name, concurrent=True))
        if set_aside:
            steps.append(_drop(aside, f"dropped {aside}, which {name} replaced"))
    return steps


def _drop(name: str, what: str) -> Step:
    return _step(what, "drop_index", concurrent=True, index=name)


def lock_timeout_setting(lock_timeout: object) -> str:
    """``lock_timeout`` (seconds, > 0) as the server setting, in milliseconds."""
    if (
        isinstance(lock_timeout, bool)
        or not isinstance(lock_timeout, numbers.Real)
        or not 0 < lock_timeout <= MAX_LOCK_TIMEOUT
    ):
        raise BadInput(
            f"lock_timeout is seconds, > 0 and at most {MAX_LOCK_TIMEOUT:g}, got {lock_timeout!r}"
        )
    return f"{math.ceil(float(lock_timeout) * 1000)}ms"


def not_outside_a_transaction() -> PgQueueError:
    """The error for an upgrade asked of a connection inside a transaction."""
    return PgQueueError(
        "install must build an index CONCURRENTLY, which cannot run inside a transaction: "
        "call it on an autocommit connection outside any transaction (Queue(dsn) opens one)"
    )


def blocked(step: Step | None, lock_timeout: float, holder: Sequence[Any] | None) -> InstallBlocked:
    """The one-line error for a lock ``install()`` waited ``lock_timeout`` s for, naming
    the oldest open transaction (``lock_holders``), the likely holder."""
    before = f"before it {step.what}" if step else "before it began (another install?)"
    who = "another session holds it"
    if holder is not None:
        pid, state, since, query = holder
        when = f" since {since:%H:%M:%S}" if isinstance(since, datetime) else ""
        who = f"the oldest open transaction is pid {pid} ({state}{when}, last query {query!r})"
    return InstallBlocked(
        f"install waited {lock_timeout:g} s for a lock and gave up {before}: {who}; "
        "run install again when that transaction ends (it carries on from there)"
    )


def bad_statuses() -> PgQueueError:
    """The error for a table whose rows fail the status check being validated."""
    return PgQueueError(
        "jobs holds rows whose status is not ready, running, done, dead or cancelled: "
        "fix them (SELECT id, status FROM jobs WHERE status NOT IN (...)), then install again"
    )
