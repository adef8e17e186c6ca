"""What ``pgqueue`` prints, as a user reads it: a worker's banner once, with the time, in the
right number ("1 lane", "4 lanes"), its summary once (with -v too), the defaults in
``worker --help``, and ``enqueue`` taking the queue as ``worker`` does (``--queue``)."""

from __future__ import annotations

import re

import pytest
from test_cli import pgqueue

from conftest import rows
from pgqueue.cli import main

TIMESTAMP = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} pgqueue\.worker "


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "-v"])
def test_the_banner_and_the_summary_are_said_once_the_banner_with_the_time(
    dsn: str, verbose: bool
) -> None:
    pgqueue("enqueue", "work", dsn=dsn, stdin=b"{}\n" * 3)
    flags = ["-v"] if verbose else []
    result = pgqueue(
        *flags, "worker", "tests.handlers:noop", "--queue", "work", "--burst",
        "--poll", "30", "--name", "once", dsn=dsn,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    both = result.stdout + result.stderr
    banners = [line for line in both.splitlines() if "once: " in line and "; queues " in line]
    assert len(banners) == 1, both
    assert re.match(TIMESTAMP, banners[0]), banners[0]
    assert "; 1 lane, batch 1" in banners[0], banners[0]  # not "1 lanes", nor "lane(s)"
    assert "PGQUEUE_DSN: " in banners[0]  # which setting named the server
    assert both.count("once: 3 done, 0 failed attempts") == 1, both
    assert "once: 3 done" in result.stdout  # the command's result, on stdout


def test_four_lanes_are_lanes(dsn: str) -> None:
    result = pgqueue(
        "worker", "tests.handlers:noop", "--queue", "work", "--burst", "-c", "4",
        "--poll", "30", "--name", "four", dsn=dsn,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "; 4 lanes, batch 1" in result.stderr, result.stderr


def test_worker_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    entries = re.split(r" (?=--[a-z-]+ [A-Z])", text.split("options:")[1])  # one per option
    for option, default in [
        ("--concurrency", "1"),
        ("--batch", "1"),
        ("--lease", "30.0"),
        ("--poll", "2.0"),
        ("--backoff", "1.0"),
        ("--reap-interval", "5.0"),
        ("--flush-after", "0.05"),
        ("--processes", "1"),
    ]:
        [entry] = [c for c in entries if c.startswith(f"{option} ")]
        assert f"(default: {default})" in entry, entry
    assert "(default: None)" not in text and "(default: False)" not in text


def test_enqueue_takes_the_queue_with_queue_as_worker_does(dsn: str) -> None:
    named = pgqueue("enqueue", "--queue", "mail", '{"to": "a"}', dsn=dsn)
    assert named.returncode == 0, named.stderr
    assert "enqueued 1 job(s) on 'mail'" in named.stdout
    lines = pgqueue("enqueue", "-q", "mail", dsn=dsn, stdin=b'{"n": 1}\n{"n": 2}\n')
    assert lines.returncode == 0 and "enqueued 2 job(s) on 'mail'" in lines.stdout
    same = pgqueue("enqueue", "mail", '{"n": 3}', "--queue", "mail", dsn=dsn)
    assert same.returncode == 0, same.stderr
    old = pgqueue("enqueue", "mail", '{"n": 4}', dsn=dsn)  # the positional still works
    assert old.returncode == 0, old.stderr
    assert rows(dsn, "SELECT DISTINCT queue FROM jobs") == [("mail",)]
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(5,)]


@pytest.mark.parametrize(
    "args",
    [
        ["enqueue", "mail", '{"n": 1}', "--queue", "post"],
        ["enqueue", "mail", "--queue", "post"],
    ],
    ids=["with a payload", "payloads on stdin"],
)
def test_enqueue_refuses_two_different_queues(dsn: str, args: list[str]) -> None:
    result = pgqueue(*args, dsn=dsn, stdin=b'{"n": 1}\n')
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[-1]  # after the command's usage
    assert line.startswith("pgqueue enqueue: error: "), result.stderr
    assert "'mail' and --queue 'post'" in line and "give it once" in line
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(0,)]


def test_enqueue_without_a_queue_says_how_to_name_one(dsn: str) -> None:
    result = pgqueue("enqueue", dsn=dsn)
    assert result.returncode == 2 and "usage: pgqueue enqueue" in result.stderr
    assert "name the queue" in result.stderr and "--queue" in result.stderr
