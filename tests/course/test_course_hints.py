"""Hints in tiers for the exercises of notebooks 02, 05, 06, 08, 09, 10, 11, 12 and 13,
against a real server: each solution passes, and each plausible wrong answer fails with a
hint of its own kind, the symptom first and the fix at the second slip of that kind."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from typing import Any

import psycopg
import pytest

from pgqueue.course import own_code_lab
from pgqueue.course.checks import (
    ExerciseFailed,
    nb02,
    nb05,
    nb06,
    nb07,
    nb11,
    nb12,
    nb13,
    nb14,
    nb17,
)
from pgqueue.course.checks.tiers import Hints


def slips(check: Any, hints: Hints, *args: Any, **kwargs: Any) -> tuple[str, str, str]:
    """The messages of two runs of a check that must fail, from fresh hint tiers, and the
    one kind of mistake both runs counted."""
    hints.seen.clear()
    found = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            check(*args, **kwargs)
        found.append(str(info.value))
    first, second = found
    assert "Hint:" not in first and "fix it and run the check again" in first, first
    same = re.sub(r"\d+", "N", first.partition(" (fix it")[0])  # ids differ from run to run
    assert re.sub(r"\d+", "N", second).startswith(same) and "Hint:" in second, second
    assert len(hints.seen) == 1 and set(hints.seen.values()) == {2}, hints.seen
    [kind] = hints.seen
    return first, second, kind


def distinct(results: dict[str, tuple[str, str, str]]) -> None:
    """Each wrong answer was its own kind of mistake, with its own symptom and hint."""
    kinds = [kind for _, _, kind in results.values()]
    assert len(set(kinds)) == len(kinds), kinds
    hints = [second.partition("Hint: ")[2] for _, second, _ in results.values()]
    assert len(set(hints)) == len(hints), hints


# Notebook 02: the claim.
CLAIM = """
UPDATE jobs
SET status      = 'running',
    attempts    = attempts + 1,
    fence       = fence + 1,
    lease_until = now() + make_interval(secs => %(lease)s)
WHERE id IN (
  SELECT id FROM jobs
  WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
  ORDER BY priority DESC, run_at, id
  LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED
)
RETURNING id, fence, attempts, lease_until
"""
WRONG_CLAIMS = {
    "skip-locked": CLAIM.replace(" SKIP LOCKED", ""),
    "for-update": CLAIM.replace("  FOR UPDATE SKIP LOCKED\n", ""),
    "oldest": CLAIM.replace("run_at, id", "run_at DESC, id"),
    "priority": CLAIM.replace("priority DESC, ", ""),
    "fence": CLAIM.replace("fence + 1", "fence"),
    "attempts": CLAIM.replace("attempts + 1", "attempts"),
    "lease-param": CLAIM.replace("make_interval(secs => %(lease)s)", "interval '30 seconds'"),
    "run-at": CLAIM.replace(" AND run_at <= now()", ""),
    "limit": CLAIM.replace("LIMIT %(limit)s", "LIMIT 5"),
}


def test_the_claim_check_passes_the_solution_and_tells_each_slip_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb02.check_claim(dsn, CLAIM)
    assert "two sessions at once got different jobs" in capsys.readouterr().out
    results = {}
    for want, wrong in WRONG_CLAIMS.items():
        assert wrong != CLAIM, want
        results[want] = slips(nb02.check_claim, nb02.CLAIM_HINTS, dsn, wrong)
        assert results[want][2] == want, (want, results[want])
    distinct(results)
    assert "it runs twice" in results["for-update"][0]
    assert "FOR UPDATE SKIP LOCKED" in results["for-update"][1]
    assert "stand in line" in results["skip-locked"][0]
    assert "fence + 1" in results["fence"][1] and "fence + 1" not in results["fence"][0]


def test_the_broken_claims_race_as_the_notebook_says(dsn: str) -> None:
    assert nb02.race(dsn, CLAIM)[:3] == ([11], [12], False)
    no_skip = nb02.race(dsn, nb02.broken(CLAIM, "SKIP LOCKED"))
    assert no_skip.b_waited and no_skip.a_ids != no_skip.b_ids
    no_lock = nb02.race(dsn, nb02.broken(CLAIM, "FOR UPDATE"))
    assert re.search(r"FOR\s+UPDATE", nb02.broken(CLAIM, "FOR UPDATE")) is None
    assert no_lock.b_waited and no_lock.a_ids == no_lock.b_ids
    assert no_lock.fences[no_lock.a_ids[0]] == 2


# Notebook 05: a retry schedule within the budget.
def test_the_retry_budget_check_tells_too_many_too_short_and_too_long_apart(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb06.check_retry_budget(dsn, 5.0, 8)
    assert "within the hour" in capsys.readouterr().out
    results = {
        "attempts": slips(nb06.check_retry_budget, nb06.HINTS, dsn, 5.0, 10),
        "short": slips(nb06.check_retry_budget, nb06.HINTS, dsn, 0.5, 8),
        "long": slips(nb06.check_retry_budget, nb06.HINTS, dsn, 30.0, 8),
    }
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)
    assert "2**max_attempts - 2" in results["short"][1]
    assert "2**max_attempts" not in results["short"][0]


# Notebook 06: what an idle worker sends.
@pytest.fixture
def course_server(admin_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks that make a scratch database of their own make it on this test server."""
    monkeypatch.setenv("PGQUEUE_DSN", admin_dsn)


