"""A task module that a worker of an older deploy cannot import (PGQUEUE_DJANGO_OLD=1)."""

from __future__ import annotations

import os

from django.tasks import task

if os.environ.get("PGQUEUE_DJANGO_OLD"):
    raise ImportError("shop.late is not in this deploy")


@task()
def newer() -> str:
    return "new"
