"""pgqueue.contrib.django: the django.tasks backend and manage.py pgqueue_worker, in the small
project of tests/django_project on a real PostgreSQL, with real worker processes.

Needs Django >= 6.0 (Python >= 3.12): `make test-django` makes a venv with it and runs
these; elsewhere they are skipped.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

pytest.importorskip(
    "django",
    minversion="6.0",
    reason="Django >= 6.0 (Python >= 3.12) is not installed here: `make test-django` runs these",
)

from conftest import rows

PROJECT = Path(__file__).parents[1] / "django_project"


# -- the project, set up once: a database of its own, migrated ---------------------------
@pytest.fixture(scope="module")
def project(admin_dsn: str) -> Iterator[str]:
    """The project's database (created empty: ``migrate`` installs pgqueue's tables)."""
    name = f"dj_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin_dsn, dbname=name)
    os.environ["PGQUEUE_DJANGO_DSN"] = dsn
    os.environ["DJANGO_SETTINGS_MODULE"] = "djproject.settings"
    sys.path.insert(0, str(PROJECT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    yield dsn
    from django.db import connections

    connections.close_all()
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def db(project: str) -> str:
    """The project's database, emptied: every test starts with no job, step or mark."""
    with psycopg.connect(project, autocommit=True) as conn:
        conn.execute("TRUNCATE jobs, pgqueue_steps, shop_mark RESTART IDENTITY")
    return project


def manage(
    db: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``manage.py ARGS`` in a process of its own; its output."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env={**os.environ, "PGQUEUE_DJANGO_DSN": db, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def burst(db: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``pgqueue_worker --burst`` in its own process until no task is left; its log."""
    done = manage(db, "pgqueue_worker", "--burst", *args, env=env)
    assert done.returncode == 0, done.stderr
    return done.stderr


def in_process_worker(*args: str) -> None:
    """``pgqueue_worker --burst`` in this process (so this process's receivers hear it)."""
    from django.core.management import call_command

    call_command("pgqueue_worker", "--burst", *args)


def wait_for(what: Callable[[], Any], seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


@pytest.fixture
def heard() -> Iterator[list[tuple[str, str, str]]]:
    """Every task signal this process sends: (signal, task id, status)."""
    from django.tasks.signals import task_enqueued, task_finished, task_started

    got: list[tuple[str, str, str]] = []
    receivers = {}
    for name, signal_ in (
        ("enqueued", task_enqueued),
        ("started", task_started),
        ("finished", task_finished),
    ):

        def receiver(sender: Any, task_result: Any, name: str = name, **kw: Any) -> None:
            got.append((name, task_result.id, str(task_result.status)))

        receivers[name] = receiver
        signal_.connect(receiver)
    yield got
    for name, signal_ in (
        ("enqueued", task_enqueued),
        ("started", task_started),
        ("finished", task_finished),
    ):
        signal_.disconnect(receivers[name])


# -- configuration ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"LEAS": 30}, "'LEAS'"),
        ({"LEASE": 0}, "['LEASE']"),
        ({"LEASE": "30"}, "['LEASE']"),
        ({"MAX_ATTEMPTS": 0}, "['MAX_ATTEMPTS']"),
        ({"BACKOFF": -1}, "['BACKOFF']"),
        ({"TIMEOUT": 0}, "['TIMEOUT']"),
        ({"IMMEDIATE": "yes"}, "['IMMEDIATE']"),
        ({"DSN": 5432}, "['DSN']"),
    ],
)
def test_a_bad_option_is_one_line_naming_its_key(
    project: str, options: dict[str, Any], named: str
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from pgqueue.contrib.django import TaskBackend

    with pytest.raises(ImproperlyConfigured) as raised:
        TaskBackend("jobs", {"OPTIONS": options})
    assert named in str(raised.value) and "TASKS['jobs']" in str(raised.value)
    assert "\n" not in str(raised.value)


# -- pgqueue.W001: a task database outside Django's transactions ---------------------------
OURS = "pgqueue.contrib.django.TaskBackend"

# What `django-admin startproject` writes, plus the backend as docs/django.md sets it up.
STARTPROJECT_SETTINGS = """
from pathlib import Path
BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "not a secret"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "pgqueue.contrib.django"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}}
TASKS = {"default": {"BACKEND": "pgqueue.contrib.django.TaskBackend", "QUEUES": ["default"]}}
USE_TZ = True
"""


def test_startproject_s_sqlite_is_warned_about_by_manage_py_check(tmp_path: Path) -> None:
    (tmp_path / "mysite_settings.py").write_text(STARTPROJECT_SETTINGS)
    env = {k: v for k, v in os.environ.items() if k not in ("PGQUEUE_DSN", "DATABASE_URL")}
    env |= {"PYTHONPATH": str(tmp_path), "DJANGO_SETTINGS_MODULE": "mysite_settings"}
    done = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr  # a warning: the project still runs
    said = done.stdout + done.stderr
    assert "(pgqueue.W001)" in said, said
    assert "is not part of transaction.atomic()" in said and "sqlite" in said
    assert "HINT: Make DATABASES['default'] PostgreSQL with psycopg 3" in said


def test_a_project_on_postgresql_without_a_dsn_is_not_warned(db: str) -> None:
    done = manage(db, "check")
    assert done.returncode == 0, done.stderr
    assert "pgqueue.W001" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "vendor,psycopg3,options,said",
    [
        ("sqlite", False, {}, "Django's default database is sqlite, so the tasks go to "),
        ("postgresql", True, {"DSN": "host=/elsewhere dbname=tasks"}, "OPTIONS['DSN'] names"),
        ("postgresql", False, {}, "through psycopg 2, not psycopg 3"),
    ],
    ids=["sqlite", "a DSN of its own", "psycopg 2"],
)
def test_w001_says_why_enqueue_is_outside_the_transaction(
    project: str, vendor: str, psycopg3: bool, options: dict[str, Any], said: str
) -> None:
    from pgqueue.contrib.django.checks import task_database_warnings

    tasks = {
        "jobs": {"BACKEND": OURS, "OPTIONS": options},
        "other": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
    }
    [warning] = task_database_warnings(tasks, vendor=vendor, psycopg3=psycopg3)
    assert warning.id == "pgqueue.W001" and warning.obj == "TASKS['jobs']"
    assert said in warning.msg and "rolls back still runs" in warning.msg
    assert "SILENCED_SYSTEM_CHECKS" in (warning.hint or "")
    assert "\n" not in warning.msg