def idle(concurrency: int, queues: int, poll_interval: float, reap_interval: float) -> float:
    return queues / poll_interval + 1 / reap_interval


WRONG_FORMULAS = {
    "reaper": lambda c, q, p, r: q / p,
    "per-lane": lambda c, q, p, r: c * q / p + 1 / r,
    "queues": lambda c, q, p, r: 1 / p + 1 / r,
    "interval": lambda c, q, p, r: q * p + 1 / r,
    "queues-count": lambda c, q, p, r: len(q) / p + 1 / r,
    "other": lambda c, q, p, r: 2 * q / p + 1 / r,
}


@pytest.mark.usefixtures("course_server")
def test_the_idle_formula_check_tells_each_missed_rule_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nb07.check_idle_formula(idle)  # and a real worker, about 2.5 s
    assert "a real idle worker sent about that" in capsys.readouterr().out
    results = {
        want: slips(nb07.check_idle_formula, nb07.HINTS, wrong)
        for want, wrong in WRONG_FORMULAS.items()
    }
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)
    assert "not the list of their names" in results["queues-count"][1]
    assert "dispatcher" in results["per-lane"][1] and "dispatcher" not in results["per-lane"][0]


# Notebook 11: the refund and its job in one transaction, on the lesson's own shop tables.


def refund_order(app: Any, q: Any, order_id: int, *, provider_fails: bool = False) -> None:
    with app.transaction():
        app.execute("UPDATE orders SET refunded = true WHERE id = %s", [order_id])
        q.enqueue({"order_id": order_id}, queue="refunds", conn=app)
        if provider_fails:
            raise RuntimeError("the payment provider refused the refund")


def no_transaction(app: Any, q: Any, order_id: int, *, provider_fails: bool = False) -> None:
    app.execute("UPDATE orders SET refunded = true WHERE id = %s", [order_id])
    q.enqueue({"order_id": order_id}, queue="refunds", conn=app)
    if provider_fails:
        raise RuntimeError("the payment provider refused the refund")


def own_connection(app: Any, q: Any, order_id: int, *, provider_fails: bool = False) -> None:
    with app.transaction():
        app.execute("UPDATE orders SET refunded = true WHERE id = %s", [order_id])
        q.enqueue({"order_id": order_id}, queue="refunds")  # no conn=app
        if provider_fails:
            raise RuntimeError("the payment provider refused the refund")


def update_outside(app: Any, q: Any, order_id: int, *, provider_fails: bool = False) -> None:
    app.execute("UPDATE orders SET refunded = true WHERE id = %s", [order_id])
    with app.transaction():
        q.enqueue({"order_id": order_id}, queue="refunds", conn=app)
        if provider_fails:
            raise RuntimeError("the payment provider refused the refund")


