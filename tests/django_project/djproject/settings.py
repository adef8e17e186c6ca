"""Settings of the test project: the database is PGQUEUE_DJANGO_DSN (a libpq string), the
worker's lease PGQUEUE_DJANGO_LEASE seconds (short in the SIGKILL test)."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["PGQUEUE_DJANGO_DSN"])
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": str(_db["dbname"]),
        "HOST": str(_db.get("host", "")),
        "PORT": str(_db.get("port", "")),
        "USER": str(_db.get("user", "")),
        "PASSWORD": str(_db.get("password", "")),
        "CONN_MAX_AGE": 0,  # closed after each task by the worker, as after each request
    }
}
INSTALLED_APPS = ["pgqueue.contrib.django", "shop"]
TASKS = {
    "default": {
        "BACKEND": "pgqueue.contrib.django.TaskBackend",
        "QUEUES": ["default", "other"],
        "OPTIONS": {
            "LEASE": float(os.environ.get("PGQUEUE_DJANGO_LEASE", "30")),
            "MAX_ATTEMPTS": 3,
            "BACKOFF": 0,  # a failed attempt is retried at once
        },
    },
    "short": {
        "BACKEND": "pgqueue.contrib.django.TaskBackend",
        "QUEUES": ["slow"],
        "OPTIONS": {"TIMEOUT": 0.5, "MAX_ATTEMPTS": 1},
    },
    "immediate": {
        "BACKEND": "pgqueue.contrib.django.TaskBackend",
        "QUEUES": [],
        "OPTIONS": {"IMMEDIATE": True},
    },
}
SECRET_KEY = "not a secret: tests only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
