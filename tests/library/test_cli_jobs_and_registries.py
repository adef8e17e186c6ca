"""The command line's newer parts, as a user runs them: priorities, keys, cancel, show,
retry by id, several queues, timeouts, task registries, and one-line errors where a
traceback used to be."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
from test_cli import PGQUEUE, ROOT, clean_env, pgqueue, user_error

from conftest import rows


def execute(dsn: str, query: str, params: object = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query, params)  # type: ignore[arg-type]


def test_enqueue_with_priority_and_key_then_show_and_cancel(dsn: str) -> None:
    first = pgqueue("enqueue", "q", '{"n": 1}', "--key", "k", "--priority", "4", dsn=dsn)
    assert first.returncode == 0, first.stderr
    again = pgqueue("enqueue", "q", '{"n": 2}', "--key", "k", dsn=dsn)
    assert again.returncode == 0 and again.stdout == first.stdout  # the same job's id
    [(job_id, priority, key)] = rows(dsn, "SELECT id, priority, key FROM jobs")
    assert (priority, key) == (4, "k")
    shown = pgqueue("show", str(job_id), "--json", dsn=dsn)
    assert json.loads(shown.stdout)["status"] == "ready"
    cancelled = pgqueue("cancel", str(job_id), dsn=dsn)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    twice = pgqueue("cancel", str(job_id), dsn=dsn)
    assert twice.returncode == 1 and "unchanged" in twice.stdout
    assert "no job 999" in user_error(pgqueue("show", "999", dsn=dsn), 1)
    assert "--key names one job" in user_error(
        pgqueue("enqueue", "q", "--key", "k", stdin=b'{"a": 1}\n{"a": 2}\n', dsn=dsn), 2
    )


def test_retry_dead_by_id_says_which_were_not_dead(dsn: str) -> None:
    pgqueue("enqueue", "q", "{}", "--max-attempts", "1", dsn=dsn)
    pgqueue("enqueue", "q", "{}", dsn=dsn)
    with_ids = rows(dsn, "SELECT id FROM jobs ORDER BY id")
    dead, alive = with_ids[0][0], with_ids[1][0]
    execute(dsn, "UPDATE jobs SET status = 'dead' WHERE id = %s", [dead])
    result = pgqueue("retry-dead", "--id", str(dead), "--id", str(alive), dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "requeued 1" in result.stdout and f"not dead (or not found): [{alive}]" in result.stdout


def test_worker_on_two_queues_with_a_timeout_and_a_summary(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "slowmod.py").write_text(
        textwrap.dedent(
            """
            import time
            def handle(job):
                if job.payload.get("hang"):
                    time.sleep(5)
                if job.payload.get("fail"):
                    raise ValueError("bad input")
            """
        )
    )
    pgqueue("enqueue", "a", '{"hang": true}', "--max-attempts", "1", dsn=dsn)
    pgqueue("enqueue", "b", '{"fail": true}', "--max-attempts", "1", dsn=dsn)
    pgqueue("enqueue", "b", "{}", dsn=dsn)
    env = clean_env(PGQUEUE_DSN=dsn, PYTHONPATH=str(tmp_path))
    result = subprocess.run(
        [
            PGQUEUE,
            "worker",
            "slowmod:handle",
            "-q",
            "a",
            "-q",
            "b",
            "--burst",
            "--timeout",
            "0.5",
            "--backoff",
            "0",
            "--poll",
            "0.1",
            "--name",
            "w",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "w: 1 done, 2 failed attempts (2 now dead, 1 timed out)" in result.stdout, result.stderr
    assert "queues a, b" in result.stderr.splitlines()[0]  # the first line: where and what
    failures = [line for line in result.stderr.splitlines() if "failed, attempt" in line]
    assert len(failures) == 2, result.stderr
    assert rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY 1 ORDER BY 1") == [
        ("dead", 2),
        ("done", 1),
    ]


def test_worker_runs_a_task_registry(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "myapp.py").write_text(
        textwrap.dedent(
            """
            import pgqueue
            tasks = pgqueue.Tasks()

            @tasks.task(queue="emails")
            def send(job, to):
                print("sent", to)
            """
        )
    )
    env = clean_env(PGQUEUE_DSN=dsn, PYTHONPATH=str(tmp_path))
    subprocess.run(
        [sys.executable, "-c", "import myapp; myapp.send.enqueue(to='a@example.com')"],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    result = subprocess.run(
        [PGQUEUE, "worker", "myapp:tasks", "--burst", "--name", "w"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "sent a@example.com" in result.stdout and "w: 1 done" in result.stdout


def test_database_errors_and_broken_pipes_are_one_line(dsn: str) -> None:
    # a database error outside the connect path: the table is gone mid-life
    execute(dsn, "DROP TABLE jobs CASCADE; CREATE TABLE jobs (id int)")
    line = user_error(pgqueue("stats", dsn=dsn), 1)
    assert line.startswith("pgqueue stats: UndefinedColumn"), line
    shell = subprocess.run(
        f"{PGQUEUE} --help | head -1; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env=clean_env(PGQUEUE_DSN=dsn),
        cwd=ROOT,
        timeout=60,
    )
    assert "Traceback" not in shell.stderr and "BrokenPipe" not in shell.stderr


def test_stats_piped_into_head_ends_quietly(dsn: str) -> None:
    pgqueue("enqueue", "q", stdin=b"{}\n" * 50, dsn=dsn)
    execute(dsn, "UPDATE jobs SET queue = 'q' || id")  # 50 lines of stats
    shell = subprocess.run(
        f"{PGQUEUE} stats | head -1",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env=clean_env(PGQUEUE_DSN=dsn),
        cwd=ROOT,
        timeout=60,
    )
    assert shell.stdout.startswith("queue"), shell.stdout
    assert "Traceback" not in shell.stderr and "BrokenPipe" not in shell.stderr, shell.stderr


def test_server_status_says_which_server_is_in_use(dsn: str) -> None:
    result = pgqueue("server", "status", dsn=dsn)
    assert result.returncode in (0, 3)
    assert "in use: PGQUEUE_DSN: " in result.stdout, result.stdout