def never_raises(app: Any, q: Any, order_id: int, *, provider_fails: bool = False) -> None:
    refund_order(app, q, order_id)


@pytest.mark.slow  # nine runs of the check, each listening 0.3 s at a time: about 6 s
def test_the_refund_check_gives_each_mistake_its_own_hint(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(own_code_lab.SHOP)
    nb11.check_refund(refund_order, dsn)
    assert "rolled back, no job, no wake-up" in capsys.readouterr().out
    wrong = {
        "no-transaction": no_transaction,
        "conn": own_connection,
        "update-outside": update_outside,
        "no-raise": never_raises,
    }
    results = {want: slips(nb11.check_refund, nb11.HINTS, f, dsn) for want, f in wrong.items()}
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)
    assert "conn=app" in results["conn"][1] and "conn=app" not in results["conn"][0]


# Notebook 09: the guard of an e-mail send.
GUARD = """
INSERT INTO sent_emails (job_id, to_addr)
VALUES (%(job_id)s, %(to)s)
ON CONFLICT (job_id) DO NOTHING
"""
WRONG_GUARDS = {
    "job-id": "INSERT INTO sent_emails (job_id, to_addr) VALUES (%(fence)s, %(to)s)"
    " ON CONFLICT (job_id) DO NOTHING",
    "conflict": "INSERT INTO sent_emails (job_id, to_addr) VALUES (%(job_id)s, %(to)s)",
    "twice": GUARD.replace("DO NOTHING", "DO UPDATE SET to_addr = EXCLUDED.to_addr"),
}


@pytest.mark.slow  # five paused-worker stories of about 1.3 s each
def test_the_guard_check_tells_a_raising_and_a_double_sending_guard_apart(
    dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same story, told faster: A freezes 1 s past a 0.4 s lease (the lesson: 2 s, 1 s).
    story = functools.partial(nb05.paused_worker_story, pause=1.0, lease=0.4)
    monkeypatch.setattr(nb05, "paused_worker_story", story)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE sent_emails (job_id bigint PRIMARY KEY, to_addr text NOT NULL,"
            " sent_at timestamptz NOT NULL DEFAULT now())"
        )
    nb05.check_guard(GUARD, dsn)
    assert "sent one e-mail" in capsys.readouterr().out
    results = {
        want: slips(nb05.check_guard, nb05.HINTS, wrong, dsn)
        for want, wrong in WRONG_GUARDS.items()
    }
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)
    assert "DO NOTHING" in results["conflict"][1] and "DO NOTHING" not in results["conflict"][0]


@pytest.mark.slow  # three paused-worker stories, and a wait for a retry's backoff
def test_a_guard_that_raised_leaves_no_job_for_the_next_checks_paused_worker(
    dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A guard that raises on every run fails its job, which the worker retries after a
    backoff: in a queue shared by every story, the next check's A claimed that older job
    first and never ended the check's own (a TimeoutError instead of a verdict)."""
    story = functools.partial(nb05.paused_worker_story, pause=1.0, lease=0.4)
    monkeypatch.setattr(nb05, "paused_worker_story", story)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE sent_emails (job_id bigint PRIMARY KEY, to_addr text NOT NULL,"
            " sent_at timestamptz NOT NULL DEFAULT now())"
        )
    raising = GUARD.replace("(job_id, to_addr)", "(job, to_addr)")  # no such column
    with pytest.raises(ExerciseFailed, match="UndefinedColumn"):
        nb05.check_guard(raising, dsn)
    time.sleep(4.5)  # the failed job's backoff (1 s x 2^2) is over: it is ready again
    nb05.check_guard(GUARD, dsn)
    assert "sent one e-mail" in capsys.readouterr().out


# Notebook 17: the bound on re-runs of a fault plan (the plans alone: no chaos run).
def explainable(faults: list[Any], workers: int) -> int:
    per_fault = {"kill": 2, "stop": 2, "terminate": 2, "restart": 2 * workers}
    return sum(per_fault[f.kind] for f in faults)


def one_job_each(faults: list[Any], workers: int) -> int:
    return sum(workers if f.kind == "restart" else 1 for f in faults)


WRONG_BOUNDS = {
    "one-job": one_job_each,
    "restart-one": lambda faults, workers: 2 * len(faults),
    "restart-none": lambda faults, workers: 2 * sum(f.kind != "restart" for f in faults),
    "per-worker": lambda faults, workers: 2 * len(faults) * workers,
}


def test_the_bound_check_tells_each_miscounted_fault_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nb17.check_bound(explainable)
    assert "four fault plans" in capsys.readouterr().out
    results = {
        want: slips(nb17.check_bound, nb17.HINTS, wrong) for want, wrong in WRONG_BOUNDS.items()
    }
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)


