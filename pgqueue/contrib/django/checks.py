"""Django system checks for the pgqueue task backends (``manage.py check``, and every
``runserver`` and ``migrate``): ``pgqueue.W001`` when a backend's tasks are not written
through Django's own connection, so ``enqueue()`` inside ``transaction.atomic()`` is not
part of the transaction (startproject's SQLite: the tasks go to pgqueue's embedded server,
and a rolled-back block's task still runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.module_loading import import_string

from pgqueue.db import describe_dsn

from .options import BackendOptions

W001 = "pgqueue.W001"


@register()
def check_task_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``pgqueue.W001`` for each pgqueue backend of ``TASKS`` whose enqueue is not covered
    by ``atomic()`` on Django's default database."""
    wrapper = connections[DEFAULT_DB_ALIAS]
    return task_database_warnings(
        getattr(settings, "TASKS", {}),
        vendor=wrapper.vendor,
        psycopg3=_is_psycopg3(wrapper.vendor),
    )


def task_database_warnings(
    tasks: Mapping[str, Any], *, vendor: str, psycopg3: bool
) -> list[CheckMessage]:
    """The warnings for the backends of ``tasks`` (Django's ``TASKS`` setting), given the
    default database's ``vendor`` and whether it is reached through psycopg 3. A backend
    writes through Django's connection, inside the caller's transaction, only when it has
    no ``DSN`` and that database is PostgreSQL on psycopg 3 (``TaskBackend.store``)."""
    found: list[CheckMessage] = []
    for alias, config in tasks.items():
        if not _is_ours(config):
            continue
        try:
            options = BackendOptions.of(alias, config.get("OPTIONS", {}))
        except ImproperlyConfigured:
            continue  # said when the backend is made, in one line naming the key
        if options.dsn is None and vendor == "postgresql" and psycopg3:
            continue
        if options.dsn is not None:
            why = f"its OPTIONS['DSN'] names a database of its own ({describe_dsn(options.dsn)})"
        elif vendor != "postgresql":
            why = f"Django's default database is {vendor}, so the tasks go to {describe_dsn(None)}"
        else:
            why = "Django's default database is PostgreSQL through psycopg 2, not psycopg 3"
        found.append(
            Warning(
                f"TASKS[{alias!r}]: enqueue() is not part of transaction.atomic(): {why}; "
                "a task enqueued in a block that rolls back still runs, and one enqueued "
                "before a commit may run before the commit.",
                hint=(
                    "Make DATABASES['default'] PostgreSQL with psycopg 3 "
                    "('ENGINE': 'django.db.backends.postgresql', pip install 'psycopg[binary]') "
                    "and leave OPTIONS['DSN'] unset, so tasks commit and roll back with your "
                    f"data; if the tasks are meant to be apart, add {W001!r} to "
                    "SILENCED_SYSTEM_CHECKS."
                ),
                obj=f"TASKS[{alias!r}]",
                id=W001,
            )
        )
    return found


def _is_ours(config: object) -> bool:
    from .backend import TaskBackend

    if not isinstance(config, Mapping) or not isinstance(config.get("BACKEND"), str):
        return False
    try:
        backend = import_string(config["BACKEND"])
    except ImportError:
        return False  # Django's own check of TASKS says so
    return isinstance(backend, type) and issubclass(backend, TaskBackend)


def _is_psycopg3(vendor: str) -> bool:
    if vendor != "postgresql":
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)
