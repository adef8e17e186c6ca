"""Django's own task test cases, subclassed under ``override_settings`` so they run against
``pgqueue.contrib.django.TaskBackend``: the immediate-backend cases with ``IMMEDIATE``, the
generic and dummy-backend cases queued (no worker runs: their tasks stay READY).

What the subclasses change, and nothing else: the TASKS setting; ``databases`` (the backend
keeps its tasks in Django's database, which SimpleTestCase otherwise refuses); ``setUp``
empties pgqueue's tables (in place of DummyBackend's ``clear()``, and so a job id such as
"123" that a test expects to be missing is); a test whose own method-level
``override_settings`` names a built-in backend is run with that override pointed at this
backend (the same test body).
"""

from __future__ import annotations

from typing import Any, ClassVar

import psycopg
from django.db import connection
from django.test import override_settings
from tasks import test_dummy_backend as dummy
from tasks import test_immediate_backend as immediate
from tasks import test_tasks as generic

from pgqueue.contrib.django.store import django_dsn
from pgqueue.queue import Queue

BACKEND = "pgqueue.contrib.django.TaskBackend"
IMMEDIATE = {"BACKEND": BACKEND, "QUEUES": [], "OPTIONS": {"IMMEDIATE": True}}
QUEUED = {"BACKEND": BACKEND, "QUEUES": []}


def setUpModule() -> None:
    """pgqueue's tables in the test database (the runner's migrate knows no app of ours)."""
    with Queue(django_dsn(connection)) as queue:
        queue.install()


class Fresh:
    """Each test starts on empty pgqueue tables, ids from 1."""

    databases: ClassVar[set[str]] = {"default"}

    def setUp(self) -> None:
        with psycopg.connect(django_dsn(connection), autocommit=True) as conn:
            conn.execute("TRUNCATE jobs, pgqueue_steps RESTART IDENTITY")


def _pointed(test: Any, tasks: dict[str, Any]) -> Any:
    """A test whose method-level override_settings named a built-in backend, with that
    override pointed at this backend instead (the undecorated body, decorated again)."""
    return override_settings(TASKS=tasks)(test.__wrapped__)


@override_settings(TASKS={"default": IMMEDIATE})
class PgQueueImmediateBackendTestCase(Fresh, immediate.ImmediateBackendTestCase):
    pass


class PgQueueImmediateBackendTransactionTestCase(
    Fresh, immediate.ImmediateBackendTransactionTestCase
):
    test_doesnt_wait_until_transaction_commit_by_default = _pointed(
        immediate.ImmediateBackendTransactionTestCase.test_doesnt_wait_until_transaction_commit_by_default,
        {"default": IMMEDIATE},
    )


@override_settings(
    TASKS={
        "default": {"BACKEND": BACKEND, "QUEUES": ["default", "queue_1"]},
        "immediate": IMMEDIATE,
        "missing": {"BACKEND": "does.not.exist"},
    },
    USE_TZ=True,
)
class PgQueueTaskTestCase(Fresh, generic.TaskTestCase):
    pass


@override_settings(TASKS={"default": QUEUED})
class PgQueueDummyBackendTestCase(Fresh, dummy.DummyBackendTestCase):
    pass


class PgQueueDummyBackendTransactionTestCase(Fresh, dummy.DummyBackendTransactionTestCase):
    test_doesnt_wait_until_transaction_commit_by_default = _pointed(
        dummy.DummyBackendTransactionTestCase.test_doesnt_wait_until_transaction_commit_by_default,
        {"default": QUEUED},
    )
