"""The app ``pgqueue.contrib.django``: the ``pgqueue_worker`` command and the migration that
installs pgqueue's tables in Django's own database."""

from __future__ import annotations

from django.apps import AppConfig


class PgQueueConfig(AppConfig):
    name = "pgqueue.contrib.django"
    label = "pgqueue"
    verbose_name = "pgqueue"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers pgqueue.W001: docs/django.md)
