"""The chaos run's worker processes: started, watched, replaced and stopped by PID only.

Each worker slot runs one real ``pgqueue worker`` process at a time, in a process group
of its own so signals reach only it: a threaded Worker, or an AsyncWorker (``async``
runs, and every other slot of ``mixed`` ones, give it the coroutine handler). A process
that exits without being killed on purpose is logged as an unexpected exit and replaced;
a stopped one is resumed when its hold is over.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .workload import WORKER_ENV, Session

APP_PREFIX = "pgqueue worker "  # Worker.app_name: how a worker's sessions are found
REAP_INTERVAL = 1.0  # the workers' --reap-interval
HANDLERS = {"threads": "pgqueue.tools.chaos:handler", "async": "pgqueue.tools.chaos:async_handler"}


def slot_kind(kind: str, index: int) -> str:
    """Which worker slot ``index`` runs: 'threads' or 'async' (``mixed``: odd slots async)."""
    if kind == "mixed":
        return "async" if index % 2 else "threads"
    return kind


def worker_command(queue: str, lease: float, name: str, kind: str = "threads") -> list[str]:
    """The real CLI worker; the DSN travels in the environment, not in ``ps``."""
    script = Path(sys.executable).with_name("pgqueue")
    base = (
        [str(script)]
        if script.exists()
        else [
            sys.executable,
            "-c",
            "import sys; from pgqueue.cli import main; sys.exit(main())",
        ]
    )
    return [
        *base,
        "worker",
        HANDLERS[kind],
        "--queue",
        queue,
        "--lease",
        str(lease),
        "--poll",
        "0.5",
        "--reap-interval",
        str(REAP_INTERVAL),
        "--backoff",
        "0.05",
        "--name",
        name,
    ]


def read_log(path: Path) -> str:
    """A worker's log, whatever bytes it holds."""
    return path.read_text(encoding="utf-8", errors="replace")


def _tail(path: Path) -> str:
    lines = [line for line in read_log(path).splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


@dataclass
class Slot:
    """One worker's place: its current process and that process's name."""

    index: int
    generation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    name: str = ""


class Workers:
    """The worker processes of one run: owns every process it starts."""

    def __init__(
        self,
        count: int,
        queue: str,
        lease: float,
        log_dir: Path,
        session: Session,
        say: Callable[[str], None],
        kind: str = "threads",
    ) -> None:
        self.queue = queue
        self.kind = kind  # threads, async or mixed
        self.lease = lease
        self.log_dir = log_dir
        self.session = session  # the controller's session; the workers use its DSN
        self.say = say
        self.slots = [Slot(i) for i in range(count)]
        self.started: list[subprocess.Popen[bytes]] = []  # every process, for cleanup
        self.killed: set[int] = set()  # PIDs we SIGKILLed on purpose
        self.stopped: dict[int, float] = {}  # PID -> monotonic time to SIGCONT
        self.unexpected_exits: list[str] = []

    def spawn(self, slot: Slot) -> None:
        """Start the next worker process of ``slot`` in a process group of its own."""
        slot.generation += 1
        slot.name = f"chaos-{slot.index}.{slot.generation}"
        env = {**os.environ, "PGQUEUE_DSN": self.session.dsn, WORKER_ENV: slot.name}
        env.pop("DATABASE_URL", None)
        with open(self.log_dir / f"{slot.name}.log", "wb") as log:
            slot.proc = subprocess.Popen(
                worker_command(self.queue, self.lease, slot.name, slot_kind(self.kind, slot.index)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: signals reach only it
            )
        self.started.append(slot.proc)

    def wait_for_sessions(self, timeout: float) -> None:
        """Wait until every awake worker has a session open (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            names = {
                APP_PREFIX + s.name
                for s in self.slots
                if s.proc and s.proc.poll() is None and s.proc.pid not in self.stopped
            }
            seen = {
                r[0]
                for r in self.session.sql(
                    "SELECT DISTINCT application_name FROM pg_stat_activity "
                    "WHERE application_name = ANY(%s)",
                    [list(names)],
                )
            }
            if names <= seen:
                return
            self.tend(0.2)

    # -- signals, by PID only ------------------------------------------------------------
    @staticmethod
    def signal(proc: subprocess.Popen[bytes], sig: int) -> bool:
        """Send ``sig`` to the process group of ``proc`` if it has not been reaped."""
        if proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
            return True
        return False

    def tend(self, seconds: float) -> None:
        """Sleep, resuming stopped workers when due and replacing any that exited."""
        until = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            for proc in [p for p in self.started if p.pid in self.stopped]:
                if now >= self.stopped[proc.pid]:
                    self.signal(proc, signal.SIGCONT)
                    del self.stopped[proc.pid]
            for slot in self.slots:
                if slot.proc and slot.proc.poll() is not None and slot.proc.pid not in self.killed:
                    tail = _tail(self.log_dir / f"{slot.name}.log")
                    self.unexpected_exits.append(
                        f"{slot.name} exited with {slot.proc.returncode}: {tail}"
                    )
                    self.say(f"  ! {slot.name} exited by itself ({slot.proc.returncode}); replaced")
                    self.spawn(slot)
            if now >= until:
                return
            time.sleep(min(0.1, until - now))

    # -- the end -------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM every worker (a graceful stop), then SIGKILL any that linger."""
        for slot in self.slots:
            if slot.proc:
                self.killed.add(slot.proc.pid)  # exits from here on are ours
                self.signal(slot.proc, signal.SIGCONT)
                self.signal(slot.proc, signal.SIGTERM)
        for slot in self.slots:
            if slot.proc:
                try:
                    slot.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.signal(slot.proc, signal.SIGKILL)
                    slot.proc.wait()

    def kill_all(self) -> None:
        """Kill every process this run started that is still alive."""
        for proc in self.started:
            self.signal(proc, signal.SIGCONT)
            self.signal(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
