"""The fence as a state machine: a model-based test of the fencing API (issue #29).

Hypothesis's stateful testing drives any interleaving of claims, heartbeats, fenced writes
(upsert or update, row there or not), durable steps (alone and inside
``job.transaction()``), completions with results, fails, releases, cancels, reaps and
leases run out, by several holders whose connections are in different client states
(``dict_row``, another isolation level, an autocommit connection of their own or one shared),
against the real database. A plain model beside it says what each call must answer; after
every step the jobs table, the side table and the stored steps must match the model, and:

- a job's fence never goes down (each claim and fail and cancel raises it);
- at most one holder's write is accepted per claim: every accepted write was made by the
  job's current holder, and a refused one is reported refused (False or ``LeaseLost``);
- a missing row is never a lost claim (``job.lost`` only when the claim is over);
- nothing is lost: every job the model has is in the table, in the model's status.

Time passing is modelled by running a chosen lease out in the database (the reaper and
the claim checks compare with the server's clock). ``PGQUEUE_MODEL_EXAMPLES`` sets how
many examples run (the soak's longer profile); the default keeps ``make test`` in seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)
from psycopg.rows import dict_row

from pgqueue import Job, LeaseLost, Queue

MAX_ATTEMPTS = 3
EXAMPLES = int(os.environ.get("PGQUEUE_MODEL_EXAMPLES", "25"))
STEPS = int(os.environ.get("PGQUEUE_MODEL_STEPS", "40"))


@dataclass
class Model:
    """What the table must hold for one job, and who may write for it."""

    status: str = "ready"
    fence: int = 0
    attempts: int = 0
    expired: bool = False  # the lease ran out (by the server's clock)
    holder: int | None = None  # the fence of the claim that holds it now
    result: Any = None
    report: tuple[int, str] | None = None  # (fence, body) of its row in reports
    steps: dict[str, Any] = field(default_factory=dict)


def _open(dsn: str, state: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, autocommit=True)
    if state == "dict_row":
        conn.row_factory = dict_row  # type: ignore[assignment]
    elif state == "repeatable_read":
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    elif state == "prepared":
        conn.prepare_threshold = 0
    return conn


STATES = ("tuple_row", "dict_row", "repeatable_read", "prepared")


class FenceMachine(RuleBasedStateMachine):
    """Holders of two jobs against the real jobs table, with a model beside it."""

    claims = Bundle("claims")

    def __init__(self, dsn: str, conns: dict[str, psycopg.Connection]) -> None:
        super().__init__()
        self.dsn = dsn
        self.conns = conns
        admin = conns["tuple_row"]
        admin.execute("TRUNCATE jobs, reports, pgqueue_steps RESTART IDENTITY CASCADE")
        self.queue = Queue(conns["tuple_row"])
        self.dict_queue = Queue(conns["dict_row"])  # a caller's connection with dict_row
        self.model: dict[int, Model] = {}
        for _ in range(2):
            job_id = self.queue.enqueue({}, queue="q", max_attempts=MAX_ATTEMPTS)
            self.model[job_id] = Model()
        self.fences_seen: dict[int, int] = dict.fromkeys(self.model, 0)

    # -- what a claim is, in the model -----------------------------------------------
    def current(self, job: Job) -> bool:
        """Whether ``job`` (a claim) is its job's current holder, running."""
        m = self.model[job.id]
        return m.status == "running" and m.holder == job.fence

    def live(self, job: Job) -> bool:
        """Current, and its lease has not run out: what a fenced write or step needs."""
        return self.current(job) and not self.model[job.id].expired

    def q(self, via_dict: bool) -> Queue:
        return self.dict_queue if via_dict else self.queue

    # -- rules -------------------------------------------------------------------------
    @rule(target=claims, state=st.sampled_from(STATES), via_dict=st.booleans())
    def claim(self, state: str, via_dict: bool) -> Any:
        jobs = self.q(via_dict).claim("q")
        ready = [i for i, m in self.model.items() if m.status == "ready"]
        assert len(jobs) == min(1, len(ready))
        if not jobs:
            return multiple()
        [job] = jobs
        m = self.model[job.id]
        assert job.id in ready and job.fence == m.fence + 1 and job.attempts == m.attempts + 1
        m.status, m.fence, m.attempts, m.holder, m.expired = (
            "running",
            job.fence,
            job.attempts,
            job.fence,
            False,
        )
        job.conn = self.conns[state]
        return job

    @rule(job=claims, via_dict=st.booleans())
    def heartbeat(self, job: Job, via_dict: bool) -> None:
        expected = self.current(job)
        assert self.q(via_dict).heartbeat(job) is expected
        if expected:
            self.model[job.id].expired = False
        else:
            assert job.lost

    @rule(job_id=st.integers(1, 2))
    def run_lease_out(self, job_id: int) -> None:
        m = self.model[job_id]
        if m.status == "running":
            self.conns["tuple_row"].execute(
                "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s",
                [job_id],
            )
            m.expired = True

    @rule()
    def reap(self) -> None:
        reaped = {r.id: r.status for r in self.queue.reap()}
        expected = {}
        for job_id, m in self.model.items():
            if m.status == "running" and m.expired:
                m.status = "dead" if m.attempts >= MAX_ATTEMPTS else "ready"
                m.holder, m.expired = None, False
                expected[job_id] = m.status
        assert reaped == expected

    @rule(job=claims, upsert=st.booleans(), body=st.sampled_from(["a", "b"]))
    def fenced_write(self, job: Job, upsert: bool, body: str) -> None:
        m = self.model[job.id]
        was_lost = job.lost
        present = m.report is not None
        expected = self.live(job) and (upsert or present) and not was_lost
        if expected and present:
            assert m.report is not None
            expected = m.report[0] <= job.fence  # the same job: an equal fence may write again
        answer = job.fenced_write("reports", {"job_id": job.id}, {"body": body}, upsert=upsert)
        assert answer is expected
        if answer:
            m.report = (job.fence, body)
            assert not job.lost
        elif self.live(job) and not upsert and not present:
            assert job.lost is was_lost  # a missing row: the claim holds
        else:
            assert job.lost  # refused: this holder's claim is over, and it is told

    @rule(job=claims, name=st.sampled_from(["charge", "ship"]), in_tx=st.booleans())
    def step(self, job: Job, name: str, in_tx: bool) -> None:
        m = self.model[job.id]
        value = [job.fence, name]
        if job.lost:  # known stale here: refused without a round trip, fn not run
            with pytest.raises(LeaseLost):
                self._step(job, name, value, in_tx)
            return
        done = m.steps.get(name)
        try:
            got = self._step(job, name, value, in_tx)
        except LeaseLost:
            assert done is None or in_tx, "a stored step is read back, not refused"
            assert not self.live(job) and job.lost
            return
        except psycopg.errors.SerializationFailure:
            # REPEATABLE READ: the job row changed since the snapshot: rolled back, retry
            assert in_tx and job.conn is self.conns["repeatable_read"]
            return
        assert self.live(job) or (done is not None and not in_tx)
        if done is None:
            m.steps[name] = value
            assert got == value
        else:
            assert got == done

    def _step(self, job: Job, name: str, value: Any, in_tx: bool) -> Any:
        if not in_tx:
            return job.step(name, lambda: value)
        with job.transaction():
            return job.step(name, lambda: value)

    @rule(job=consumes(claims), result=st.sampled_from([None, 7, {"ok": True}]), via=st.booleans())
    def complete(self, job: Job, result: Any, via: bool) -> None:
        expected = self.current(job)
        assert self.q(via).complete(job, result) is expected
        if expected:
            m = self.model[job.id]
            m.status, m.holder, m.result, m.expired = "done", None, result, False
        else:
            assert job.lost

    @rule(job=consumes(claims), give_up=st.booleans())
    def fail(self, job: Job, give_up: bool) -> None:
        expected = self.current(job)
        assert self.queue.fail(job, "boom", backoff=0, give_up=give_up) is expected
        if expected:
            m = self.model[job.id]
            m.fence += 1
            m.status = "dead" if give_up or m.attempts >= MAX_ATTEMPTS else "ready"
            m.holder, m.expired = None, False
        else:
            assert job.lost

    @rule(job=consumes(claims))
    def release(self, job: Job) -> None:
        expected = self.current(job)
        assert self.queue.release(job) is expected
        if expected:
            m = self.model[job.id]
            m.status, m.holder, m.expired = "ready", None, False
            m.attempts -= 1

    @rule(job_id=st.integers(1, 2))
    def cancel(self, job_id: int) -> None:
        m = self.model[job_id]
        expected = m.status in ("ready", "running")
        assert self.queue.cancel(job_id) is expected
        if expected:
            m.status, m.holder, m.expired = "cancelled", None, False
            m.fence += 1

    # -- invariants, after every step --------------------------------------------------
    @invariant()
    def the_table_is_the_model(self) -> None:
        got = {
            r[0]: r[1:]
            for r in self.conns["tuple_row"].execute(
                "SELECT id, status, fence, attempts FROM jobs ORDER BY id"
            )
        }
        want = {i: (m.status, m.fence, m.attempts) for i, m in self.model.items()}
        assert got == want  # nothing lost, every status and fence as the model says
        for job_id, m in self.model.items():
            if m.status == "done":
                assert self.queue.result(job_id, timeout=1) == m.result

    @invariant()
    def fences_never_go_down(self) -> None:
        for job_id, fence in self.conns["tuple_row"].execute("SELECT id, fence FROM jobs"):
            assert fence >= self.fences_seen[job_id]
            self.fences_seen[job_id] = fence

    @invariant()
    def side_rows_are_the_accepted_writes(self) -> None:
        got = {
            r[0]: (r[1], r[2])
            for r in self.conns["tuple_row"].execute("SELECT job_id, fence, body FROM reports")
        }
        want = {i: m.report for i, m in self.model.items() if m.report is not None}
        assert got == want

    @invariant()
    def stored_steps_are_the_accepted_steps(self) -> None:
        got = {
            (r[0], r[1]): r[2]
            for r in self.conns["tuple_row"].execute(
                "SELECT job_id, name, output FROM pgqueue_steps"
            )
        }
        want = {(i, name): v for i, m in self.model.items() for name, v in m.steps.items()}
        assert got == want


def test_every_answer_a_fence_gives_is_true(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE reports (job_id bigint PRIMARY KEY, fence bigint NOT NULL, body text)"
        )
    conns = {state: _open(dsn, state) for state in STATES}
    try:
        run_state_machine_as_test(
            lambda: FenceMachine(dsn, conns),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        for conn in conns.values():
            conn.close()


def test_the_model_finds_the_missing_row_hole(dsn: str) -> None:
    """A fixed example of the kind the machine found (#29 hole 1): an update of a row not
    there yet, then a heartbeat and a complete of the same claim."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE reports (job_id bigint PRIMARY KEY, fence bigint NOT NULL, body text)"
        )
    conns = {state: _open(dsn, state) for state in STATES}
    try:
        machine = FenceMachine(dsn, conns)
        job = machine.claim("dict_row", True)
        machine.fenced_write(job, upsert=False, body="a")
        machine.the_table_is_the_model()
        machine.heartbeat(job, via_dict=False)
        machine.complete(job, result=7, via=True)
        machine.the_table_is_the_model()
    finally:
        for conn in conns.values():
            conn.close()
