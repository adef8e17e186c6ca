"""Settings for Django's own test suite (``tests/runtests.py``) on PostgreSQL: copied into
the unpacked sdist as ``pgqueue_suite_settings``; the server is ``PGQUEUE_SUITE_DSN``."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_server = conninfo_to_dict(os.environ["PGQUEUE_SUITE_DSN"])
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "django_suite",  # the runner creates and drops test_django_suite
        "HOST": str(_server.get("host", "")),
        "PORT": str(_server.get("port", "")),
        "USER": str(_server.get("user", "")),
        "PASSWORD": str(_server.get("password", "")),
    }
}
SECRET_KEY = "django_tests_secret_key"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
USE_TZ = False
