"""The engine's decisions (``pgqueue.rules``), with no database and no clock: each case
below is one that a fix of the engine once had to prove with real workers against
PostgreSQL (5,001 jobs and a minute for one claim size); here each takes microseconds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pgqueue import rules
from pgqueue.rules import Held, Row


# -- claim size and the holding bound -----------------------------------------------------
def test_a_worker_holds_at_most_batch_a_lane_unfinished_and_twice_that_in_all() -> None:
    assert rules.holds_at_most(10, 4, plain=True) == (40, 80)
    assert rules.holds_at_most(50, 500, plain=False) == (
        549,
        1098,
    )  # a batch beside all lanes but one
    assert rules.holds_at_most(1, 1, plain=True) == (1, 2)  # the chaos checks' HELD


def test_jobs_on_their_way_out_leave_room_for_the_next_claim_up_to_twice_the_cap() -> None:
    # one lane, batch 1: job 1's completion is held, so job 2 may be claimed ...
    assert rules.room_to_hold(1, 1, plain=True, held=1, finishing=1) == 1
    # ... but not job 3 while both are held (twice the cap in all)
    assert rules.room_to_hold(1, 1, plain=True, held=2, finishing=1) == 0
    # an async worker whose completions were held up claimed without bound before
    assert rules.room_to_hold(1, 4, plain=False, held=8, finishing=8) == 0


def test_a_claim_under_a_backlog_asks_for_whole_batches_never_over_the_claims_limit() -> None:
    # four lanes of 5,000: 15,000 was asked once, refused, and retried for ever
    room = rules.room_to_hold(5000, 4, plain=True, held=0, finishing=0)
    size = rules.claim_size(room, 5000, deep=True, plain=True)
    assert size == 10_000 == rules.MAX_CLAIM and size % 5000 == 0
    assert rules.claim_size(37, 10, deep=True, plain=True) == 30  # plain: whole batches
    assert rules.claim_size(37, 10, deep=True, plain=False) == 37  # async: whatever fits
    assert rules.claim_size(37, 10, deep=False, plain=True) == 10  # no backlog: one batch
    assert rules.claim_size(0, 10, deep=False, plain=True) == 0


def test_a_worker_claims_when_a_lane_is_free_or_ahead_under_a_backlog() -> None:
    assert rules.wants_jobs(1, waiting=0, busy=3, lanes=4, deep=False)
    assert not rules.wants_jobs(1, waiting=0, busy=4, lanes=4, deep=False)
    assert not rules.wants_jobs(1, waiting=1, busy=3, lanes=4, deep=False)
    assert rules.wants_jobs(4, waiting=3, busy=4, lanes=4, deep=True)  # claiming ahead
    assert not rules.wants_jobs(0, waiting=0, busy=0, lanes=4, deep=True)  # no room


# -- burst runs ---------------------------------------------------------------------------
def test_a_burst_run_is_dry_only_if_nothing_was_held_and_the_reaper_returned_nothing() -> None:
    assert rules.burst_dry(held_while_claiming=False, reaped_back=0)
    # a fail with no backoff that committed after the empty claim's snapshot
    assert not rules.burst_dry(held_while_claiming=True, reaped_back=0)
    # a crashed worker's job whose lease ran out (#29 hole 5)
    assert not rules.burst_dry(held_while_claiming=False, reaped_back=1)


# -- one job's turn -----------------------------------------------------------------------
def test_a_stop_asked_during_start_gives_claimed_jobs_back_and_lost_ones_are_skipped() -> None:
    assert rules.may_start(working=False, current=True, lost=False) == "release"
    assert rules.may_start(working=True, current=False, lost=False) == "skip"
    assert rules.may_start(working=True, current=True, lost=True) == "skip"
    assert rules.may_start(working=True, current=True, lost=False) == "start"


def test_late_expired_and_heartbeat_times_take_the_time_as_an_argument() -> None:
    assert not rules.late(None, 1.0, 100.0)  # not started
    assert not rules.late(10.0, None, 100.0)  # no timeout
    assert not rules.late(10.0, 5.0, 15.0) and rules.late(10.0, 5.0, 15.01)
    assert rules.expired(10.0, 10.0) and not rules.expired(10.0, 9.99)
    assert rules.beat_every(30.0) == 10.0
    assert rules.task_or_worker(None, 2.0) == 2.0 and rules.task_or_worker(0.5, 2.0) == 0.5
    assert rules.task_or_worker(0.0, 2.0) == 0.0  # a task's 0 is a choice, not "unset"


def test_completions_go_out_when_their_batch_ends_or_the_oldest_waited_long_enough() -> None:
    assert rules.flush_due([], [], stopping=True, flush_after=0.05) == []
    assert rules.flush_due([0.01, 0.0], [1, 0], stopping=False, flush_after=0.05) == [1]
    assert rules.flush_due([0.06, 0.0], [1, 1], stopping=False, flush_after=0.05) == [0, 1]
    assert rules.flush_due([0.0, 0.0], [1, 1], stopping=True, flush_after=0.05) == [0, 1]


# -- a row read back after a lost reply ---------------------------------------------------
HELD = Held(fence=3, attempts=3)


@pytest.mark.parametrize(
    ("action", "row", "answer"),
    [
        ("complete", Row("done", 3, 3, None), True),
        ("complete", Row("done", 4, 4, None), False),  # another holder completed it
        ("complete", Row("ready", 3, 3, None), False),  # reaped: never completed
        ("complete", None, None),  # pruned since: perhaps by this completion
        ("fail", Row("running", 3, 3, None), False),  # a fail raises the fence
        ("fail", Row("ready", 4, 3, "E: x"), True),
        ("fail", Row("dead", 4, 3, "E: x"), True),
        ("fail", Row("cancelled", 4, 3, None), False),  # a cancel raised it instead
        # reaped, claimed by another (fence 4, attempt 4) and failed with the same text:
        ("fail", Row("ready", 5, 4, "E: x"), None),  # counted as this fail before #29
        ("fail", Row("running", 4, 4, None), None),  # reaped and claimed again: cannot tell
        ("release", Row("ready", 3, 2, None), True),
        ("release", Row("ready", 3, 3, None), False),  # reaped, not released
        ("release", Row("running", 4, 3, None), None),
    ],
)
def test_a_lost_reply_is_counted_as_taken_only_from_a_state_no_other_writer_makes(
    action: rules.Action, row: Row | None, answer: bool | None
) -> None:
    assert rules.took_effect(action, HELD, row, "E: x") is answer


def test_each_end_has_its_event_kind() -> None:
    assert [rules.end_kind("fail", e) for e in ("ok", "refused", "gave-up", "unknown")] == [
        "fail",
        "fail-rejected",
        "gave-up",
        "fail-unknown",
    ]


# -- reconnecting -------------------------------------------------------------------------
def test_one_reconnect_rule_doubles_to_a_cap_with_jitter_and_starts_again() -> None:
    backoff = rules.Backoff(first=0.05, cap=0.4, jitter=lambda: 0.5)  # no jitter: x1
    assert [backoff.failed() for _ in range(5)] == [0.05, 0.1, 0.2, 0.4, 0.4]
    backoff.succeeded()
    assert backoff.failed() == 0.05
    low = rules.Backoff(first=1.0, jitter=lambda: 0.0).failed()
    high = rules.Backoff(first=1.0, jitter=lambda: 0.999).failed()
    assert low == 0.5 and 1.49 < high < 1.5


def test_the_rules_module_does_no_io_and_reads_no_clock() -> None:
    """Rule 2 of its docstring, held: it imports no asyncio, psycopg, time or socket."""
    tree = ast.parse(Path(rules.__file__).read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert not imported & {"asyncio", "psycopg", "time", "socket", "threading", "pgqueue"}
