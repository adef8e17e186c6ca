"""``migrate`` installs pgqueue's tables (``Queue.install``) in Django's default database
when a pgqueue backend keeps its tasks there (no ``DSN`` option) and it is PostgreSQL. A
task database elsewhere is installed with ``pgqueue init --dsn ...``. Not atomic: an
upgrade of an older installation builds its indexes CONCURRENTLY, outside a transaction.
Unapplying it leaves the tables (and their jobs) where they are."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, migrations

BACKEND = "pgqueue.contrib.django.TaskBackend"


def install(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.alias != DEFAULT_DB_ALIAS or connection.vendor != "postgresql":
        return
    tasks = getattr(settings, "TASKS", {}) or {}
    if not any(
        params.get("BACKEND") == BACKEND and "DSN" not in (params.get("OPTIONS") or {})
        for params in tasks.values()
    ):
        return
    from pgqueue.queue import Queue

    from ..store import django_dsn

    with Queue(django_dsn(connection), application_name="pgqueue migrate") as queue:
        queue.install()


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(install, migrations.RunPython.noop, elidable=False)
    ]
