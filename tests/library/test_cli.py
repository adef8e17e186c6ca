"""The ``pgqueue`` command, run as a real subprocess (the installed console script):
exit codes 0 ok / 1 runtime / 2 usage, one-line errors without tracebacks, and the
issue's acceptance sequence with the embedded server and with PGQUEUE_DSN."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from conftest import rows
from pgqueue.cli import PLUGINS, build_parser

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any DSN, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PGQUEUE_DSN", "DATABASE_URL")}
    return env | extra


def pgqueue(
    *args: str, dsn: str | None = None, stdin: bytes | None = None, env: dict | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the console script (with PGQUEUE_DSN=dsn when given) and capture its output."""
    environment = env if env is not None else clean_env(**({"PGQUEUE_DSN": dsn} if dsn else {}))
    result = subprocess.run(
        [PGQUEUE, *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        env=environment,
        cwd=ROOT,
        timeout=120,
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def user_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """Assert a clean failure: the exit code, one line on stderr, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def job_rows(dsn: str) -> list[tuple]:
    """(queue, payload, status) of every job, in id order."""
    return rows(dsn, "SELECT queue, payload, status FROM jobs ORDER BY id")


# -- commands ---------------------------------------------------------------------------
def test_init_creates_the_table_and_is_idempotent(empty_dsn: str) -> None:
    for _ in range(2):
        result = pgqueue("init", dsn=empty_dsn)
        assert result.returncode == 0, result.stderr
        assert "jobs table ready" in result.stdout
    assert rows(empty_dsn, "SELECT count(*) FROM jobs") == [(0,)]


def test_dsn_option_beats_the_environment(dsn: str) -> None:
    env = clean_env(PGQUEUE_DSN="host=127.0.0.1 port=1 dbname=nowhere")
    result = pgqueue("--dsn", dsn, "enqueue", "q", "{}", env=env)
    assert result.returncode == 0, result.stderr
    assert len(job_rows(dsn)) == 1


def test_enqueue_one_json_object(dsn: str) -> None:
    result = pgqueue("enqueue", "emails", '{"to": "a@example.com"}', dsn=dsn)
    assert result.returncode == 0, result.stderr
    [(job_id,)] = rows(dsn, "SELECT id FROM jobs")
    assert f"id {job_id}" in result.stdout
    assert job_rows(dsn) == [("emails", {"to": "a@example.com"}, "ready")]


def test_enqueue_options(dsn: str) -> None:
    result = pgqueue("enqueue", "q", "{}", "--delay", "60", "--max-attempts", "2", dsn=dsn)
    assert result.returncode == 0, result.stderr
    [(wait, attempts)] = rows(
        dsn, "SELECT extract(epoch FROM run_at - now()), max_attempts FROM jobs"
    )
    assert 50 < float(wait) <= 60 and attempts == 2


def test_enqueue_from_stdin_one_job_per_line(dsn: str) -> None:
    lines = b'{"n": 1}\n\n{"n": 2}\n  {"n": "\xc3\xa9"}  \n'
    result = pgqueue("enqueue", "bulk", dsn=dsn, stdin=lines)
    assert result.returncode == 0, result.stderr
    assert "enqueued 3 job(s)" in result.stdout
    assert [p for _, p, _ in job_rows(dsn)] == [{"n": 1}, {"n": 2}, {"n": "é"}]
    # one statement: one notification, one transaction
    assert rows(dsn, "SELECT count(DISTINCT xmin::text) FROM jobs") == [(1,)]


@pytest.mark.parametrize(
    ("stdin", "where"),
    [
        (b'{"n": 1}\n{"n": 2\n{"n": 3}\n', "stdin line 2"),
        (b'{"n": 1}\n[1, 2]\n', "stdin line 2"),
        (b'{"n": 1}\n{"n": NaN}\n', "#1"),
        (b'{"n": 1}\n{"n": "\\u0000"}\n', "NUL"),
        (b'{"n": 1}\n{"n": "\xff"}\n', "stdin line 2"),
    ],
)
def test_a_bad_stdin_line_writes_nothing(dsn: str, stdin: bytes, where: str) -> None:
    result = pgqueue("enqueue", "bulk", dsn=dsn, stdin=stdin)
    assert where in user_error(result, 2)
    assert job_rows(dsn) == []


@pytest.mark.parametrize(
    "args",
    [
        ("enqueue", "q", "not json"),
        ("enqueue", "q", "[1, 2]"),
        ("enqueue", "q", '"text"'),
        ("enqueue", "q", '{"x": NaN}'),
        ("enqueue", "", "{}"),
        ("enqueue", "q", "{}", "--delay", "-1"),
        ("enqueue", "q", "{}", "--max-attempts", "0"),
    ],
)
def test_bad_enqueue_input_exits_2_and_writes_nothing(dsn: str, args: tuple[str, ...]) -> None:
    result = pgqueue(*args, dsn=dsn)
    assert user_error(result, 2).startswith("pgqueue enqueue: ")
    assert job_rows(dsn) == []


def test_stats_json_and_table(dsn: str) -> None:
    [estimate] = json.loads(pgqueue("stats", "--json", dsn=dsn).stdout)
    assert estimate["estimated"] and estimate["status"] == "finished"
    assert "no jobs ready, running or dead" in pgqueue("stats", dsn=dsn).stdout
    pgqueue("enqueue", "a", dsn=dsn, stdin=b"{}\n{}\n")
    pgqueue("enqueue", "b", "{}", "--delay", "3600", dsn=dsn)
    result = pgqueue("stats", "--json", dsn=dsn)
    assert result.returncode == 0, result.stderr
    stats = {(r["queue"], r["status"]): r for r in json.loads(result.stdout) if not r["estimated"]}
    assert {k: r["jobs"] for k, r in stats.items()} == {("a", "ready"): 2, ("b", "ready"): 1}
    assert stats["a", "ready"]["oldest_ready_seconds"] >= 0
    assert stats["b", "ready"]["oldest_ready_seconds"] is None
    table = pgqueue("stats", dsn=dsn).stdout.splitlines()
    assert table[0].split()[:3] == ["queue", "status", "jobs"]
    assert table[1].split()[:3] == ["a", "ready", "2"]


def test_reap_prune_and_retry_dead(dsn: str) -> None:
    pgqueue("enqueue", "q", dsn=dsn, stdin=b'{"n": 1}\n{"n": 2}\n{"n": 3}\n')
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobs SET status = 'running', attempts = 1, fence = 1, max_attempts = 1,"
            " lease_until = now() - interval '1 s' WHERE payload->>'n' = '1'"
        )
        conn.execute(
            "UPDATE jobs SET status = 'running', attempts = 1, fence = 1,"
            " lease_until = now() - interval '1 s' WHERE payload->>'n' = '2'"
        )
        conn.execute("UPDATE jobs SET status = 'done' WHERE payload->>'n' = '3'")
    result = pgqueue("reap", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "reaped 2 job(s): 1 ready again, 1 dead" in result.stdout
    assert "requeued 1 dead job(s)" in pgqueue("retry-dead", "q", "--extra", "2", dsn=dsn).stdout
    assert rows(dsn, "SELECT status, max_attempts FROM jobs WHERE payload->>'n' = '1'") == [
        ("ready", 3)
    ]
    assert "archived 1 finished job(s)" in pgqueue("prune", "--archive", dsn=dsn).stdout
    assert rows(dsn, "SELECT payload->>'n' FROM jobs_archive") == [("3",)]
    assert "deleted 0 finished job(s)" in pgqueue("prune", "--older-than", "60", dsn=dsn).stdout
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(2,)]


def test_worker_burst_drains_and_exits(dsn: str) -> None:
    pgqueue("enqueue", "work", dsn=dsn, stdin=b"{}\n" * 5)
    result = pgqueue(
        "worker", "tests.handlers:noop", "--queue", "work", "--burst", "--batch", "2",
        "--concurrency", "2", "--poll", "30", "--name", "cli-burst", dsn=dsn,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "cli-burst: 5 done, 0 failed attempts" in result.stdout
    assert rows(dsn, "SELECT DISTINCT status FROM jobs") == [("done",)]


def test_worker_handler_failure_is_recorded(dsn: str) -> None:
    pgqueue("enqueue", "work", '{"n": 1}', "--max-attempts", "1", dsn=dsn)
    result = pgqueue("worker", "tests.handlers:fail", "-q", "work", "--burst", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert rows(dsn, "SELECT status, last_error FROM jobs") == [
        ("dead", "RuntimeError: boom on attempt 1")
    ]


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        ("no_colon", "module:function"),
        ("tests.handlers:missing", "no function"),
        ("no_such_module_xyz:run", "cannot import"),
    ],
)
def test_worker_bad_handler_exits_2(dsn: str, handler: str, message: str) -> None:
    result = pgqueue("worker", handler, "--burst", dsn=dsn)
    assert message in user_error(result, 2)


def test_worker_bad_lease_exits_2(dsn: str) -> None:
    result = pgqueue("worker", "tests.handlers:noop", "--lease", "-1", "--burst", dsn=dsn)
    assert "lease" in user_error(result, 2)


# -- errors ---------------------------------------------------------------------------
def test_missing_table_says_run_init(empty_dsn: str) -> None:
    for args in (("stats",), ("enqueue", "q", "{}"), ("reap",)):
        assert "pgqueue init" in user_error(pgqueue(*args, dsn=empty_dsn), 1)


@pytest.mark.parametrize(
    "target",
    [
        "postgresql://alice:s3cret-pw@127.0.0.1:1/nowhere",
        "host=127.0.0.1 port=1 user=alice password=s3cret-pw",
        "host=/nonexistent/dir password=s3cret-pw",
    ],
)
def test_unreachable_dsn_exits_1_with_password_masked(target: str) -> None:
    for args in (("--dsn", target, "stats"), ("stats",)):
        result = pgqueue(*args, env=clean_env(PGQUEUE_DSN=target))
        line = user_error(result, 1)
        assert "cannot connect" in line and "s3cret-pw" not in line


def test_database_url_is_used_when_pgqueue_dsn_is_unset(dsn: str) -> None:
    result = pgqueue("enqueue", "q", "{}", env=clean_env(DATABASE_URL=dsn))
    assert result.returncode == 0, result.stderr
    assert len(job_rows(dsn)) == 1


@pytest.mark.parametrize(
    "args", [(), ("nope",), ("enqueue",), ("stats", "--bogus"), ("server", "explode")]
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    result = pgqueue(*args, env=clean_env(PGQUEUE_DSN="host=127.0.0.1 port=1"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "usage:" in result.stderr


def _commands() -> list[str]:
    """Every subcommand the parser knows, plugins included."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    return sorted(sub.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", _commands())
def test_help_on_every_command(command: str) -> None:
    if command in PLUGINS and not hasattr(importlib.import_module(PLUGINS[command][0]), "main"):
        pytest.skip(f"{PLUGINS[command][0]} has no main() yet")
    result = pgqueue(command, "--help", env=clean_env(PGQUEUE_DSN="host=127.0.0.1 port=1"))
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout.lower()
    assert result.stderr == ""


def test_top_level_help() -> None:
    result = pgqueue("--help")
    assert result.returncode == 0
    for command in ("init", "enqueue", "worker", "reap", "stats", "server"):
        assert command in result.stdout


# -- server and the acceptance sequence ---------------------------------------------------
@pytest.fixture
def fresh_home() -> Iterator[Path]:
    """An empty PGQUEUE_HOME; any embedded server started there is stopped afterwards."""
    home = Path(tempfile.mkdtemp(prefix="pgqueue-cli-"))
    home.chmod(0o755)  # as root the server runs as another user, who must reach it
    try:
        yield home
    finally:
        pgqueue("server", "stop", env=clean_env(PGQUEUE_HOME=str(home)))
        shutil.rmtree(home, ignore_errors=True)


def test_server_dsn_and_status_when_stopped(fresh_home: Path) -> None:
    env = clean_env(PGQUEUE_HOME=str(fresh_home))
    dsn = pgqueue("server", "dsn", env=env)
    assert dsn.returncode == 0 and "user=postgres" in dsn.stdout and "host=/" in dsn.stdout
    status = pgqueue("server", "status", env=env)
    assert status.returncode != 0 and status.stdout.startswith("stopped")
    assert "not running" in pgqueue("server", "stop", env=env).stdout


@pytest.mark.slow
def test_acceptance_with_the_embedded_server(fresh_home: Path) -> None:
    env = clean_env(PGQUEUE_HOME=str(fresh_home))
    assert pgqueue("init", env=env).returncode == 0
    result = pgqueue("enqueue", "emails", '{"to": "a@example.com"}', env=env)
    assert result.returncode == 0, result.stderr
    stats = pgqueue("stats", env=env)
    assert stats.returncode == 0, stats.stderr
    assert stats.stdout.splitlines()[1].split()[:3] == ["emails", "ready", "1"]
    status = pgqueue("server", "status", env=env)
    assert status.returncode == 0 and status.stdout.startswith("running")
    dsn = pgqueue("server", "dsn", env=env).stdout.strip()
    assert rows(dsn, "SELECT payload FROM jobs") == [({"to": "a@example.com"},)]
    assert pgqueue("server", "stop", env=env).stdout.strip() == "stopped"
    assert pgqueue("server", "status", env=env).returncode != 0


def test_acceptance_with_pgqueue_dsn(empty_dsn: str) -> None:
    assert pgqueue("init", dsn=empty_dsn).returncode == 0
    assert pgqueue("enqueue", "emails", '{"to": "a@example.com"}', dsn=empty_dsn).returncode == 0
    stats = pgqueue("stats", dsn=empty_dsn)
    assert stats.returncode == 0, stats.stderr
    assert stats.stdout.splitlines()[1].split()[:3] == ["emails", "ready", "1"]
