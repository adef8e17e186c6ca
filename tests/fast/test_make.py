"""The Makefile's ``test`` target: both parts run and both are reported, whichever fails.

Run with ``make -o setup`` (the virtual environment taken as made) and stand-in commands for
the two parts, so the target's own logic is what is tested, in milliseconds.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def make_test(pytest_part: str, django_part: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *("make", "--no-print-directory", "-o", "setup", "test"),
            f"PYTEST_ALL={pytest_part}",
            f"DJANGO_SUITE={django_part}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_django_tests_run_when_the_others_failed_and_the_target_fails() -> None:
    done = make_test("false", "echo django-part-ran")
    assert "django-part-ran" in done.stdout, done.stdout + done.stderr
    assert done.returncode != 0
    assert "tests and notebooks FAILED (exit 1); Django tests passed" in done.stdout


def test_a_django_failure_alone_fails_the_target() -> None:
    done = make_test("echo pytest-part-ran", "false")
    assert "pytest-part-ran" in done.stdout and done.returncode != 0
    assert "tests and notebooks passed; Django tests FAILED (exit 1)" in done.stdout


def test_both_passing_pass() -> None:
    done = make_test("true", "true")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tests and notebooks passed; Django tests passed" in done.stdout


def test_django_tests_skipped_for_want_of_a_python_are_said_skipped_not_passed() -> None:
    """Where no Python >= 3.12 is found, .ci/django-suite exits 3: make test says the Django
    tests were skipped (it said 'passed' before) and does not fail for it."""
    done = make_test("true", "sh -c 'exit 3'")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Django tests skipped (no Python >= 3.12 here)" in done.stdout
