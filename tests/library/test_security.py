"""Security basics: the embedded server listens on a private unix socket only, names
reach SQL only through ``psycopg.sql.Identifier`` (values only as parameters), and
passwords never show in errors, CLI output or worker logs."""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql

from conftest import rows
from pgqueue import ConnectError, EmbeddedServer, connect, fenced_write, mask_dsn
from pgqueue.db import first_line
from pgqueue.server import PORT, SERVER_USER

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "pgqueue"
PGQUEUE = str(Path(sys.executable).with_name("pgqueue"))
SECRET = "S3cr3t-pgqueue-pw"


# -- the embedded server: unix socket only, private to its user --------------------------
@pytest.fixture
def embedded(server: EmbeddedServer | None) -> EmbeddedServer:
    if server is None:
        pytest.skip("PGQUEUE_DSN names an external server; nothing embedded to check")
    return server


def test_no_tcp_listener_is_configured(embedded: EmbeddedServer) -> None:
    with psycopg.connect(embedded.dsn(), autocommit=True) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
        assert conn.execute("SELECT inet_server_addr()").fetchone() == (None,)  # a socket


def _postmaster_pid(server: EmbeddedServer) -> int:
    return int((server.data / "postmaster.pid").read_text().splitlines()[0])


def _listening_inodes(table: str) -> dict[int, int]:
    """inode -> local port of every listening socket in /proc/net/<table>."""
    found = {}
    path = Path("/proc/net") / table
    if not path.exists():
        return found
    for line in path.read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # TCP_LISTEN
            found[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with_target = os.readlink(fd)
        if with_target.startswith("socket:["):
            inodes.add(int(with_target[8:-1]))
    return inodes


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_the_server_process_holds_no_tcp_socket(embedded: EmbeddedServer) -> None:
    """From the kernel's side: none of the postmaster's sockets is a TCP listener, and
    nothing at all listens on 127.0.0.1:<port> unless some other program does."""
    inodes = _socket_inodes(_postmaster_pid(embedded))
    assert inodes, "the postmaster should hold its unix socket"
    tcp = _listening_inodes("tcp") | _listening_inodes("tcp6")
    assert inodes.isdisjoint(tcp), "the embedded server listens on TCP"
    if PORT not in tcp.values():  # no other program on this port: a connect must fail
        with socket.socket() as probe, pytest.raises(OSError):
            probe.settimeout(2)
            probe.connect(("127.0.0.1", PORT))


def test_socket_dir_and_socket_are_private_to_the_server_user(embedded: EmbeddedServer) -> None:
    expected = os.getuid()
    if os.geteuid() == 0:
        import pwd

        expected = pwd.getpwnam(SERVER_USER).pw_uid
    for path in (embedded.socket_dir, embedded.data):
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700, path
        assert info.st_uid == expected, path
    sock = embedded.socket_dir / f".s.PGSQL.{PORT}"
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_socket(embedded: EmbeddedServer) -> None:
    """``nobody`` is stopped by the directory's mode before Postgres is even asked."""
    sock = embedded.socket_dir / f".s.PGSQL.{PORT}"
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n"
    )
    result = subprocess.run(
        ["/usr/bin/python3", "-c", probe, str(sock)],
        user="nobody",
        capture_output=True,
        timeout=30,
        cwd="/",
        check=False,
    )
    assert result.returncode == 13, result.stderr


def _server_processes(postmaster: int) -> list[int]:
    """The postmaster and its children (checkpointer, walwriter, backends, ...)."""
    found = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{postmaster}\n" in status:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: only root runs the server as another user"
)
def test_the_server_runs_without_root_groups(embedded: EmbeddedServer) -> None:
    """Started by root, the server has its user's own group: not gid 0, none of root's
    supplementary groups."""
    import pwd

    entry = pwd.getpwnam(SERVER_USER)
    with psycopg.connect(embedded.dsn(), autocommit=True) as conn:  # a backend too
        conn.execute("SELECT 1")
        pids = _server_processes(_postmaster_pid(embedded))
        assert len(pids) > 1
        for pid in pids:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
            uids = fields["Uid"].split()
            gids = fields["Gid"].split()
            groups = fields["Groups"].split()
            assert set(uids) == {str(entry.pw_uid)}, (pid, uids)
            assert set(gids) == {str(entry.pw_gid)}, (pid, gids)
            assert "0" not in groups and set(groups) <= {str(entry.pw_gid)}, (pid, groups)


@pytest.fixture
def fresh_server() -> EmbeddedServer:
    """A never-initialised server of its own (stopped and removed afterwards)."""
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="pgqueue-sec-"))
    home.chmod(0o755)  # as root the server runs as another user, who must reach it
    server = EmbeddedServer(home, durable=False)
    yield server
    server.stop()
    shutil.rmtree(home, ignore_errors=True)