def test_w001_is_quiet_where_enqueue_joins_django_s_transaction(project: str) -> None:
    from pgqueue.contrib.django.checks import task_database_warnings

    tasks = {"default": {"BACKEND": OURS, "OPTIONS": {"MAX_ATTEMPTS": 3}}}
    assert task_database_warnings(tasks, vendor="postgresql", psycopg3=True) == []


def test_every_feature_is_supported_and_the_migration_installed_pgqueue(db: str) -> None:
    from django.tasks import default_task_backend

    backend = default_task_backend
    assert backend.supports_defer and backend.supports_async_task
    assert backend.supports_get_result and backend.supports_priority
    assert rows(db, "SELECT to_regclass('jobs') IS NOT NULL, to_regclass('pgqueue_steps')") == [
        (True, "pgqueue_steps")
    ]


def test_a_queue_outside_queues_is_refused_before_anything_is_written(db: str) -> None:
    from django.tasks.exceptions import InvalidTask
    from shop.tasks import add

    with pytest.raises(InvalidTask, match="Queue 'nope' is not valid"):
        add.using(queue_name="nope").enqueue(1, 2)
    with pytest.raises(TypeError, match="Unsupported type"):
        add.enqueue(object(), 2)
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]


# -- enqueue, transactions, results -----------------------------------------------------
def test_enqueue_in_atomic_commits_or_rolls_back_with_the_block(db: str) -> None:
    from django.db import transaction
    from django.tasks.exceptions import TaskResultDoesNotExist
    from shop.models import Mark
    from shop.tasks import add

    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        Mark.objects.create(name="order")
        gone = add.enqueue(1, 2)
        assert add.get_result(gone.id) == gone  # the block sees its own task
        assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]  # nobody else does yet
        raise Abort
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]
    assert Mark.objects.count() == 0
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result(gone.id)

    with transaction.atomic():
        kept = add.enqueue(3, 4)
    assert rows(db, "SELECT id, status, queue FROM jobs") == [(int(kept.id), "ready", "default")]


