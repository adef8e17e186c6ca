#!/usr/bin/env python
"""The test project's manage.py (tests/integrations/test_django.py runs it;
PGQUEUE_DJANGO_DSN names the database)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
