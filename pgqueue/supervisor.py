"""``Supervisor``: ``pgqueue worker --processes N``, N worker processes under one parent.

Threads share one GIL, so a handler doing pure-Python work gets no faster with more
``--concurrency``; processes do. Each child is the same ``pgqueue worker`` command line
(run as ``python -m pgqueue``, so it works without the console script on PATH) without
``--processes`` and with ``--name NAME.p1``, ``NAME.p2``, ...: a threaded ``Worker`` with its
own connections, leases and fences, exactly like a worker started by hand. The supervisor
only starts, watches and signals them; the children's output goes straight to its own.

Signals. Ctrl-C in a terminal sends SIGINT to the whole foreground process group, and a
``Worker`` takes a second SIGINT as "stop now, without waiting for the handlers". So each
child runs in a session (and process group) of its own, out of the terminal's reach, and
hears signals only from the supervisor: exactly one SIGINT or SIGTERM per signal the
supervisor receives. The first one stops the children gracefully (running handlers finish
within the grace period); a second one forces them. SIGHUP (the terminal closed) is
forwarded as SIGTERM. On Linux, a child also gets SIGTERM if the supervisor itself dies
(SIGKILL, the OOM killer), so none is left orphaned.

Restarts. A child that exits while the supervisor is not stopping is restarted, with one
line saying which child and how it ended; more than ``max_restarts`` exits within
``window`` seconds stop the rest and end the run with exit code 1. A child that exits 2
refused its command line (a bad handler path, say), which a restart would not change: the
run ends with exit code 2. With ``burst``, a child that exits 0 found the queue dry and is
not restarted; the run ends when all have.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, TypedDict

from .errors import BadInput, PgQueueError

# What the children get for each signal the supervisor handles.
FORWARDED = {
    signal.SIGINT: signal.SIGINT,
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGHUP: signal.SIGTERM,
}
_TICK = 0.05  # seconds between looks at the children
_PR_SET_PDEATHSIG = 1


class Supervisor:
    """Run ``processes`` copies of ``pgqueue <argv>``, restart one that dies, forward signals.

    ``argv`` is a ``pgqueue`` command line without the program name and without
    ``--processes`` (see ``child_argv``); each child gets ``--name {name}.p{i}`` added.
    ``grace`` is the children's own grace period (``Worker.run``'s, 10 s): a child still
    running ``grace`` + 5 s after the first stop signal is killed. ``run()`` blocks.
    """

    def __init__(
        self,
        argv: Sequence[str],
        processes: int,
        *,
        name: str,
        burst: bool = False,
        max_restarts: int = 5,
        window: float = 60.0,
        grace: float = 10.0,
    ) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise BadInput(f"processes must be a whole number >= 1, got {processes!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise BadInput(f"max_restarts must be a whole number >= 0, got {max_restarts!r}")
        for what, value in (("window", window), ("grace", grace)):
            if not isinstance(value, int | float) or not 0 <= value < 1e6:
                raise BadInput(f"{what} must be a number of seconds >= 0, got {value!r}")
        self.argv = list(argv)
        self.processes = processes
        self.name = name
        self.burst = burst
        self.max_restarts = max_restarts
        self.window = float(window)
        self.grace = float(grace)
        self.children: dict[int, subprocess.Popen[bytes]] = {}  # slot -> the running child
        self._pending: list[int] = []  # signals received, not yet forwarded
        self._stopping = False
        self._kill_at: float | None = None  # when stragglers get SIGKILL
        self._killed = 0
        self._exits: collections.deque[float] = collections.deque()  # unplanned, in the window
        self._failure: PgQueueError | None = None

    def command(self, slot: int) -> list[str]:
        """The command line of child ``slot`` (1-based)."""
        return [sys.executable, "-m", "pgqueue", *self.argv, "--name", self.child_name(slot)]

    def child_name(self, slot: int) -> str:
        return f"{self.name}.p{slot}"

    def run(self) -> int:
        """Start the children and supervise them until they have all ended. Returns 0 after
        a stop by signal (or, with ``burst``, when every child found the queue dry); raises
        ``PgQueueError`` (exit code 1) or ``BadInput`` (2) with a one-line reason otherwise."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            for slot in range(1, self.processes + 1):
                self._start(slot)
            started = ", ".join(
                f"{self.child_name(s)} pid {p.pid}" for s, p in self.children.items()
            )
            self._say(f"{self.processes} worker processes ({started}); Ctrl-C stops them")
            self._supervise()
        finally:
            if self.children:  # only after an exception (a start that failed, say)
                self._pending.append(signal.SIGTERM)
                self._supervise()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._failure is not None:
            raise self._failure
        if self._killed:
            raise PgQueueError(
                f"killed {self._killed} worker process(es) still running "
                f"{self.grace + 5:g} s after the stop signal"
            )
        return 0

    def _supervise(self) -> None:
        """Until every child has ended: forward signals, restart, kill stragglers."""
        while self.children:
            self._forward()
            self._look()
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_stragglers()
            time.sleep(_TICK)

    # -- signals -----------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append(signum)  # forwarded by the loop, never halfway through a start

    def _forward(self) -> None:
        """Send each child one signal per signal received; the first one starts the stop."""
        while self._pending:
            received = self._pending.pop(0)
            sent = FORWARDED[signal.Signals(received)]
            if not self._stopping:
                self._say(f"{signal.Signals(received).name}: stopping the workers (again to force)")
                self._stop()
            for proc in self.children.values():
                proc.send_signal(sent)  # a no-op once it has exited

    def _stop(self) -> None:
        self._stopping = True
        self._kill_at = time.monotonic() + self.grace + 5

    def _kill_stragglers(self) -> None:
        for slot, proc in self.children.items():
            if proc.poll() is None:
                self._say(f"{self.child_name(slot)} (pid {proc.pid}) did not stop: killing it")
                proc.kill()
                self._killed += 1
        self._kill_at = None

    # -- children ----------------------------------------------------------------------
    def _start(self, slot: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            self.command(slot),
            start_new_session=True,  # out of the terminal's process group: see the docstring
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
        self.children[slot] = proc
        return proc

    def _look(self) -> None:
        """Deal with each child that has exited: restart it, or not."""
        for slot, proc in list(self.children.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.children[slot]
            if self._stopping or (self.burst and code == 0):
                continue
            name, how = self.child_name(slot), _how(code)
            if code == 2:
                self._give_up(
                    BadInput(f"{name} refused its command line ({how}); see its output above")
                )
                continue
            now = time.monotonic()
            self._exits.append(now)
            while self._exits[0] < now - self.window:
                self._exits.popleft()
            if len(self._exits) > self.max_restarts:
                self._give_up(
                    PgQueueError(
                        f"children keep dying: {len(self._exits)} exits in {self.window:g} s, "
                        f"the last {name} ({how}); see their output above"
                    )
                )
                continue
            new = self._start(slot)
            self._say(f"{name} (pid {proc.pid}) {how}; restarting it (pid {new.pid})")

    def _give_up(self, failure: PgQueueError) -> None:
        self._failure = failure
        self._stop()
        for proc in self.children.values():
            proc.send_signal(signal.SIGTERM)

    def _say(self, text: str) -> None:
        print(f"{self.name}: {text}", file=sys.stderr, flush=True)


class RestartLimits(TypedDict):
    max_restarts: int
    window: float


def restart_limits() -> RestartLimits:
    """``PGQUEUE_MAX_RESTARTS`` exits within ``PGQUEUE_RESTART_WINDOW`` seconds, else 5 in 60."""
    return RestartLimits(
        max_restarts=int(_env_number("PGQUEUE_MAX_RESTARTS", 5)),
        window=_env_number("PGQUEUE_RESTART_WINDOW", 60.0),
    )


def _env_number(variable: str, default: float) -> float:
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e6:
        raise BadInput(f"{variable} must be a number >= 0, got {text!r}")
    return value


def child_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--processes N`` / ``--processes=N`` (or an abbreviation argparse
    accepted, such as ``--proc 4``): a child must never supervise children of its own."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        option, equals, _ = arg.partition("=")
        if len(option) >= 4 and "--processes".startswith(option):
            skip = not equals  # the value is the next argument
            continue
        out.append(arg)
    return out


def _how(code: int) -> str:
    """How a child ended, from its exit status (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# Linux: ask the kernel to send a child SIGTERM when its parent dies (libc is loaded here,
# once: between fork and exec the child only makes the call).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent(parent: int) -> None:
    """``preexec_fn``: a child of a supervisor killed outright stops gracefully as well."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the call took effect
            os.kill(os.getpid(), signal.SIGTERM)
