"""A ``django.tasks`` backend on pgqueue (Django >= 6.0), and the app that brings its worker.

settings.py::

    INSTALLED_APPS = [..., "pgqueue.contrib.django"]
    TASKS = {"default": {"BACKEND": "pgqueue.contrib.django.TaskBackend", "OPTIONS": {}}}

then ``python manage.py migrate`` (installs pgqueue's tables in Django's database) and
``python manage.py pgqueue_worker``. See docs/django.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TaskBackend"]


def __getattr__(name: str) -> Any:
    # Lazily, so listing the app in INSTALLED_APPS imports nothing of django.tasks early.
    if name == "TaskBackend":
        from .backend import TaskBackend

        return TaskBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
