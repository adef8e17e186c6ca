"""install() changes only what is missing (issue #19, item 5).

On a current table it reads the catalog and takes no lock on jobs, so an open application
transaction cannot make it queue the fleet behind it; the NOTIFY choice is kept; an upgrade
adds columns and the status check (NOT VALID) in one brief transaction under a lock timeout,
then validates the check and builds indexes CONCURRENTLY while claims go on; a lock it
cannot get within ``lock_timeout`` is a one-line ``InstallBlocked`` naming the holder.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conftest import rows
from pgqueue import AsyncQueue, InstallBlocked, PgQueueError, Queue
from pgqueue.install import Installation

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
# Locks that stop claims, heartbeats or completions (ROW EXCLUSIVE) or queue them.
STOPS_WRITES = {"ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"}

# The first release's schema (git show e709a3a:pgqueue/sql/schema.sql), trigger included.
FIRST_RELEASE = """
CREATE TABLE jobs (
  id bigserial PRIMARY KEY, queue text NOT NULL, payload jsonb NOT NULL,
  status text NOT NULL DEFAULT 'ready', run_at timestamptz NOT NULL DEFAULT now(),
  attempts int NOT NULL DEFAULT 0, max_attempts int NOT NULL DEFAULT 5,
  lease_until timestamptz, fence bigint NOT NULL DEFAULT 0, last_error text
);
CREATE INDEX jobs_ready_idx ON jobs (queue, run_at) WHERE status = 'ready';
CREATE INDEX jobs_lease_idx ON jobs (lease_until) WHERE status = 'running';
CREATE TABLE jobs_archive (LIKE jobs);
CREATE OR REPLACE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('pgqueue', q.queue) FROM (SELECT DISTINCT queue FROM new_jobs) AS q;
  RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER jobs_notify_insert
  AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_notify();
INSERT INTO jobs (queue, payload, status, run_at)
  SELECT 'q', jsonb_build_object('n', n), CASE WHEN n % 3 = 0 THEN 'done' ELSE 'ready' END,
         now() - make_interval(secs => 1000 - n)
  FROM generate_series(1, 1000) AS n;
"""
# The ready index as every release before the one with priorities had it.
OLD_READY_INDEX = """
DROP INDEX jobs_ready_idx;
CREATE INDEX jobs_ready_idx ON jobs (queue, run_at) WHERE status = 'ready';
"""
INDEXES = {"jobs_ready_idx", "jobs_lease_idx", "jobs_dead_idx", "jobs_key_idx", "jobs_slot_idx"}


def with_lock_timeout(dsn: str, seconds: int = 3) -> str:
    """The DSN with a lock timeout on every statement: a test that would queue behind a
    lock fails with LockNotAvailable instead of hanging."""
    return make_conninfo(dsn, options=f"-c lock_timeout={seconds}s")


def triggers(dsn: str) -> int:
    return rows(dsn, "SELECT count(*) FROM pg_trigger WHERE tgname = 'jobs_notify_insert'")[0][0]


def indexes(dsn: str) -> dict[str, tuple[bool, str]]:
    """Every index on jobs: name -> (valid, definition)."""
    found = rows(
        dsn,
        "SELECT c.relname, i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'jobs'::regclass",
    )
    return {name: (valid, definition) for name, valid, definition in found}


def status_check_validated(dsn: str) -> list[tuple[bool]]:
    return rows(
        dsn,
        "SELECT convalidated FROM pg_constraint "
        "WHERE conrelid = 'jobs'::regclass AND conname = 'jobs_status_check'",
    )


def locks_on_jobs(dsn: str, pid: int) -> set[str]:
    """The modes of every lock ``pid`` holds or waits for on jobs."""
    found = rows(
        dsn,
        "SELECT mode FROM pg_locks WHERE pid = %s AND relation = 'jobs'::regclass",
        [pid],
    )
    return {mode for (mode,) in found}


def wait_until(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def waiting_on_a_lock(dsn: str, pid: int) -> bool:
    found = rows(dsn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
    return found == [("Lock",)]


@pytest.fixture
def reader(dsn: str) -> Iterator[psycopg.Connection]:
    """An application's transaction left open after reading jobs (ACCESS SHARE held)."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1 FROM jobs LIMIT 1")
        yield conn


