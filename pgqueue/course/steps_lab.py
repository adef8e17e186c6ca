"""Notebook 16's experiments: a three-step job killed after its second step, a step written
by a check and a write in two statements (wrong on purpose) against ``job.step``, a result
waited for, and a handler's transaction held to its commit. Teaching aids, not the queue."""

from __future__ import annotations

import threading
import time
from typing import Any

import pandas as pd
import psycopg
from psycopg.types.json import Jsonb

from ..errors import LeaseLost
from ..job import Job
from ..queue import Queue
from ..worker import Worker
from .faults import FaultyWorker

STEPS = ("reserve", "charge", "ship")
FAST = {"poll_interval": 0.05, "listen": False, "reap_interval": 0.1}


def killed_after_two(dsn: str, *, lease: float = 0.5) -> tuple[pd.DataFrame, int]:
    """A three-step job (reserve, charge, ship, each a ``job.step``): worker A runs it and
    dies right after storing the second step, before the third (``FaultyWorker.crash``:
    it writes nothing more, like SIGKILL); worker B, started then, gets the job back from the
    reaper once A's lease runs out. One row per step function that ran (attempt, worker,
    step), and the job's id."""
    ran: list[dict[str, Any]] = []
    crashed = threading.Event()

    def order(name: str, worker: list[Worker]) -> Any:
        def handler(job: Job) -> None:
            for step in STEPS:

                def do(step: str = step) -> dict[str, Any]:
                    ran.append({"attempt": job.attempts, "worker": name, "step": step})
                    return {"step": step, "by": name}

                job.step(step, do)
                if name == "A" and step == "charge":
                    worker[0].crash()  # killed here: step three never starts
                    crashed.set()
                    return

        return handler

    with Queue(dsn) as q:
        job_id = q.enqueue({"order": 7}, queue="orders")
    a_box: list[Worker] = []
    a = FaultyWorker(order("A", a_box), queue="orders", dsn=dsn, lease=lease, name="A", **FAST)
    a_box.append(a)
    a.start()
    if not crashed.wait(10):
        raise TimeoutError("worker A never reached its second step")
    b = Worker(order("B", []), queue="orders", dsn=dsn, lease=5, name="B", **FAST).start()
    with Queue(dsn) as q:
        deadline = time.monotonic() + 20
        while (state := q.get(job_id)) is None or state.status != "done":
            if time.monotonic() > deadline:
                raise TimeoutError("worker B did not finish the job")
            time.sleep(0.02)
    b.stop(grace=2)
    a.stop(grace=0.1)
    return pd.DataFrame(ran), job_id


def _takeover(dsn: str, job_id: int) -> Job:
    """End the first claim of ``job_id`` as a pause past its lease does, and claim it again."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [job_id]
        )
    other = Queue(dsn)
    other.reap()
    [holder] = other.claim("steps")
    return holder


# NEVER USE: check the claim, then write the step, in two statements.
CHECK = (
    "SELECT 1 FROM jobs WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'"
    " AND lease_until > clock_timestamp()"
)
WRITE = (
    "INSERT INTO pgqueue_steps (job_id, name, output, fence, written_at)"
    " VALUES (%(job)s, %(name)s, %(output)s, %(fence)s, clock_timestamp())"
    " ON CONFLICT (job_id, name) DO NOTHING"
)


def stale_step(dsn: str, way: str) -> dict[str, Any]:
    """Holder A (fence 1) did step one and pauses before writing step two; meanwhile its
    lease runs out and B takes the job over (fence 2). ``way="check, then write"``: A had
    checked its claim before the pause and writes afterwards (two statements); ``way=
    "job.step"``: A's write is ``job.step``. Then B runs step two. What A's write did, what
    B's step two returned, and the fence the stored step two carries."""
    with Queue(dsn) as q:
        job_id = q.enqueue({"order": 8}, queue="steps")
        [a] = q.claim("steps", lease=30)
        a.step("one", lambda: "by A")
        params = {"job": a.id, "fence": a.fence, "name": "two", "output": Jsonb("A's charge")}
        if way == "check, then write":
            checked = q.conn.execute(CHECK, params).fetchone() is not None
            b = _takeover(dsn, job_id)  # A pauses here, between its check and its write
            q.conn.execute(WRITE, params)
            a_did = f"checked: {checked}, then wrote"
        else:
            b = _takeover(dsn, job_id)  # A pauses here, before job.step writes
            try:
                a.step("two", lambda: "A's charge")
                a_did = "stored"
            except LeaseLost as exc:
                a_did = f"LeaseLost: {exc}"
        b_two = b.step("two", lambda: "B's charge")
        [(fence,)] = q.conn.execute(
            "SELECT fence FROM pgqueue_steps WHERE job_id = %s AND name = 'two'", [job_id]
        ).fetchall()
        assert b.conn is not None
        b.conn.close()
    return {"A's step two": a_did, "B's step two returned": b_two, "stored under fence": fence}


def result_wait(dsn: str, *, listen: bool, poll_interval: float) -> dict[str, Any]:
    """Enqueue a sum, run a Worker on it, and wait for the result with ``Queue.result``:
    what came back, and how long after the handler returned (seconds)."""
    returned: list[float] = []

    def add(job: Job) -> dict[str, int]:
        returned.append(time.monotonic())
        return {"sum": job.payload["a"] + job.payload["b"]}

    with Queue(dsn) as q:
        job_id = q.enqueue({"a": 2, "b": 3}, queue="sums")
        worker = Worker(add, queue="sums", dsn=dsn, **FAST).start()
        try:
            value = q.result(job_id, timeout=30, listen=listen, poll_interval=poll_interval)
            came = time.monotonic()
        finally:
            worker.stop(grace=1)
    return {"result": value, "after the handler returned (s)": came - returned[0]}


INVOICES = (
    "CREATE TABLE IF NOT EXISTS invoices (job_id bigint PRIMARY KEY, cents int CHECK (cents >= 0))"
)


def cancelled_mid_block(dsn: str, *, held: bool) -> dict[str, Any]:
    """Claim an invoice job and write its invoice in a transaction: ``job.transaction()``
    (``held``) or a plain one; someone cancels the job while the block is still writing.
    How the block ended, and whether the invoice is there."""
    with Queue(dsn) as q:
        q.conn.execute(INVOICES)
        q.enqueue({"order": 9}, queue="invoices")
        [job] = q.claim("invoices")
        assert job.conn is not None
        block = job.transaction() if held else job.conn.transaction()
        try:
            with block:
                job.conn.execute("INSERT INTO invoices VALUES (%s, 900)", [job.id])
                with Queue(dsn) as other:
                    assert other.cancel(job.id)  # someone cancels the job, mid-block
            outcome = "committed"
        except LeaseLost:
            outcome = "LeaseLost, rolled back"
        row = q.conn.execute("SELECT count(*) FROM invoices WHERE job_id = %s", [job.id])
        (kept,) = row.fetchone() or (0,)
    return {"block": outcome, "invoice rows": kept}
