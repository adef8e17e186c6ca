"""The checks that refuse bad input in one line, before anything is written: queue names,
ids, keys, groups, seconds, leases, payloads and results, each against its limit (every
limit written here once, with its reason)."""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta

from psycopg.types.json import Jsonb

from . import steps
from .errors import (
    MAX_RETRY_DELAY,
    BadInput,
)
from .rules import MAX_CLAIM

MAX_LEASE = 7 * 24 * 3600.0  # seconds; longer leases are a mistake, not a choice


MAX_BACKOFF = MAX_RETRY_DELAY  # seconds; the retry delay stops doubling here (sql/queries.sql)


MAX_ATTEMPTS = 1_000_000  # keeps attempts and max_attempts far inside the int column


MAX_PRIORITY = 1_000_000  # priorities are small whole numbers, from -MAX to +MAX


MAX_PER_GROUP = 1_000_000  # a per-group limit: a whole number of running jobs, 1 to this


MAX_AGE = 100 * 365 * 86400.0  # seconds; prune's older_than beyond this overflows timestamps


# One encoder for every payload: json.dumps with options builds a new one per call.
_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


# A handler's return value is stored with its job up to this many bytes of JSON text
# (UTF-8); above it the job fails and nothing is stored: a bigger result belongs elsewhere
# (a table or object store of yours), with a reference to it returned.
MAX_RESULT_BYTES = 1 << 20


# -- validation: bad input gets a one-line message before anything is written ---------
def queue_names(queue: object) -> list[str]:
    """One queue name, or a non-empty sequence of distinct ones, as a list."""
    if isinstance(queue, str):
        return [checked_queue_name(queue)]
    if not isinstance(queue, list | tuple) or not queue:
        raise BadInput(f"queue must be a name or a non-empty list of names, got {queue!r}")
    names = [checked_queue_name(q) for q in queue]
    if len(set(names)) != len(names):
        raise BadInput(f"queue names must be distinct, got {names!r}")
    return names


def checked_job_id(job_id: object) -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 1 <= job_id < 2**63:
        raise BadInput(f"a job id is a whole number >= 1, got {job_id!r}")
    return job_id


def checked_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > 1000 or "\x00" in key:
        raise BadInput(f"key must be a non-empty text of at most 1000 characters, got {key!r}")
    if not _is_utf8(key):
        raise BadInput(f"key is not valid UTF-8 text (lone surrogates): {key!r}")
    return key


def checked_group(group: object) -> str | None:
    """A job's group (``group_key``), limited together by its queue's per-group limit."""
    if group is None:
        return None
    if not isinstance(group, str) or not group or len(group) > 1000 or "\x00" in group:
        raise BadInput(
            f"group must be a non-empty text of at most 1000 characters (or None), got {group!r}"
        )
    if not _is_utf8(group):
        raise BadInput(f"group is not valid UTF-8 text (lone surrogates): {group!r}")
    return group


def checked_queue_name(queue: object) -> str:
    if not isinstance(queue, str) or not queue.strip() or len(queue) > 200 or "\x00" in queue:
        raise BadInput(f"queue must be a non-empty name of at most 200 characters, got {queue!r}")
    if not _is_utf8(queue):
        raise BadInput(f"queue name is not valid UTF-8 text (lone surrogates): {queue!r}")
    return queue


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """``text`` with NULs and lone surrogates escaped (``\\x00``, ``\\udc80``): what a Postgres
    text column and a UTF-8 log stream both accept."""
    text = text.replace("\x00", "\\x00")
    return text if _is_utf8(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def column_text(value: object, limit: int) -> str:
    """``value`` as text a Postgres text column accepts: no NUL, valid UTF-8, bounded."""
    return printable(str(value)[:limit])


def checked_seconds(what: str, value: object, *, upper: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadInput(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0 or value > upper:
        raise BadInput(
            f"{what} must be a finite number of seconds from 0 to {upper:g}, got {value!r}"
        )
    return float(value)


def checked_lease(lease: object) -> float:
    seconds = checked_seconds("lease", lease, upper=MAX_LEASE)
    if seconds == 0:
        raise BadInput("lease must be more than 0 seconds (try 30)")
    return seconds


def payload_jsonb(payload: object, *, index: int | None = None) -> Jsonb:
    where = "payload" if index is None else f"payload #{index}"
    if not isinstance(payload, dict):
        raise BadInput(f"{where} must be a JSON object (a dict), got {type(payload).__name__}")
    try:
        text = _JSON.encode(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadInput(f"{where} is not JSON-serialisable: {exc}") from None
    if steps.holds_nul(text):
        raise BadInput(f"{where} contains a NUL character (\\u0000), which jsonb cannot store")
    try:
        data = text.encode("utf-8")  # encoded once: the driver sends these bytes as they are
    except UnicodeEncodeError:
        raise BadInput(f"{where} contains text that is not valid UTF-8 (lone surrogates)") from None
    return Jsonb(payload, dumps=lambda _: data)


class JsonText(str):
    """A result already encoded by ``result_text`` (a worker's lane did it): sent as is."""


def result_text(value: object) -> JsonText | None:
    """A return value as the JSON text stored with its job (None: store NULL), or
    ``BadInput`` in one line: not JSON-serialisable, or over ``MAX_RESULT_BYTES``."""
    if value is None or isinstance(value, JsonText):
        return value
    try:
        text = _JSON.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        name = type(value).__name__
        raise BadInput(f"the return value ({name}) is not JSON-serialisable: {exc}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadInput("the return value holds text that is not UTF-8 (lone surrogates)") from None
    if size > MAX_RESULT_BYTES:
        raise BadInput(
            f"the return value is {size:,} bytes of JSON, over the {MAX_RESULT_BYTES:,}-byte cap "
            "(pgqueue.MAX_RESULT_BYTES): store it elsewhere and return a reference"
        )
    if steps.holds_nul(text):
        raise BadInput("the return value contains a NUL character (\\u0000): jsonb cannot hold it")
    return JsonText(text)


def result_args(
    job_id: object, timeout: object, poll_interval: object
) -> tuple[int, float | None, float]:
    """``Queue.result``'s arguments checked: the id, the deadline (monotonic; None: wait
    for ever) and the seconds between reads."""
    deadline = None if timeout is None else time.monotonic() + checked_seconds("timeout", timeout)
    poll = checked_seconds("poll_interval", poll_interval)
    if poll <= 0:
        raise BadInput(f"poll_interval is seconds, > 0, got {poll_interval!r}")
    return checked_job_id(job_id), deadline, poll


def claim_args(queue: object, limit: object, lease: object) -> tuple[list[str], int, float]:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CLAIM:
        raise BadInput(f"limit must be a whole number from 1 to {MAX_CLAIM}, got {limit!r}")
    return queue_names(queue), limit, checked_lease(lease)


def prune_args(older_than: object, batch: object) -> float:
    if isinstance(older_than, timedelta):
        older_than = older_than.total_seconds()
    age = checked_seconds("older_than", older_than, upper=MAX_AGE)
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 10**7:
        raise BadInput(f"batch must be a whole number of jobs from 1 to 10000000, got {batch!r}")
    return age
