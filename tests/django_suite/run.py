"""Run Django's own ``tests/tasks`` suite against ``pgqueue.contrib.django.TaskBackend``.

    python tests/django_suite/run.py [--dsn DSN] [--cache DIR]

Downloads the sdist of the installed Django (``pip download --no-deps --no-binary :all:
django==X``, kept in ``--cache``), unpacks it in a temporary directory, adds
``pgqueue_tasks`` (Django's task test cases subclassed to point at this backend) and
``pgqueue_suite_settings`` beside Django's ``tests/tasks``, and runs ``tests/runtests.py
pgqueue_tasks`` on the PostgreSQL server ``--dsn`` names (default: pgqueue's usual order).
Prints Django's output, then one line per test that did not pass; exits with the runner's
code. ``outcomes()`` parses that output (tests/integrations/test_django_suite.py uses it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE.parent.parent / ".venv-django" / "sdist"
# Searched anywhere in a line, not anchored at its start: should a line of the migrations'
# output ("Applying sites.0002... OK") still be glued before a test's line, its test counts.
_NAMED = re.compile(r"(test\w*) \(([\w.]+)\)(?: \[.*\])? \.\.\. ?(.*)$")
_SUMMARY = re.compile(r"^(FAIL|ERROR): (test\w*) \(([\w.]+)\)")


def sdist(cache: Path) -> Path:
    """The sdist of the installed Django, downloaded once into ``cache``."""
    import django

    version = django.__version__
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"django-{version}.tar.gz"))
    if found:
        return found[0]
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    subprocess.run(
        [*pip, "--no-binary", ":all:", f"django=={version}", "--dest", str(cache)], check=True
    )
    [path] = cache.glob(f"django-{version}.tar.gz")
    return path


def unpack(archive: Path, into: Path) -> Path:
    """Django's ``tests/`` from the sdist, with this backend's test package beside ``tasks``."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/tests/" in m.name or m.name.endswith("/tests")]
        tar.extractall(into, members=members, filter="data")
    [tests] = into.glob("*/tests")
    shutil.copytree(HERE / "pgqueue_tasks", tests / "pgqueue_tasks")
    shutil.copy(HERE / "settings.py", tests / "pgqueue_suite_settings.py")
    return tests


def run(dsn: str, cache: Path = DEFAULT_CACHE) -> subprocess.CompletedProcess[str]:
    """Run the suite; its output (stdout and stderr together) is the result's ``stdout``."""
    with tempfile.TemporaryDirectory(prefix="pgqueue-django-suite-") as tmp:
        tests = unpack(sdist(cache), Path(tmp))
        env = suite_env(dsn)
        command = [sys.executable, "runtests.py", "pgqueue_tasks"]
        command += ["--settings=pgqueue_suite_settings", "--parallel=1", "--noinput", "-v", "2"]
        return subprocess.run(
            command,
            cwd=tests,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )


def suite_env(dsn: str) -> dict[str, str]:
    """The suite's environment: ours, its server, and unbuffered output. Django writes the
    migrations on stdout and each test's line on stderr into one pipe; a buffered stdout
    lands in the middle of a test's line, which then went uncounted (75 tests of 76)."""
    return {**os.environ, "PGQUEUE_SUITE_DSN": dsn, "PYTHONUNBUFFERED": "1"}


def outcomes(output: str) -> dict[str, str]:
    """Each test's verdict, ``Class.test_name`` -> ok, FAIL, ERROR or skipped: every test
    the runner names is ok unless its summary lists it as FAIL or ERROR (a test with a
    failing subtest included) or its line says skipped."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        if m := _NAMED.search(line):
            name = f"{m.group(2).rsplit('.', 2)[-2]}.{m.group(1)}"
            skipped = m.group(3).startswith("skipped")
            found.setdefault(name, "skipped" if skipped else "ok")
    for line in output.splitlines():
        if m := _SUMMARY.match(line):
            found[f"{m.group(3).rsplit('.', 2)[-2]}.{m.group(2)}"] = m.group(1)
    return found


def ran(output: str) -> int:
    """How many tests the runner says it ran (``Ran N tests``); 0 if it did not say."""
    found = re.search(r"^Ran (\d+) tests? in ", output, flags=re.MULTILINE)
    return int(found.group(1)) if found else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a PostgreSQL server (default: pgqueue's usual order)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sdist is kept")
    args = parser.parse_args()
    from pgqueue.db import resolve_dsn

    done = run(resolve_dsn(args.dsn), args.cache)
    print(done.stdout)
    for name, verdict in sorted(outcomes(done.stdout).items()):
        if verdict not in ("ok", "skipped"):
            print(f"{verdict}: {name}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