def test_another_process_reads_the_result_enqueue_returned_then_the_worker_s(db: str) -> None:
    from django.tasks import TaskResultStatus
    from shop.tasks import add

    enqueued = add.using(priority=7).enqueue(2, b=3)
    code = (
        "import base64, pickle, sys, django; django.setup(); "
        "from shop.tasks import add; "
        "sys.stdout.write(base64.b64encode(pickle.dumps(add.get_result(sys.argv[1]))).decode())"
    )
    read = subprocess.run(
        [sys.executable, "-c", code, enqueued.id],
        cwd=PROJECT,
        env={**os.environ, "PGQUEUE_DJANGO_DSN": db},
        capture_output=True,
        text=True,
        check=True,
    )
    elsewhere = pickle.loads(base64.b64decode(read.stdout))
    assert elsewhere == enqueued  # every field, the task (priority 7) included
    assert enqueued.status == TaskResultStatus.READY and enqueued.attempts == 0

    burst(db)
    done = add.get_result(enqueued.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 5
    assert done.attempts == 1 and done.worker_ids[0].startswith("django@")
    assert done.enqueued_at == enqueued.enqueued_at
    assert done.enqueued_at <= done.started_at == done.last_attempted_at <= done.finished_at
    assert done.args == [2] and done.kwargs == {"b": 3} and done.errors == []
    assert asyncio.run(add.aget_result(enqueued.id)) == done
    enqueued.refresh()
    assert enqueued == done


def test_a_missing_id_and_another_task_s_id_are_told_apart(db: str) -> None:
    from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from shop.tasks import add, mark

    from pgqueue import Queue

    marked = mark.enqueue("m")
    for missing in ("999999", "abc", "", "-1", "1" * 30):
        with pytest.raises(TaskResultDoesNotExist):
            add.get_result(missing)
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        add.get_result(marked.id)
    with Queue(db) as q:  # a pgqueue job that is no Django task
        plain = q.enqueue({"to": "a@example.com"})
        cancelled = add.enqueue(1, 2)
        assert q.cancel(int(cancelled.id))
    with pytest.raises(TaskResultDoesNotExist, match="not a Django task"):
        add.get_result(str(plain))
    ended = add.get_result(cancelled.id)
    assert ended.status == "FAILED" and ended.finished_at is not None
    assert [e.exception_class_path for e in ended.errors] == ["pgqueue.errors.JobFailed"]
    assert ended.errors[0].exception_class.__name__ == "JobFailed"


# -- running: IMMEDIATE ----------------------------------------------------------------
def test_immediate_runs_through_claim_and_fenced_completion(db: str, heard: list) -> None:
    from django.tasks import TaskResultStatus, task_backends
    from shop.tasks import add, attempt

    now = add.using(backend="immediate").enqueue(20, 22)
    assert now.status == TaskResultStatus.SUCCESSFUL and now.return_value == 42
    assert now == task_backends["immediate"].get_result(now.id)
    assert now.attempts == 1 and now.worker_ids[0].startswith("immediate@")
    assert rows(db, "SELECT status, fence, attempts, result FROM jobs") == [("done", 1, 1, 42)]
    assert heard == [
        ("enqueued", now.id, "READY"),
        ("started", now.id, "RUNNING"),
        ("finished", now.id, "SUCCESSFUL"),
    ]
    assert attempt.using(backend="immediate").enqueue().return_value == 1

    from django.db import transaction

    with pytest.raises(ZeroDivisionError), transaction.atomic():
        inside = add.using(backend="immediate").enqueue(1, 1)
        assert inside.return_value == 2  # run at once, inside the block
        1 / 0  # noqa: B018
    assert rows(db, "SELECT count(*) FROM jobs WHERE id = %s", [int(inside.id)]) == [(0,)]


def test_immediate_system_exit_fails_and_keyboard_interrupt_propagates(
    db: str, heard: list
) -> None:
    from django.tasks import TaskResultStatus, task_backends
    from shop.tasks import exits, interrupts

    failed = exits.using(backend="immediate").enqueue()
    assert failed.status == TaskResultStatus.FAILED
    assert failed.errors[0].exception_class is SystemExit
    assert failed.errors[0].traceback.endswith("SystemExit: bye\n")
    with pytest.raises(KeyboardInterrupt):
        interrupts.using(backend="immediate").enqueue()
    [(job_id, status)] = rows(db, "SELECT id, status FROM jobs WHERE id > %s", [int(failed.id)])
    assert status == "dead"
    stopped = task_backends["immediate"].get_result(str(job_id))
    assert stopped.status == TaskResultStatus.FAILED
    assert stopped.errors[0].exception_class is KeyboardInterrupt
    assert [s for s, i, _ in heard if i == str(job_id)] == ["enqueued", "started"]


def test_immediate_refuses_run_after_as_djangos_own_immediate_backend_does(db: str) -> None:
    """Before: IMMEDIATE said supports_defer and ran a task deferred by a day at once."""
    from datetime import timedelta

    from django.tasks import task_backends
    from django.tasks.exceptions import InvalidTask
    from django.utils import timezone
    from shop.tasks import add

    assert task_backends["immediate"].supports_defer is False
    assert task_backends["default"].supports_defer is True
    later = timezone.now() + timedelta(days=1)
    with pytest.raises(InvalidTask, match="run_after"):
        add.using(backend="immediate", run_after=later).enqueue(1, 2)
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]
    deferred = add.using(run_after=later).enqueue(1, 2)  # the worker's backend defers
    assert rows(db, "SELECT status FROM jobs WHERE id = %s", [int(deferred.id)]) == [("ready",)]


