"""A backend's ``OPTIONS``, checked once: an unknown key or a bad value is Django's
``ImproperlyConfigured``, in one line naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from pgqueue import defaults
from pgqueue.errors import BadInput
from pgqueue.inputs import MAX_ATTEMPTS, MAX_BACKOFF, MAX_LEASE, checked_lease, checked_seconds
from pgqueue.options import whole

KEYS = ("DSN", "LEASE", "MAX_ATTEMPTS", "BACKOFF", "TIMEOUT", "IMMEDIATE")


@dataclass(frozen=True)
class BackendOptions:
    """``DSN``: the task database (None: Django's own when it is PostgreSQL, else pgqueue's
    usual order); ``LEASE``, ``BACKOFF``, ``TIMEOUT``: the worker's (seconds);
    ``MAX_ATTEMPTS``: each task's; ``IMMEDIATE``: run each task at enqueue, in the caller."""

    dsn: str | None = None
    lease: float = defaults.LEASE
    max_attempts: int = defaults.MAX_ATTEMPTS
    backoff: float = defaults.BACKOFF
    timeout: float | None = None
    immediate: bool = False

    @classmethod
    def of(cls, alias: str, options: Mapping[str, Any]) -> BackendOptions:
        where = f"TASKS[{alias!r}]['OPTIONS']"
        if not isinstance(options, Mapping):
            raise ImproperlyConfigured(f"{where} must be a dict, got {options!r}")
        for key in options:
            if key not in KEYS:
                raise ImproperlyConfigured(
                    f"{where} has an unknown key {key!r}; the keys are {', '.join(KEYS)}"
                )

        def check(key: str, parse: Any, default: object) -> Any:
            try:
                return parse(options.get(key, default))
            except BadInput as exc:
                raise ImproperlyConfigured(f"{where}[{key!r}]: {exc}") from None

        return cls(
            dsn=check("DSN", _dsn, None),
            lease=check("LEASE", checked_lease, defaults.LEASE),
            max_attempts=check("MAX_ATTEMPTS", _attempts, defaults.MAX_ATTEMPTS),
            backoff=check("BACKOFF", _backoff, defaults.BACKOFF),
            timeout=check("TIMEOUT", _timeout, None),
            immediate=check("IMMEDIATE", _flag, False),
        )


def _attempts(value: object) -> int:
    return whole("MAX_ATTEMPTS", value, 1, MAX_ATTEMPTS)


def _backoff(value: object) -> float:
    return checked_seconds("BACKOFF", value, upper=MAX_BACKOFF)


def _dsn(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise BadInput(f"DSN must be a libpq connection string or URL (or None), got {value!r}")


def _timeout(value: object) -> float | None:
    if value is None:
        return None
    if not checked_seconds("TIMEOUT", value, upper=MAX_LEASE) > 0:
        raise BadInput("TIMEOUT must be more than 0 seconds (or None for no timeout)")
    return float(value)  # type: ignore[arg-type]


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise BadInput(f"IMMEDIATE must be True or False, got {value!r}")
    return value
