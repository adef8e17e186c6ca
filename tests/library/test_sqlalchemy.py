"""SQLAlchemy applications enqueue in their own transaction: ``conn=`` takes a SQLAlchemy
``Connection`` or ``Session`` (and the asyncio ones) on psycopg 3, through a real engine
from a ``postgresql+psycopg://`` URL, and refuses one on another driver in one line."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import pgqueue
from conftest import rows
from pgqueue import AsyncQueue, BadInput, Queue


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str]


def url(dsn: str) -> sa.URL:
    """The test database as a ``postgresql+psycopg://`` URL (its libpq keywords as query)."""
    return sa.URL.create("postgresql+psycopg", query=conninfo_to_dict(dsn))


@pytest.fixture
def engine(dsn: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(url(dsn))
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


def orders_and_jobs(dsn: str) -> tuple[list[tuple], list[tuple]]:
    return (
        rows(dsn, "SELECT id, item FROM orders ORDER BY id"),
        rows(dsn, "SELECT queue, payload FROM jobs ORDER BY id"),
    )


def test_a_committed_session_keeps_its_row_and_its_job(engine: sa.Engine, queue: Queue, dsn: str):
    with Session(engine) as session:
        session.add(Order(id=1, item="book"))
        session.flush()
        job_id = queue.enqueue({"order": 1}, queue="invoices", conn=session)
        assert rows(dsn, "SELECT count(*) FROM jobs") == [(0,)]  # not committed yet
        session.commit()
    assert orders_and_jobs(dsn) == ([(1, "book")], [("invoices", {"order": 1})])
    assert queue.get(job_id).status == "ready"  # type: ignore[union-attr]


def test_a_rolled_back_session_leaves_neither(engine: sa.Engine, queue: Queue, dsn: str) -> None:
    with Session(engine) as session:
        session.add(Order(id=1, item="book"))
        session.flush()
        queue.enqueue({"order": 1}, queue="invoices", conn=session)
        queue.enqueue_many([{"order": 1, "n": n} for n in range(3)], queue="mails", conn=session)
        session.rollback()
    with Session(engine) as session:  # never committed: closing rolls back too
        queue.enqueue({"order": 2}, queue="invoices", conn=session)
    assert orders_and_jobs(dsn) == ([], [])


def test_a_session_that_has_not_begun_is_begun_by_the_enqueue(
    engine: sa.Engine, queue: Queue, dsn: str
) -> None:
    with Session(engine) as session:
        queue.enqueue({"first": True}, conn=session)  # before any statement of the session
        session.add(Order(id=7, item="pen"))
        session.commit()
    assert orders_and_jobs(dsn) == ([(7, "pen")], [("default", {"first": True})])


def test_a_core_connection_commits_or_rolls_back_with_the_job(
    engine: sa.Engine, queue: Queue, dsn: str
) -> None:
    orders = Order.__table__
    with engine.connect() as conn:
        queue.enqueue({"n": 1}, conn=conn)  # nothing begun yet: the enqueue begins it,
        conn.commit()  # so this commit has a transaction to commit
        conn.execute(orders.insert().values(id=2, item="b"))
        queue.enqueue_many([{"n": 2}, {"n": 3}], conn=conn, keys=["k2", None])
        conn.rollback()
    with engine.begin() as conn:
        conn.execute(orders.insert().values(id=1, item="a"))
        queue.enqueue({"n": 4}, conn=conn)
    assert orders_and_jobs(dsn) == ([(1, "a")], [("default", {"n": 1}), ("default", {"n": 4})])


def test_a_task_configured_with_a_session_joins_it(engine: sa.Engine, dsn: str) -> None:
    tasks = pgqueue.Tasks(dsn)

    @tasks.task(queue="emails")
    def send(job: pgqueue.Job, to: str) -> None: ...

    with Session(engine) as session:
        send.configure(conn=session).enqueue(to="a@example.com")  # type: ignore[arg-type]
        session.rollback()
    with Session(engine) as session:
        send.configure(conn=session).enqueue(to="b@example.com")  # type: ignore[arg-type]
        session.commit()
    assert rows(dsn, "SELECT payload->'kwargs'->>'to' FROM jobs") == [("b@example.com",)]


def test_an_async_session_joins_its_transaction(dsn: str) -> None:
    async def main() -> None:
        engine = create_async_engine(url(dsn))
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with AsyncQueue(dsn) as q:
            async with AsyncSession(engine) as session:
                session.add(Order(id=1, item="kept"))
                await session.flush()
                await q.enqueue({"order": 1}, conn=session)
                await session.commit()
            async with AsyncSession(engine) as session:
                session.add(Order(id=2, item="dropped"))
                await q.enqueue_many([{"order": 2}, {"order": 3}], conn=session)
                await session.rollback()
            async with engine.connect() as conn:
                await q.enqueue({"order": 4}, conn=conn)
                await conn.commit()
        await engine.dispose()

    asyncio.run(main())
    assert orders_and_jobs(dsn) == (
        [(1, "kept")],
        [("default", {"order": 1}), ("default", {"order": 4})],
    )


def test_sqlalchemy_on_another_driver_or_no_connection_gets_one_line(
    queue: Queue, dsn: str
) -> None:
    sqlite = sa.create_engine("sqlite://")
    with sqlite.connect() as conn, pytest.raises(BadInput) as caught:
        queue.enqueue({}, conn=conn)
    message = str(caught.value)
    assert "'pysqlite' driver" in message and "postgresql+psycopg://" in message
    assert "\n" not in message
    with Session(sqlite) as session, pytest.raises(BadInput, match="'pysqlite' driver"):
        queue.enqueue_many([{}, {}], conn=session)
    with pytest.raises(BadInput, match=r"got builtins\.str"):
        queue.enqueue({}, conn=dsn)
    with pytest.raises(BadInput, match="SQLAlchemy AsyncConnection or AsyncSession"):
        asyncio.run(_async_enqueue(dsn, Session(sqlite)))  # a sync session given to asyncio
    assert rows(dsn, "SELECT count(*) FROM jobs") == [(0,)]


async def _async_enqueue(dsn: str, conn: object) -> None:
    async with AsyncQueue(dsn) as q:
        await q.enqueue({}, conn=conn)
