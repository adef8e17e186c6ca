"""``python manage.py pgqueue_worker [--queue Q ...] [--concurrency N] [--processes N]
[--burst]``: run the tasks of a ``pgqueue.contrib.django.TaskBackend`` with pgqueue's
worker (leases, heartbeats, the reaper, fencing and retries). Django is set up once per
process; each task runs on a lane thread, with Django's connections closed between tasks
the way Django's request cycle closes them. ``--processes N`` starts N such processes under
one supervisor (restarted if one dies; Ctrl-C stops them all)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, task_backends
from django.tasks.exceptions import InvalidTaskBackend

from pgqueue.errors import BadInput, PgQueueError
from pgqueue.supervisor import Supervisor, restart_limits
from pgqueue.worker import Worker

from ...backend import TaskBackend
from ...runner import Runner, worker_id

# A child process: the parent's sys.path, then Django's command line (DJANGO_SETTINGS_MODULE
# comes with the environment).
_CHILD = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[2:]])"
)


class Command(BaseCommand):
    help = "Run the tasks of a pgqueue.contrib.django.TaskBackend (Ctrl-C stops gracefully)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            help="a queue to run, in preference order (repeat it; default: the QUEUES)",
        )
        parser.add_argument("--concurrency", type=int, default=1, help="tasks at once")
        parser.add_argument("--processes", type=int, default=1, help="worker processes")
        parser.add_argument("--burst", action="store_true", help="stop when no task is left")
        parser.add_argument(
            "--backend", default=DEFAULT_TASK_BACKEND_ALIAS, help="the TASKS alias to run"
        )
        parser.add_argument("--name", default="django", help="the worker's name")

    def handle(self, *args: Any, **o: Any) -> None:
        try:
            backend = task_backends[o["backend"]]
        except InvalidTaskBackend as exc:
            raise CommandError(str(exc), returncode=2) from None
        if not isinstance(backend, TaskBackend):
            raise CommandError(
                f"TASKS[{o['backend']!r}] is {type(backend).__name__}, not "
                "pgqueue.contrib.django.TaskBackend: nothing for pgqueue_worker to run",
                returncode=2,
            )
        queues = o["queues"] or sorted(backend.queues) or ["default"]
        _log_to_stderr()
        if o["processes"] != 1:
            self._supervise(queues, o)
            return
        s = backend.settings
        try:
            worker = Worker(
                Runner(worker_id(o["name"])),
                queue=queues,
                dsn=backend.dsn,
                concurrency=o["concurrency"],
                lease=s.lease,
                backoff=s.backoff,
                timeout=s.timeout,
                burst=o["burst"],
                name=o["name"],
                record_events=False,
            )
        except BadInput as exc:
            raise CommandError(str(exc), returncode=2) from None
        try:
            worker.run()
        except PgQueueError as exc:
            raise CommandError(str(exc)) from None

    def _supervise(self, queues: list[str], o: dict[str, Any]) -> None:
        argv = [arg for q in queues for arg in ("--queue", q)]
        argv += ["--concurrency", str(o["concurrency"]), "--backend", o["backend"]]
        argv += ["--burst"] if o["burst"] else []
        try:
            DjangoSupervisor(
                argv, o["processes"], name=o["name"], burst=o["burst"], **restart_limits()
            ).run()
        except BadInput as exc:
            raise CommandError(str(exc), returncode=2) from None
        except PgQueueError as exc:
            raise CommandError(str(exc)) from None


class DjangoSupervisor(Supervisor):
    """pgqueue's supervisor, whose children are ``manage.py pgqueue_worker`` processes."""

    def command(self, slot: int) -> list[str]:
        return [
            sys.executable,
            "-c",
            _CHILD,
            json.dumps(sys.path),
            "pgqueue_worker",
            *self.argv,
            "--name",
            self.child_name(slot),
        ]


def _log_to_stderr() -> None:
    """The worker's lines (start, failures, stops) on stderr, unless LOGGING handles them."""
    logger = logging.getLogger("pgqueue")
    real = [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if real or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