def test_an_immediate_task_that_outlives_its_lease_ends_failed_never_ready(db: str) -> None:
    """Its one-off queue has no worker: were it reaped to ready there, it would stay READY
    for ever. One attempt, so the reaper sends it dead, and its late completion is refused."""
    from django.tasks import TaskResultStatus
    from shop.tasks import outlives_its_lease

    result = outlives_its_lease.using(backend="immediate").enqueue()
    assert result.status == TaskResultStatus.FAILED
    assert rows(db, "SELECT status, attempts FROM jobs") == [("dead", 1)]


# -- running: the worker ----------------------------------------------------------------
def test_worker_signals_each_once_and_context_attempt_counts_claims(db: str, heard: list) -> None:
    from django.tasks import TaskResultStatus
    from shop.tasks import add, always_fails, flaky

    ok, retried, failing = add.enqueue(1, 1), flaky.enqueue(), always_fails.enqueue()
    in_process_worker()
    assert [s for s, i, _ in heard if i == ok.id] == ["enqueued", "started", "finished"]
    # a retried attempt is started again; finished is sent once, when it has ended for good
    assert [s for s, i, _ in heard if i == retried.id] == [
        "enqueued",
        "started",
        "started",
        "finished",
    ]
    assert [(s, st) for s, i, st in heard if i == failing.id][-1] == ("finished", "FAILED")
    assert [s for s, i, _ in heard if i == failing.id].count("started") == 3  # MAX_ATTEMPTS

    again = flaky.get_result(retried.id)
    assert again.status == TaskResultStatus.SUCCESSFUL and again.return_value == 2
    assert again.attempts == 2 and len(again.errors) == 1
    assert again.errors[0].exception_class is ValueError
    assert again.errors[0].traceback.endswith("ValueError: first attempt fails\n")
    dead = always_fails.get_result(failing.id)
    assert dead.status == TaskResultStatus.FAILED and dead.attempts == 3
    assert [e.exception_class for e in dead.errors] == [ValueError] * 3


def test_a_task_past_its_timeout_fails_and_its_late_end_changes_nothing(
    db: str, heard: list
) -> None:
    from django.tasks import TaskResultStatus
    from shop.tasks import sleepy

    late = sleepy.enqueue(2)  # backend "short": TIMEOUT 0.5 s, MAX_ATTEMPTS 1
    in_process_worker("--backend", "short")
    failed = sleepy.get_result(late.id)
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 1
    [error] = failed.errors
    assert error.exception_class_path == "pgqueue.errors.JobFailed"
    assert "ran past the 0.5 s timeout" in error.traceback
    time.sleep(2)  # the handler returns meanwhile, on its retired lane: nothing changes
    assert sleepy.get_result(late.id) == failed
    assert [s for s, i, _ in heard if i == late.id] == ["enqueued", "started"]


def test_a_return_value_that_cannot_be_stored_fails_the_task_at_once(db: str) -> None:
    from django.tasks import TaskResultStatus
    from shop.tasks import returns_set, too_big

    unjson, big = returns_set.enqueue(), too_big.enqueue()
    in_process_worker()
    first = returns_set.get_result(unjson.id)
    assert first.status == TaskResultStatus.FAILED and first.attempts == 1  # not retried
    assert first.errors[0].exception_class is TypeError
    assert "Unsupported type" in first.errors[0].traceback
    second = too_big.get_result(big.id)
    assert second.status == TaskResultStatus.FAILED and second.attempts == 1
    assert second.errors[0].exception_class_path == "pgqueue.errors.BadInput"
    assert "MAX_RESULT_BYTES" in second.errors[0].traceback or "1048576" in (
        second.errors[0].traceback
    )
    assert rows(db, "SELECT count(*) FROM jobs WHERE result IS NOT NULL") == [(0,)]