def the_fleet_goes_on(dsn: str) -> None:
    """An enqueue, a claim, a heartbeat and a completion, none waiting for a lock."""
    with Queue(with_lock_timeout(dsn)) as q:
        q.enqueue({"fleet": True}, queue="fleet")
        [job] = q.claim("fleet")
        assert q.heartbeat(job)
        assert q.complete(job)


# -- (a) a current table: nothing to change, no lock on jobs ------------------------------
def test_install_on_a_current_table_takes_no_lock_behind_an_open_transaction(
    dsn: str, reader: psycopg.Connection
) -> None:
    # The installer's own transaction stays open after install(), so every lock install
    # took is still in pg_locks. (Before: ALTER TABLE ... ADD COLUMN IF NOT EXISTS queued
    # for ACCESS EXCLUSIVE behind the reader: LockNotAvailable here.)
    with psycopg.connect(with_lock_timeout(dsn)) as installer:
        installer.execute("SELECT 1")
        done = Queue(installer).install()
        assert done == Installation(changed=[], notify=True)
        assert locks_on_jobs(dsn, installer.info.backend_pid) == set()
        the_fleet_goes_on(dsn)  # while the installer's and the reader's transactions are open
    with Queue(with_lock_timeout(dsn)) as q:  # autocommit, as `pgqueue init` runs it
        assert q.install().changed == []


def test_async_install_on_a_current_table_takes_no_lock(
    dsn: str, reader: psycopg.Connection
) -> None:
    async def run() -> tuple[Installation, set[str]]:
        async with await psycopg.AsyncConnection.connect(with_lock_timeout(dsn)) as installer:
            await installer.execute("SELECT 1")
            done = await AsyncQueue(installer).install()
            return done, locks_on_jobs(dsn, installer.info.backend_pid)

    done, held = asyncio.run(run())
    assert done == Installation(changed=[], notify=True)
    assert held == set()


# -- (b) the NOTIFY choice is kept -----------------------------------------------------------
def test_a_plain_install_keeps_notify_off(queue: Queue, dsn: str) -> None:
    off, plain = queue.install(notify=False), queue.install()
    assert triggers(dsn) == 0  # before: the plain install put the trigger back
    assert off == Installation(["dropped the NOTIFY trigger"], notify=False)
    assert plain == Installation([], notify=False)
    on, plain = queue.install(notify=True), queue.install()
    assert triggers(dsn) == 1
    assert on == Installation(["created the NOTIFY trigger"], notify=True)
    assert plain == Installation([], notify=True)


def test_a_new_table_gets_notify_unless_told_not_to(empty_dsn: str, admin_dsn: str) -> None:
    with Queue(empty_dsn) as q:
        assert not q.install(notify=False).notify
        assert triggers(empty_dsn) == 0
        q.enqueue({}, queue="q")  # a table without the trigger works all the same
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE jobs, jobs_archive")
    with Queue(empty_dsn) as q:
        assert q.install().notify
        assert triggers(empty_dsn) == 1


def test_async_install_keeps_notify_off(dsn: str) -> None:
    async def run() -> list[Installation]:
        async with AsyncQueue(dsn) as q:
            return [await q.install(notify=False), await q.install()]

    done = asyncio.run(run())
    assert triggers(dsn) == 0
    assert [d.notify for d in done] == [False, False]


