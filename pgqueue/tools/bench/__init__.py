"""``pgqueue bench``: one module per benchmark, on a shared runner, report, plots and cli."""

from ...events import NullEventLog
from .claim_size import bench_claim, claim_sizes
from .cli import BENCHMARKS, default_out, main, run
from .drain import (
    PGBENCH_SCRIPT,
    DrainConfig,
    bench_drain,
    drain_configs,
    drain_measured,
    drain_once,
    hand_loop,
    pgbench_drain,
)
from .enqueue import bench_enqueue, enqueue_once
from .limits import LimitCase, bench_limits, limit_cases
from .peers import PEER_SETTINGS, PEERS, bench_peers
from .plots import figures
from .polling import bench_polling, idle_qps, latency_run, polling_intervals
from .report import (
    CLAIM_COLUMNS,
    DRAIN_COLUMNS,
    ENQUEUE_COLUMNS,
    LIMIT_COLUMNS,
    PEERS_COLUMNS,
    POLLING_COLUMNS,
    SUMMARY_COLUMNS,
    machine,
    summarize,
    table,
    write_csv,
)
from .runner import QUEUE, Bench, bench_server, prefill
from .runner import _percentile as _percentile

__all__ = [
    "BENCHMARKS",
    "CLAIM_COLUMNS",
    "DRAIN_COLUMNS",
    "ENQUEUE_COLUMNS",
    "LIMIT_COLUMNS",
    "PEERS",
    "PEERS_COLUMNS",
    "PEER_SETTINGS",
    "PGBENCH_SCRIPT",
    "POLLING_COLUMNS",
    "QUEUE",
    "SUMMARY_COLUMNS",
    "Bench",
    "DrainConfig",
    "LimitCase",
    "NullEventLog",
    "bench_claim",
    "bench_drain",
    "bench_enqueue",
    "bench_limits",
    "bench_peers",
    "bench_polling",
    "bench_server",
    "claim_sizes",
    "default_out",
    "drain_configs",
    "drain_measured",
    "drain_once",
    "enqueue_once",
    "figures",
    "hand_loop",
    "idle_qps",
    "latency_run",
    "limit_cases",
    "machine",
    "main",
    "pgbench_drain",
    "polling_intervals",
    "prefill",
    "run",
    "summarize",
    "table",
    "write_csv",
]