def test_in_a_worker_system_exit_and_keyboard_interrupt_fail_attempts_and_it_goes_on(
    db: str,
) -> None:
    from django.tasks import TaskResultStatus
    from shop.tasks import add, exits, interrupts

    a, b, c = exits.enqueue(), interrupts.enqueue(), add.enqueue(2, 2)
    in_process_worker()
    for task, result, kind in ((exits, a, SystemExit), (interrupts, b, KeyboardInterrupt)):
        found = task.get_result(result.id)
        assert found.status == TaskResultStatus.FAILED and found.attempts == 3
        assert {e.exception_class for e in found.errors} == {kind}
    assert add.get_result(c.id).return_value == 4


def _row(db: str, path: str) -> int:
    """A job row naming ``path`` as its Django task, written straight into the table."""
    from pgqueue import Queue

    data = {"task": path, "backend": "default", "queue": "default", "priority": 0}
    data |= {"run_after": None, "args": ["touch pwned"], "kwargs": {}, "enqueued_at": None}
    with Queue(db) as q:
        return q.enqueue({"django": data}, max_attempts=3)


def test_a_row_naming_anything_but_a_task_fails_and_runs_nothing(db: str, tmp_path: Path) -> None:
    from django.tasks.exceptions import TaskResultMismatch
    from shop.tasks import add

    from pgqueue.contrib.django.backend import TaskBackend

    pwned = tmp_path / "pwned"
    system, plain = _row(db, "os.system"), _row(db, "shop.tasks.plain")
    after = add.enqueue(5, 5)
    log = burst(db, env={"PGQUEUE_DJANGO_PWNED": str(pwned)})
    assert not pwned.exists() and not (PROJECT / "pwned").exists()
    found = rows(db, "SELECT id, status, attempts, last_error FROM jobs ORDER BY id")
    for job_id, status, attempts, error in found[:2]:
        assert (job_id, status, attempts) in ((system, "dead", 1), (plain, "dead", 1))
        assert "not a django.tasks Task: refused" in error
    assert found[2][1] == "done" and add.get_result(after.id).return_value == 10
    assert "not a django.tasks Task" in log
    with pytest.raises(TaskResultMismatch, match=r"not a django\.tasks Task"):
        TaskBackend("default", {}).get_result(str(system))


def test_a_task_the_worker_cannot_import_fails_with_the_import_error(db: str) -> None:
    from django.tasks import TaskResultStatus
    from shop.late import newer
    from shop.tasks import add

    late, after = newer.enqueue(), add.enqueue(1, 2)
    burst(db, env={"PGQUEUE_DJANGO_OLD": "1"})  # a worker of an older deploy
    failed = newer.get_result(late.id)  # read by a process that has the module
    assert failed.status == TaskResultStatus.FAILED and failed.attempts == 1
    [error] = failed.errors
    assert error.exception_class is ImportError
    assert "shop.late is not in this deploy" in error.traceback
    assert add.get_result(after.id).return_value == 3  # the worker went on


def test_priority_run_after_async_tasks_and_queues(db: str) -> None:
    from datetime import timedelta

    from django.tasks import TaskResultStatus
    from django.utils import timezone
    from shop.models import Mark
    from shop.tasks import add_async, mark

    for name, priority in (("low", -5), ("mid", 0), ("high", 100)):
        mark.using(priority=priority).enqueue(name)
    later = mark.using(run_after=timezone.now() + timedelta(hours=1)).enqueue("later")
    coroutine = add_async.enqueue(40, 2)
    in_process_worker("--queue", "other")  # only that queue
    assert list(Mark.objects.order_by("id").values_list("name", flat=True)) == [
        "high",
        "mid",
        "low",
    ]
    waiting = mark.get_result(later.id)
    assert waiting.status == TaskResultStatus.READY and waiting.task.run_after is not None
    assert waiting.task.run_after == later.task.run_after
    assert add_async.get_result(coroutine.id).status == TaskResultStatus.READY
    in_process_worker()
    assert add_async.get_result(coroutine.id).return_value == 42


def test_django_connections_are_closed_between_tasks(db: str) -> None:
    from shop.tasks import backend_pid

    first, second = backend_pid.enqueue(), backend_pid.enqueue()
    burst(db, "--concurrency", "1")
    pids = {backend_pid.get_result(r.id).return_value for r in (first, second)}
    assert len(pids) == 2  # CONN_MAX_AGE = 0: a new Django connection for each task


