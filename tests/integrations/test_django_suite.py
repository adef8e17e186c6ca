"""Django's own ``tests/tasks`` suite against pgqueue.contrib.django.TaskBackend
(tests/django_suite/run.py): every test passes but the ones listed here, each of which
asserts a built-in backend's identity, its API, or a feature it lacks.

Needs Django >= 6.0 (Python >= 3.12) and its sdist (downloaded once, with pip, into
.venv-django/sdist): `make test-django` runs it; elsewhere it is skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip(
    "django",
    minversion="6.0",
    reason="Django >= 6.0 (Python >= 3.12) is not installed here: `make test-django` runs it",
)

_spec = importlib.util.spec_from_file_location(
    "pgqueue_django_suite", Path(__file__).parents[1] / "django_suite" / "run.py"
)
assert _spec is not None and _spec.loader is not None
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)

IDENTITY = "asserts isinstance of Django's {} (and its options == {{}}): a built-in's identity"
DUMMY_API = (
    "reads or clears DummyBackend.results, the dummy backend's in-memory list of what was "
    "enqueued (its own API, not django.tasks'); the assertions before it pass"
)
NO_GET_RESULT = (
    "expects NotImplementedError: ImmediateBackend cannot read results back "
    "(supports_get_result False); this backend can"
)

# Django's test -> why it does not pass against this backend.
EXPECTED = {
    "PgQueueImmediateBackendTestCase.test_using_correct_backend": IDENTITY.format(
        "ImmediateBackend"
    ),
    "PgQueueImmediateBackendTestCase.test_cannot_get_result": NO_GET_RESULT,
    "PgQueueImmediateBackendTestCase.test_cannot_refresh_result": NO_GET_RESULT,
    "PgQueueTaskTestCase.test_using_correct_backend": IDENTITY.format("DummyBackend"),
    "PgQueueTaskTestCase.test_get_backend": IDENTITY.format("DummyBackend / ImmediateBackend"),
    "PgQueueTaskTestCase.test_enqueue_task": DUMMY_API,
    "PgQueueTaskTestCase.test_enqueue_task_async": DUMMY_API,
    "PgQueueDummyBackendTestCase.test_using_correct_backend": IDENTITY.format("DummyBackend"),
    "PgQueueDummyBackendTestCase.test_enqueue_task": DUMMY_API,
    "PgQueueDummyBackendTestCase.test_enqueue_task_async": DUMMY_API,
    "PgQueueDummyBackendTestCase.test_refresh_result": (
        "changes the stored result through DummyBackend.results[0] before refresh(); "
        "tests/integrations/test_django.py refreshes a result a worker changed instead"
    ),
    "PgQueueDummyBackendTestCase.test_refresh_result_async": (
        "as test_refresh_result, with arefresh()"
    ),
    "PgQueueDummyBackendTestCase.test_clear": "calls DummyBackend.clear()",
    "PgQueueDummyBackendTransactionTestCase.test_doesnt_wait_until_transaction_commit_by_default": (
        DUMMY_API
    ),
}


@pytest.mark.slow
def test_django_s_own_task_suite_passes_but_the_listed_tests(admin_dsn: str) -> None:
    done = suite.run(admin_dsn)
    verdicts = suite.outcomes(done.stdout)
    assert suite.ran(done.stdout) == len(verdicts) >= 70, done.stdout[-3000:]  # 76 in 6.1
    failing = {name for name, verdict in verdicts.items() if verdict in ("FAIL", "ERROR")}
    assert failing == set(EXPECTED), done.stdout[-6000:]
    passed = [name for name, verdict in verdicts.items() if verdict == "ok"]
    assert len(passed) == len(verdicts) - len(EXPECTED)


def test_a_test_line_glued_after_django_s_migrations_output_still_counts() -> None:
    # As seen in `make test-django`: the buffered stdout ("Applying sites.0002...") landed in
    # front of a test's line on stderr, and the parser counted 75 tests of 76.
    name = "pgqueue_tasks.test_x.PgQueueTaskTestCase.test_enqueue_task"
    output = "\n".join(
        [
            "test_call (pgqueue_tasks.test_x.PgQueueTaskTestCase.test_call) ... ok",
            f"  Applying sites.0002_alter_domain_unique...test_enqueue_task ({name}) ... ok",
            f"  Applying sites.0002_alter_domain_unique... OKtest_enqueue_task ({name}) ... ok",
            "Ran 2 tests in 0.1s",
        ]
    )
    verdicts = suite.outcomes(output)
    assert verdicts == {
        "PgQueueTaskTestCase.test_call": "ok",
        "PgQueueTaskTestCase.test_enqueue_task": "ok",
    }
    assert suite.ran(output) == len(verdicts)


def test_the_suite_runs_with_unbuffered_output() -> None:
    env = suite.suite_env("host=/nowhere")
    assert env["PYTHONUNBUFFERED"] == "1" and env["PGQUEUE_SUITE_DSN"] == "host=/nowhere"