# Notebook 05: the partial unique index of enqueue keys.
KEY_INDEX = """
CREATE UNIQUE INDEX my_jobs_key_idx ON my_jobs (queue, key)
  WHERE key IS NOT NULL AND status IN ('ready', 'running')
"""
WRONG_INDEXES = {
    "unique": KEY_INDEX.replace("UNIQUE ", ""),
    "per-queue": KEY_INDEX.replace("(queue, key)", "(key)"),
    "null-key": KEY_INDEX.replace("(queue, key)", "(queue, coalesce(key, ''))").replace(
        "key IS NOT NULL AND ", ""
    ),
    "running": KEY_INDEX.replace("IN ('ready', 'running')", "= 'ready'"),
    "ended": "CREATE UNIQUE INDEX my_jobs_key_idx ON my_jobs (queue, key)",
}


def test_the_key_index_check_gives_each_mistake_its_own_hint(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb05.check_key_index(KEY_INDEX, dsn)
    assert "added one job" in capsys.readouterr().out
    results = {
        want: slips(nb05.check_key_index, nb05.KEY_HINTS, wrong, dsn)
        for want, wrong in WRONG_INDEXES.items()
    }
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)


# Notebook 12: aging, ready jobs past a bound raised to the top priority.
AGING = """
UPDATE jobs SET priority = %(top)s
WHERE queue = %(queue)s AND status = 'ready' AND priority < %(top)s
  AND run_at < now() - make_interval(secs => %(after)s)
"""
WRONG_AGINGS = {
    "raise": AGING.replace("SET priority = %(top)s", "SET priority = priority"),
    "age": AGING.replace("\n  AND run_at < now() - make_interval(secs => %(after)s)", ""),
    "status": AGING.replace(" AND status = 'ready'", ""),
    "queue": AGING.replace("queue = %(queue)s AND ", ""),
    "lowered": AGING.replace(" AND priority < %(top)s", ""),
    "run-at": AGING.replace("SET priority = %(top)s", "SET priority = %(top)s, run_at = now()"),
    "rewrite": AGING.replace("priority < %(top)s", "priority <= %(top)s"),
}


def test_the_aging_check_gives_each_mistake_its_own_hint(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb12.check_aging(AGING, dsn)
    assert "one job raised to the top" in capsys.readouterr().out
    assert all(wrong != AGING for wrong in WRONG_AGINGS.values())
    results = {
        want: slips(nb12.check_aging, nb12.HINTS, wrong, dsn)
        for want, wrong in WRONG_AGINGS.items()
    }
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)


# Notebook 13: an async handler that awaits its I/O and its write.
async def send_email(order_id: int) -> str:
    await asyncio.sleep(0.1)
    return f"e-mail sent for order {order_id}"


async def notify_customer(job: Any) -> None:
    order_id = job.payload["order_id"]
    body = await send_email(order_id)
    await job.fenced_write("receipts", {"order_id": order_id}, {"body": body})


async def not_awaited(job: Any) -> None:
    order_id = job.payload["order_id"]
    body = await send_email(order_id)
    job.fenced_write("receipts", {"order_id": order_id}, {"body": body}).close()  # no await


async def wrong_key(job: Any) -> None:
    body = await send_email(job.payload["order_id"])
    await job.fenced_write("receipts", {"order_id": job.id + 5000}, {"body": body})


async def keyed_by_job_id(job: Any) -> None:  # passed while the orders were 1..20, like ids
    body = await send_email(job.payload["order_id"])
    await job.fenced_write("receipts", {"order_id": job.id}, {"body": body})


