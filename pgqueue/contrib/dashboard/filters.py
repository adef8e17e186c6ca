"""What a request asks for, checked before any statement runs: a job id, a jobs filter, a
page cursor, a bulk action. Pure functions; a bad value is a ``Refused`` (a 4xx status and
one line saying what to do), and nothing is read or written."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...inputs import checked_queue_name

STATUSES = ("ready", "running", "done", "dead", "cancelled")
PAGE = 50  # jobs a page
MAX_PAGE = 500
MAX_TEXT = 200  # characters of a text search
TOP = 2**63 - 1  # the cursor of the first page: every id is below it
# What each action applies to: a bulk action skips every other job that matches the filter.
ACTIONS: dict[str, tuple[str, ...]] = {
    "retry": ("dead",),
    "cancel": ("ready", "running"),
    "delete": ("done", "dead", "cancelled"),
}


class Refused(Exception):
    """A request the dashboard will not serve: ``status`` (400, 401, 403, 404, 409) and one
    line saying what to do. Nothing was changed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Filter:
    """Which jobs a list or a bulk action is about; None: any."""

    queue: str | None = None
    status: str | None = None
    key: str | None = None
    text: str | None = None

    def params(self, hide_payload: bool) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "status": self.status,
            "key": self.key,
            "text": self.text,
            "hide": hide_payload,
        }

    def query(self) -> dict[str, str]:
        """The filter as a page's query string (only what is set; the text is ``q``)."""
        named = {"queue": self.queue, "status": self.status, "key": self.key, "q": self.text}
        return {name: value for name, value in named.items() if value is not None}

    @property
    def empty(self) -> bool:
        return not self.query()


def job_id(raw: str) -> int:
    """A job id from a URL: a whole number from 1 (a 400 otherwise)."""
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) < 2**63:
        raise Refused(400, f"a job id is a whole number from 1, got {raw[:40]!r}")
    return int(text)


def queue_name(raw: str) -> str:
    """A queue's name from a URL (a 400 for one no queue can have)."""
    try:
        return checked_queue_name(raw)
    except ValueError as exc:
        raise Refused(400, str(exc)) from None


def jobs_filter(args: Mapping[str, str]) -> Filter:
    """The filter of a query string: ``queue``, ``status``, ``key`` and ``q`` (text in the
    payload or the error); empty values are no filter, unknown names are refused."""
    unknown = set(args) - {"queue", "status", "key", "q", "before", "limit"}
    if unknown:
        raise Refused(
            400,
            f"unknown filter {sorted(unknown)[0]!r}: filter by queue, status, key or q "
            "(text in the payload or the error)",
        )
    queue = args.get("queue") or None
    if queue is not None:
        try:
            checked_queue_name(queue)
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
    status = args.get("status") or None
    if status is not None and status not in STATUSES:
        raise Refused(400, f"status must be one of {', '.join(STATUSES)}, got {status[:40]!r}")
    key = args.get("key") or None
    if key is not None and (len(key) > 1000 or "\x00" in key):
        raise Refused(400, "key must be a text of at most 1000 characters")
    text = args.get("q") or None
    if text is not None and (len(text) > MAX_TEXT or "\x00" in text):
        raise Refused(400, f"the text searched (q) is at most {MAX_TEXT} characters")
    return Filter(queue, status, key, text)


def page(args: Mapping[str, str]) -> tuple[int, int]:
    """The cursor (``before``: list the jobs with a smaller id) and the page size."""
    before, size = args.get("before") or str(TOP), args.get("limit") or str(PAGE)
    if not before.isdigit() or not 1 <= int(before) <= TOP:
        raise Refused(400, f"before is a job id (the last one of the page before), got {before!r}")
    if not size.isdigit() or not 1 <= int(size) <= MAX_PAGE:
        raise Refused(400, f"limit is a page size from 1 to {MAX_PAGE}, got {size[:20]!r}")
    return int(before), int(size)


def action(name: str) -> tuple[str, ...]:
    """The statuses ``name`` applies to (a 404 for an action that does not exist)."""
    if name not in ACTIONS:
        raise Refused(404, f"no action {name[:40]!r}: use retry, cancel or delete")
    return ACTIONS[name]


def bulk_statuses(name: str, chosen: Filter) -> tuple[str, ...]:
    """What a bulk ``name`` may touch under ``chosen``: a filter on a status it cannot
    apply to is refused rather than doing nothing."""
    statuses = action(name)
    if chosen.status is not None and chosen.status not in statuses:
        raise Refused(
            409,
            f"{name} applies to {' or '.join(statuses)} jobs, and the filter asks for "
            f"{chosen.status} ones: change the status filter",
        )
    return statuses if chosen.status is None else (chosen.status,)