def test_a_bad_worker_command_line_is_one_line_and_exit_code_2(db: str) -> None:
    done = manage(db, "pgqueue_worker", "--concurrency", "0", "--burst")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("CommandError: concurrency")
    done = manage(db, "pgqueue_worker", "--backend", "nope", "--burst")
    assert done.returncode == 2 and "nope" in done.stderr


@pytest.mark.slow
def test_processes_run_tasks_side_by_side(db: str) -> None:
    from shop.tasks import rendezvous

    pair = [rendezvous.enqueue(2), rendezvous.enqueue(2)]
    burst(db, "--processes", "2")  # each task waits until both run: two processes at once
    results = [rendezvous.get_result(r.id) for r in pair]
    assert all(r.return_value for r in results)
    assert len({r.return_value for r in results}) == 2
    assert sorted(r.worker_ids[0].split("@")[0] for r in results) == ["django.p1", "django.p2"]


@pytest.mark.slow
def test_a_task_whose_worker_is_sigkilled_is_finished_by_the_next_worker(
    db: str, tmp_path: Path
) -> None:
    from django.tasks import TaskResultStatus
    from shop.tasks import hang_first

    marker = tmp_path / "attempt"
    result = hang_first.enqueue(str(marker))
    env = {**os.environ, "PGQUEUE_DJANGO_DSN": db, "PGQUEUE_DJANGO_LEASE": "2"}
    command = [sys.executable, "manage.py", "pgqueue_worker", "--name", "first"]
    first = subprocess.Popen(command, cwd=PROJECT, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: Path(f"{marker}.1").exists())  # attempt 1 runs (and hangs)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    command[-1] = "second"
    second = subprocess.Popen(command, cwd=PROJECT, env=env, stderr=subprocess.DEVNULL)
    try:
        done = wait_for(
            lambda: (r := hang_first.get_result(result.id)).is_finished and r, seconds=60
        )
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 2
    assert done.attempts == 2
    assert [w.split("@")[0] for w in done.worker_ids] == ["first", "second"]
    assert done.errors == []  # the killed attempt raised nothing
    assert rows(db, "SELECT status, attempts FROM jobs") == [("done", 2)]


@pytest.mark.slow
def test_a_burst_worker_after_a_sigkilled_one_reaps_and_finishes_its_task(
    db: str, tmp_path: Path
) -> None:
    """Before: ``pgqueue_worker --burst`` after the killed worker's lease ran out said the
    queue was dry and left the task RUNNING for ever."""
    from django.tasks import TaskResultStatus
    from shop.tasks import hang_first

    marker = tmp_path / "attempt"
    result = hang_first.enqueue(str(marker))
    env = {**os.environ, "PGQUEUE_DJANGO_DSN": db, "PGQUEUE_DJANGO_LEASE": "30"}
    command = [sys.executable, "manage.py", "pgqueue_worker", "--name", "first"]
    first = subprocess.Popen(command, cwd=PROJECT, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: Path(f"{marker}.1").exists())  # attempt 1 runs (and hangs)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    with psycopg.connect(db, autocommit=True) as conn:  # its lease runs out, at once
        conn.execute("UPDATE jobs SET lease_until = now() - interval '1 second'")
    burst(db, "--name", "second")
    done = hang_first.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 2
    assert rows(db, "SELECT status, attempts FROM jobs") == [("done", 2)]


def test_a_plain_worker_on_a_task_queue_fails_the_task_and_never_reports_success(
    db: str,
) -> None:
    """#33 item 6: before, `pgqueue worker module:handler` on a Django task's queue completed
    the task without running it, and get_result said SUCCESSFUL with no attempt that ran."""
    from django.tasks import TaskResultStatus
    from shop.tasks import add

    result = add.enqueue(2, 3)
    root = Path(__file__).resolve().parents[2]
    pgqueue = Path(sys.executable).with_name("pgqueue")
    done = subprocess.run(
        [str(pgqueue), "--dsn", db, "worker", "tests.handlers:noop", "--queue", "default",
         "--burst"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ended = add.get_result(result.id)
    assert ended.status == TaskResultStatus.FAILED
    assert rows(db, "SELECT status FROM jobs WHERE id = %s", [int(result.id)]) == [("dead",)]
    [(error,)] = rows(db, "SELECT last_error FROM jobs WHERE id = %s", [int(result.id)])
    assert "only manage.py pgqueue_worker runs it" in error