async def body_not_awaited(job: Any) -> None:  # stored "<coroutine object ...>" and passed
    order_id = job.payload["order_id"]
    body = send_email(order_id)
    await job.fenced_write("receipts", {"order_id": order_id}, {"body": str(body)})
    body.close()


async def body_of_another_order(job: Any) -> None:
    order_id = job.payload["order_id"]
    await send_email(order_id)
    await job.fenced_write("receipts", {"order_id": order_id}, {"body": "e-mail sent"})


@pytest.mark.usefixtures("course_server")
def test_the_async_handler_check_tells_a_lost_write_from_a_wrong_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    asyncio.run(nb13.check_async_handler(notify_customer))
    assert "awaited their" in capsys.readouterr().out

    def check(handler: Any) -> None:
        asyncio.run(nb13.check_async_handler(handler))

    results = {
        "no-await": slips(check, nb13.HINTS, not_awaited),
        "keyed": slips(check, nb13.HINTS, wrong_key),
        "body-coroutine": slips(check, nb13.HINTS, body_not_awaited),
        "body": slips(check, nb13.HINTS, body_of_another_order),
    }
    assert slips(check, nb13.HINTS, keyed_by_job_id)[2] == "keyed"
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)


# Notebook 14: worker processes per host within max_connections (a process holds threads + 4:
# lanes, dispatcher, finisher, keeper, listener; through PgBouncer all but the listener are
# its clients).
def processes_per_host(
    hosts: int, threads: int, budget: int, pool: int | None = None, max_client_conn: int = 1000
) -> int:
    if pool is None:
        return budget // (hosts * (threads + 4))
    return max(0, min((budget - pool) // hosts, max_client_conn // (hosts * (threads + 3))))


def lanes_only(
    hosts: int, threads: int, budget: int, pool: int | None = None, max_client_conn: int = 1000
) -> int:
    if pool is None:
        return budget // (hosts * threads)
    return processes_per_host(hosts, threads, budget, pool, max_client_conn)


def pool_ignored(
    hosts: int, threads: int, budget: int, pool: int | None = None, max_client_conn: int = 1000
) -> int:
    return budget // (hosts * (threads + 4))


def no_listeners(
    hosts: int, threads: int, budget: int, pool: int | None = None, max_client_conn: int = 1000
) -> int:
    if pool is None:
        return budget // (hosts * (threads + 4))
    return max_client_conn // (hosts * (threads + 3))


def test_the_fleet_check_tells_each_miscounted_connection_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nb14.check_fleet(processes_per_host)
    assert "directly and through PgBouncer" in capsys.readouterr().out
    wrong = {"direct": lanes_only, "pooled": pool_ignored, "listeners": no_listeners}
    results = {want: slips(nb14.check_fleet, nb14.HINTS, f) for want, f in wrong.items()}
    assert {want: kind for want, (_, _, kind) in results.items()} == {k: k for k in results}
    distinct(results)


def _drain(count_answer: bool) -> Any:
    """A worker loop for 02's exercise, counting its completions from complete()'s answer
    or (wrong) counting every complete it called."""

    def drain(q: Any, handler: Any, queue: str) -> int:
        completed = 0
        while jobs := q.claim(queue, limit=5, lease=30):
            for job in jobs:
                try:
                    handler(job)
                except Exception as exc:
                    q.fail(job, f"{type(exc).__name__}: {exc}")
                    continue
                took = q.complete(job)
                completed += 1 if (took or not count_answer) else 0
        return completed

    return drain


def test_02_worker_loop_counts_only_completions_that_took_effect(capsys: Any) -> None:
    nb02.check_worker_loop(_drain(count_answer=True))
    assert "the one cancelled mid-run not counted" in capsys.readouterr().out
    # Counting every q.complete called, without its answer: the cancelled job's complete
    # returned False (passed before: no complete was ever refused in the check).
    with pytest.raises(ExerciseFailed, match="returned False and completed nothing"):
        nb02.check_worker_loop(_drain(count_answer=False))
