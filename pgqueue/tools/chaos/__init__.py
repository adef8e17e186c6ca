"""``pgqueue chaos``: the workload, its worker processes, the faults, the checks and the run."""

from __future__ import annotations

# The names this package had as one module. Workers start as
# ``pgqueue worker pgqueue.tools.chaos:handler`` (or ``:async_handler``), so both must stay
# importable here.
from .checks import Report, summary
from .faults import KINDS, MAX_GAP, MIN_GAP, WARMUP, Fault, min_duration, plan, stop_hold
from .run import KINDS_OF_WORKER, Config, main, run
from .workers import APP_PREFIX, REAP_INTERVAL
from .workload import SIDE_TABLES, WORKER_ENV, async_handler, handler

__all__ = [
    "APP_PREFIX",
    "KINDS",
    "KINDS_OF_WORKER",
    "MAX_GAP",
    "MIN_GAP",
    "REAP_INTERVAL",
    "SIDE_TABLES",
    "WARMUP",
    "WORKER_ENV",
    "Config",
    "Fault",
    "Report",
    "async_handler",
    "handler",
    "main",
    "min_duration",
    "plan",
    "run",
    "stop_hold",
    "summary",
]