def test_cli_init_keeps_no_notify(dsn: str) -> None:
    def init(*flags: str) -> str:
        result = subprocess.run(
            [PGQUEUE, "--dsn", dsn, "init", *flags], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert "no NOTIFY" in init("--no-notify")
    assert "no NOTIFY" in init()
    assert triggers(dsn) == 0
    assert "no NOTIFY" not in init("--notify")
    assert triggers(dsn) == 1


# -- (c) an upgrade: brief DDL, then CONCURRENTLY and VALIDATE -----------------------------
def test_an_upgrade_of_a_first_release_table_with_rows(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE)
        conn.execute("SET lock_timeout = '17s'")
        done = Queue(conn).install()
        # The session's own setting is back once install is done.
        assert conn.execute("SHOW lock_timeout").fetchone() == ("17s",)
    assert done.notify  # the first release's trigger stays
    assert done.changed[:3] == [
        "added columns to jobs (finished_at, group_key, key, priority, result, slot, "
        "started_at, traceback)",
        "added the status check (NOT VALID)",
        "added columns to jobs_archive",
    ]
    assert "validated the status check" in done.changed
    assert "built jobs_ready_idx concurrently" in done.changed
    assert "built jobs_key_idx concurrently" in done.changed
    assert status_check_validated(empty_dsn) == [(True,)]
    found = indexes(empty_dsn)
    assert set(found) == INDEXES | {"jobs_pkey"}  # the old ready index set aside is gone
    assert all(valid for valid, _ in found.values())
    assert "(queue, priority DESC, run_at, id)" in found["jobs_ready_idx"][1]
    with Queue(empty_dsn) as q:
        assert q.install().changed == []
        [job] = q.claim("q")
        assert job.payload == {"n": 1}  # the oldest ready row, through the new index
        assert q.complete(job)
        assert q.prune(0, archive=True) == 334  # the archive gained the new columns too
    assert rows(empty_dsn, "SELECT count(*) FROM jobs") == [(666,)]


def test_async_upgrade_of_a_first_release_table(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE)

    async def run() -> tuple[Installation, Installation, object]:
        async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as conn:
            q = AsyncQueue(conn)
            done, again = await q.install(), await q.install()
            return done, again, await (await conn.execute("SHOW lock_timeout")).fetchone()

    done, again, setting = asyncio.run(run())
    assert "built jobs_ready_idx concurrently" in done.changed
    assert "validated the status check" in done.changed
    assert again == Installation([], notify=True)
    assert setting == ("0",)  # the session's own lock timeout is back
    assert status_check_validated(empty_dsn) == [(True,)]
    assert all(valid for valid, _ in indexes(empty_dsn).values())


def test_an_index_upgrade_lets_claims_and_completions_go_on(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(OLD_READY_INDEX)
    # A producer's transaction, open, has inserted a job: the index build must wait for
    # it. CREATE INDEX CONCURRENTLY waits without stopping writes; a plain CREATE INDEX (or
    # the old ALTER TABLE) would queue for its lock, and every enqueue behind it.
    with psycopg.connect(dsn) as producer:
        producer.execute("INSERT INTO jobs (queue, payload) VALUES ('late', '{}')")
        installer = psycopg.connect(dsn, autocommit=True)
        pid = installer.info.backend_pid
        result: list[Installation | BaseException] = []

        def install() -> None:
            try:
                result.append(Queue(installer).install(lock_timeout=120))
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=install)
        thread.start()
        try:
            wait_until(lambda: waiting_on_a_lock(dsn, pid), "install to wait for the producer")
            assert locks_on_jobs(dsn, pid) & STOPS_WRITES == set()
            the_fleet_goes_on(dsn)
        finally:
            producer.commit()
            thread.join(60)
            installer.close()
    [done] = result
    assert isinstance(done, Installation), done
    assert done.changed == [
        "set jobs_ready_idx aside as jobs_ready_idx_old",
        "built jobs_ready_idx concurrently",
        "dropped jobs_ready_idx_old, which jobs_ready_idx replaced",
    ]
    found = indexes(dsn)
    assert set(found) == INDEXES | {"jobs_pkey"}
    assert found["jobs_ready_idx"][0] and "priority DESC" in found["jobs_ready_idx"][1]


def test_an_invalid_index_left_by_an_interrupted_build_is_built_again(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX jobs_ready_idx")
        conn.execute("INSERT INTO jobs (queue, payload) VALUES ('q', '{}'), ('q', '{}')")
        with pytest.raises(psycopg.errors.UniqueViolation):  # a build that failed midway
            conn.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY jobs_ready_idx ON jobs (queue) "
                "WHERE status = 'ready'"
            )
    assert indexes(dsn)["jobs_ready_idx"][0] is False
    with Queue(dsn) as q:
        assert q.install().changed == [
            "dropped jobs_ready_idx, left INVALID by an interrupted build",
            "built jobs_ready_idx concurrently",
        ]
    valid, definition = indexes(dsn)["jobs_ready_idx"]
    assert valid and "(queue, priority DESC, run_at, id)" in definition


def test_an_upgrade_needs_a_connection_outside_a_transaction(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(OLD_READY_INDEX)
    with psycopg.connect(dsn) as conn, pytest.raises(PgQueueError, match="autocommit") as info:
        Queue(conn).install()
    assert "\n" not in str(info.value)


def test_rows_that_fail_the_status_check_get_a_one_line_error(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE)
        conn.execute("UPDATE jobs SET status = 'lost' WHERE id = 1")
    with Queue(empty_dsn) as q, pytest.raises(PgQueueError, match="status is not") as info:
        q.install()
    assert "\n" not in str(info.value)
    assert status_check_validated(empty_dsn) == [(False,)]  # checked from now on


# -- (d) a lock it cannot get: a one-line error, nothing half-done -------------------------
def test_an_install_behind_a_conflicting_lock_gives_up_in_one_line(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE)
    with psycopg.connect(empty_dsn) as reader:
        reader.execute("SELECT 1 FROM jobs LIMIT 1")
        with Queue(empty_dsn) as q, pytest.raises(InstallBlocked) as info:
            q.install(lock_timeout=0.5)
        message = str(info.value)
        assert "\n" not in message
        assert f"pid {reader.info.backend_pid} (idle in transaction" in message
        assert "before it added columns to jobs" in message
        assert "run install again when that transaction ends" in message
        columns = rows(
            empty_dsn,
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'jobs'::regclass AND "
            "attname = 'priority'",
        )
        assert columns == [(0,)]  # the brief steps are one transaction: none was made
        assert rows(empty_dsn, "SELECT count(*) FROM jobs WHERE status = 'ready'") == [(667,)]
    with Queue(empty_dsn) as q:
        assert "validated the status check" in q.install().changed


def test_an_index_build_behind_an_open_transaction_gives_up_and_resumes(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(OLD_READY_INDEX)
    with psycopg.connect(dsn) as producer:
        producer.execute("INSERT INTO jobs (queue, payload) VALUES ('late', '{}')")
        with Queue(dsn) as q, pytest.raises(InstallBlocked, match="built jobs_ready") as info:
            q.install(lock_timeout=0.5)
        assert f"pid {producer.info.backend_pid}" in str(info.value)
    found = indexes(dsn)  # the old index still serves claims; the new one is INVALID
    assert found["jobs_ready_idx_old"][0] and not found["jobs_ready_idx"][0]
    with Queue(dsn) as q:
        assert q.install().changed == [
            "dropped jobs_ready_idx, left INVALID by an interrupted build",
            "built jobs_ready_idx concurrently",
            "dropped jobs_ready_idx_old, which jobs_ready_idx replaced",
        ]
    assert set(indexes(dsn)) == INDEXES | {"jobs_pkey"}


def test_async_install_gives_up_after_the_default_lock_timeout(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE)

    async def run() -> None:
        # statement_timeout only keeps the old code (no lock timeout) from hanging here.
        async with AsyncQueue(make_conninfo(empty_dsn, options="-c statement_timeout=60s")) as q:
            await q.install()

    with psycopg.connect(empty_dsn) as reader:
        reader.execute("SELECT 1 FROM jobs LIMIT 1")
        with pytest.raises(InstallBlocked, match="waited 5 s for a lock"):
            asyncio.run(run())


def test_lock_timeout_is_checked(queue: Queue) -> None:
    for bad in (0, -1, float("nan"), True, "5"):
        with pytest.raises(PgQueueError, match="lock_timeout is seconds"):
            queue.install(lock_timeout=bad)  # type: ignore[arg-type]
