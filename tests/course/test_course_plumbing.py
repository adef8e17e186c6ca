"""The plumbing notebooks 11, 13 and 18 call (own_code_lab, asyncio_lab, engine_lab.run_face
and places), against a real server: the counts, tables and waits they show are what the
database and the workers did."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from pgqueue import AsyncQueue, Tasks
from pgqueue.course import asyncio_lab, engine_lab, own_code_lab


def test_the_shop_tables_and_what_own_code_lab_reads_of_them(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as app:
        app.execute(own_code_lab.SHOP)
        app.execute("INSERT INTO orders (customer, amount_cents) VALUES ('ada', 1), ('bob', 2)")
        assert own_code_lab.count(app, "orders") == 2
        frame = own_code_lab.table(app, "SELECT id, customer AS who FROM orders ORDER BY id")
        assert list(frame.columns) == ["id", "who"] and list(frame.who) == ["ada", "bob"]
        own_code_lab.add_finished_jobs(app, 30)
        assert own_code_lab.count(app, "jobs") == 30
        done = app.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
        assert done == (30,)


def test_asyncio_lab_counts_serves_and_waits(dsn: str) -> None:
    async def scenario() -> None:
        async with AsyncQueue(dsn) as q:
            await asyncio_lab.create_shop(q.conn)
            first = await asyncio_lab.add_order(q.conn, "ada", 10)
            await asyncio_lab.add_order(q.conn, "bob", 20)
            assert await asyncio_lab.count(q.conn, "orders") == 2
            assert await asyncio_lab.count(q.conn, "orders", id=first) == 1
            assert await asyncio_lab.count(q.conn, "orders", id=first, customer="bob") == 0
            ids = await q.enqueue_many([{}, {}], queue="q")
            states = await asyncio_lab.job_states(q.conn, ids)
            assert list(states.index) == ids and (states.status == "ready").all()
            assert states.no_lease.all()

            async def handler(request: dict, conn: psycopg.AsyncConnection) -> dict:
                if request["card"] == "declined":
                    raise RuntimeError("payment declined")
                return {"status": 201}

            asked = asyncio_lab.requests(4, declined=[1])
            assert [r["card"] for r in asked] == ["ok", "declined", "ok", "ok"]
            answers = [await asyncio_lab.serve(dsn, handler, r) for r in asked]
            assert [a["status"] for a in answers] == [201, 402, 201, 201]

            flag: list[int] = []
            asyncio.get_running_loop().call_later(0.1, flag.append, 1)
            waited = await asyncio_lab.until(lambda: bool(flag))
            assert 0.05 < waited < 5
            with pytest.raises(TimeoutError):
                await asyncio_lab.until(lambda: False, timeout=0.1)

    asyncio.run(scenario())


def test_concurrency_table_models_one_job_per_io_per_handler() -> None:
    runs = {1: (None, 3.0, 2), 60: (None, 0.1, 1)}
    table = asyncio_lab.concurrency_table(runs, jobs=60, io=0.05)  # type: ignore[arg-type]
    assert table.loc[1, "jobs/s"] == 20 and table.loc[60, "jobs/s"] == pytest.approx(600)
    assert table.loc[1, "model: jobs/s"] == 20 and table.loc[60, "model: jobs/s"] == 1200
    assert list(table.sessions) == [2, 1]


@pytest.mark.parametrize("face", ["Worker", "AsyncWorker"])
def test_run_face_drains_the_jobs_and_places_tells_where_they_ran(dsn: str, face: str) -> None:
    async def scenario() -> list[tuple[str, str, str, str]]:
        loop = asyncio.get_running_loop()
        ran: list[tuple[str, str, str, str]] = []
        tasks = Tasks(dsn)

        @tasks.task(queue="faces")
        def plain(job: object) -> None:
            ran.append((face, "plain", *engine_lab.place(loop)))

        for _ in range(3):
            plain.enqueue()
        await engine_lab.run_face(face, tasks, dsn, jobs=3, concurrency=2, name="faces")
        tasks.close()
        return ran

    ran = asyncio.run(scenario())
    assert len(ran) == 3
    where = engine_lab.places(ran)
    assert list(where.loc[face, "plain"]) == ["pgqueue-faces.N", "none"]
    with pytest.raises(ValueError):
        asyncio.run(engine_lab.run_face("neither", Tasks(dsn), dsn, jobs=0))