def _effective(conf: str, name: str) -> str | None:
    """The value the last uncommented ``name = value`` line of a postgresql.conf sets."""
    value = None
    for line in conf.splitlines():
        found = re.match(rf"\s*{name}\s*=\s*('(?:[^']|'')*'|[^\s#]*)", line)
        if found:
            value = found.group(1)
    return value


def test_initdb_writes_a_config_without_tcp(
    fresh_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster initdb leaves on disk already listens on no TCP address: nothing is
    appended afterwards (an interrupted first start would have left TCP + trust)."""
    seen: dict[str, str] = {}
    run = fresh_server._run

    def spy(program: str, *args: str, **kwargs: object) -> subprocess.CompletedProcess:
        result = run(program, *args, **kwargs)  # type: ignore[arg-type]
        if program == "initdb":
            seen["conf"] = (fresh_server.data / "postgresql.conf").read_text()
            seen["hba"] = (fresh_server.data / "pg_hba.conf").read_text()
        return result

    monkeypatch.setattr(fresh_server, "_run", spy)
    fresh_server.start()
    assert _effective(seen["conf"], "listen_addresses") == "''"
    assert _effective(seen["conf"], "unix_socket_permissions") == "0700"
    for line in seen["hba"].splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and fields[0].startswith("host"):
            assert fields[-1] == "reject", line


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_a_config_asking_for_tcp_still_gets_none(fresh_server: EmbeddedServer) -> None:
    """Whatever postgresql.conf says (edited by hand, left half-written), the server is
    started with listen_addresses='' on its command line."""
    fresh_server.start()
    fresh_server.stop()
    with open(fresh_server.data / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write("listen_addresses = '127.0.0.1'\n")
    fresh_server.start()
    with psycopg.connect(fresh_server.dsn(), autocommit=True) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
    tcp = _listening_inodes("tcp") | _listening_inodes("tcp6")
    assert _socket_inodes(_postmaster_pid(fresh_server)).isdisjoint(tcp)


# -- identifiers through psycopg.sql.Identifier, values as parameters ---------------------
def _tables(dsn: str) -> set[str]:
    return {r[0] for r in rows(dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}


@pytest.fixture
def reports(dsn: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("CREATE TABLE reports (id int PRIMARY KEY, body text, fence bigint)")
    yield conn
    conn.close()


hostile_names = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00."), min_size=1, max_size=80
)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(name=hostile_names, where=st.sampled_from(["table", "key", "value"]))
@example(name="reports; DROP TABLE jobs; --", where="table")
@example(name='reports" (id) VALUES (1, 1); DROP TABLE jobs; --', where="table")
@example(name='id" = 1 OR "1"="1', where="key")
@example(name="body = 'x', fence = 999 --", where="value")
@example(name="%", where="table")  # once a ProgrammingError: '%' read as a placeholder
@example(name="%(fence)s", where="key")
def test_a_hostile_name_is_a_missing_name_not_an_injection(
    dsn: str, reports: psycopg.Connection, name: str, where: str
) -> None:
    """Names are quoted: a hostile one names a table or column that does not exist."""
    tables = _tables(dsn)
    table, key, values = "reports", {"id": 1}, {"body": "x"}
    if where == "table":
        table = name
    elif where == "key":
        key = {name: 1}
    else:
        values = {name: "x"}
    if name in ("reports", "id", "body", "fence"):
        return  # real names: not hostile
    with pytest.raises((psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
        fenced_write(reports, table, key, values, fence=7)
    assert _tables(dsn) == tables
    assert rows(dsn, "SELECT count(*) FROM reports") == [(0,)]


def test_a_strange_but_real_name_works(dsn: str) -> None:
    """Quoting is right, not just refusing: a table and columns named like attacks."""
    # '%' once broke the statement: psycopg took it for a placeholder.
    table, key, col = 'my "reports"; 100% --', "i'd %(k0)s", "bo dy; %s"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} ({} int PRIMARY KEY, {} text, fence bigint)").format(
                sql.Identifier(table), sql.Identifier(key), sql.Identifier(col)
            )
        )
        assert fenced_write(conn, table, {key: 1}, {col: "v1"}, fence=1)
        assert not fenced_write(conn, table, {key: 1}, {col: "stale"}, fence=1)
        stored = conn.execute(
            sql.SQL("SELECT {} FROM {}").format(sql.Identifier(col), sql.Identifier(table))
        )
        assert stored.fetchall() == [("v1",)]


SQL_TEXT = re.compile(
    r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\S+\s+SET|DELETE\s+FROM|WHERE\s+\S+\s*=|"
    r"CREATE\s+(TABLE|DATABASE|INDEX)|DROP\s+(TABLE|DATABASE)|ALTER\s+TABLE|TRUNCATE\s)",
    re.DOTALL,
)


def _literal_text(node: ast.AST) -> str:
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant))
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""


def test_no_sql_is_built_by_string_formatting() -> None:
    """No f-string, ``%`` or ``+`` or ``str.format`` builds SQL anywhere in the library:
    statements live in sql/*.sql or are psycopg.sql compositions with Identifier."""
    offenders = []
    for path in sorted(LIBRARY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            text = ""
            if isinstance(node, ast.JoinedStr):
                text = _literal_text(node)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
                text = _literal_text(node.left) + _literal_text(node.right)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "format"
            ):
                text = _literal_text(node.func.value)
            if text and SQL_TEXT.search(text):
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert offenders == []


def test_the_checker_catches_string_formatted_sql() -> None:
    """The check above is not vacuous: it flags each way of formatting SQL."""
    for bad in (
        'f"SELECT * FROM jobs WHERE id = {job_id}"',
        "\"UPDATE jobs SET status = '%s'\" % status",
        '"DELETE FROM jobs WHERE queue = " + name',
        '"INSERT INTO {} VALUES (1)".format(table)',
    ):
        node = ast.parse(bad).body[0].value  # type: ignore[attr-defined]
        if isinstance(node, ast.BinOp):
            text = _literal_text(node.left) + _literal_text(node.right)
        elif isinstance(node, ast.Call):
            text = _literal_text(node.func.value)  # type: ignore[attr-defined]
        else:
            text = _literal_text(node)
        assert SQL_TEXT.search(text), bad


# -- no credentials in errors, CLI output or logs -----------------------------------------
passwords = st.text(
    st.characters(exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp")), min_size=1, max_size=20
).map(lambda s: SECRET + s)


@settings(max_examples=40, deadline=None, database=None)
@given(password=passwords, form=st.sampled_from(["kv", "kv-malformed", "url", "url-raw", "query"]))
@example(password=SECRET + " two words", form="kv-malformed")
@example(password=SECRET + "@with@ats", form="url-raw")
def test_a_password_never_shows_in_connect_errors(password: str, form: str) -> None:
    host = "/nonexistent-pgqueue-dir"
    quoted = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    dsn = {
        "kv": f"host={host} user=u password={quoted}",
        "kv-malformed": f"host={host} password={quoted} oops",
        "url": f"postgresql://u:{quote(password, safe='')}@/db?host={host}",
        "url-raw": f"postgresql://u:{password}@/db?host={host}",
        "query": f"postgresql:///db?host={host}&password={quote(password, safe='')}",
    }[form]
    with pytest.raises(ConnectError) as info:
        connect(dsn)
    message = str(info.value)
    assert SECRET not in message and quote(SECRET) not in message, message
    assert SECRET not in mask_dsn(dsn)
    assert "\n" not in message


def test_first_line_masks_passwords_in_any_error_text() -> None:
    text = first_line(Exception(f"x password='{SECRET} y' z postgresql://u:{SECRET}@h/d\nmore"))
    assert SECRET not in text


def test_cli_errors_mask_the_password() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PGQUEUE_DSN", "DATABASE_URL")}
    for dsn in (
        f"host=/nonexistent-pgqueue-dir password={SECRET}",
        f"postgresql://u:{SECRET}@/db?host=/nonexistent-pgqueue-dir",
        f"password='{SECRET} x' broken",
    ):
        for args in (["--dsn", dsn, "stats"], ["worker", "tests.handlers:noop"]):
            run_env = env if args[0] == "--dsn" else env | {"PGQUEUE_DSN": dsn}
            result = subprocess.run(
                [PGQUEUE, *args],
                capture_output=True,
                text=True,
                env=run_env,
                cwd=ROOT,
                timeout=60,
                check=False,
            )
            assert result.returncode in (1, 2), result
            assert SECRET not in result.stdout + result.stderr
            assert "Traceback" not in result.stderr


def test_worker_logs_mask_the_password_while_reconnecting(admin_dsn: str, dsn: str) -> None:
    """A worker whose database disappears logs its reconnect attempts: with ***."""
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["PGQUEUE_DSN"] = f"{dsn} password={SECRET}"  # trust auth ignores it; logs must not
    proc = subprocess.Popen(
        [PGQUEUE, "worker", "tests.handlers:noop", "--name", "leaky", "--poll", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not rows(
            admin_dsn,
            "SELECT 1 FROM pg_stat_activity WHERE application_name = 'pgqueue worker leaky'",
        ):
            time.sleep(0.1)
        dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(str(dbname)))
            )
        time.sleep(1.5)  # a few failed reconnects, each logged
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert "cannot connect" in err or "reconnecting" in err, err
    assert SECRET not in out + err
    assert "password=***" in err
