"""Smoke runs of ``pgqueue.tools.bench``: tiny sizes, asserting only sane, non-empty results
(never timings), so the benchmark code cannot rot."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgqueue.tools import bench
from pgqueue.tools.bench import Bench, DrainConfig


@pytest.fixture
def small(admin_dsn: str) -> Iterator[Bench]:
    """A Bench on the test server, with the databases it makes dropped afterwards."""
    b = Bench(admin_dsn, quick=True, repeats=1, progress=False)
    yield b
    b.cleanup()


def test_drain_runs_every_system_and_finishes_every_job(small: Bench) -> None:
    configs = [
        DrainConfig("pgqueue", 2, 10, "batched"),
        DrainConfig("pgqueue-no-events", 1, 5, "per-job"),
        DrainConfig("hand-loop", 2, 10, "per-job"),
        DrainConfig("pgbench", 2, 10, "batched"),
    ]
    samples: dict[DrainConfig, list[float]] = {}
    rows = bench.bench_drain(small, n_jobs=200, configs=configs, repeats=1, samples=samples)
    assert [(r["system"], r["completion"]) for r in rows] == [
        (c.system, c.completion) for c in configs
    ]
    for row in rows:  # drain_once itself checks that all 200 jobs ended done
        assert row["runs"] == 1 and row["n_jobs"] == 200
        assert 0 < row["jobs_per_s_min"] <= row["jobs_per_s_median"] <= row["jobs_per_s_max"]
    assert all(len(v) == 1 and v[0] > 0 for v in samples.values())


def test_targets_are_ratios_within_one_repetition() -> None:
    worker = DrainConfig("pgqueue", 4, 10, "batched")
    hand = DrainConfig("hand-loop", 4, 10, "batched")
    limit = DrainConfig("pgbench", 4, 10, "batched")
    samples = {worker: [90.0, 50.0, 95.0], hand: [100.0, 50.0, 100.0], limit: [200.0] * 3}
    targets = {t["target"]: t for t in bench.summarize(samples, None, None, None, None)}
    versus_hand = targets["Worker vs hand-written loop, c=4 b=10 batched"]
    assert versus_hand["measured"] == 0.95 and versus_hand["met"] == "yes"
    assert targets["drain c=4 b=10 batched vs pgbench, same SQL"]["met"] == "no"


def test_enqueue_compares_enqueue_many_with_copy(small: Bench) -> None:
    rows = bench.bench_enqueue(small, n_jobs=300, single_jobs=20, repeats=1)
    methods = {r["method"]: r for r in rows}
    assert set(methods) == {"enqueue_many", "copy", "enqueue"}
    assert methods["copy"]["ratio_to_copy"] == 1.0
    assert methods["enqueue_many"]["ratio_to_copy"] > 0
    assert all(r["jobs_per_s_median"] > 0 for r in rows)


def test_csv_has_the_columns_notebooks_read(tmp_path: Path) -> None:
    row = {c: 1 for c in bench.DRAIN_COLUMNS}
    info = {"cores": 2, "postgres": "18.0"}
    path = bench.write_csv(tmp_path / "d.csv", [row], bench.DRAIN_COLUMNS, info)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == [*bench.DRAIN_COLUMNS, "cores", "postgres"]
        assert [r["postgres"] for r in reader] == ["18.0"]
    for required in [
        "system",
        "concurrency",
        "batch",
        "completion",
        "jobs_per_s_median",
        "jobs_per_s_min",
        "jobs_per_s_max",
        "runs",
        "n_jobs",
    ]:
        assert required in bench.DRAIN_COLUMNS
    for required in [
        "poll_interval_s",
        "listen",
        "jobs_per_s",
        "latency_p50_ms",
        "latency_p95_ms",
        "latency_p99_ms",
        "idle_qps",
    ]:
        assert required in bench.POLLING_COLUMNS


def test_machine_description_names_no_paths(admin_dsn: str) -> None:
    info = bench.machine(admin_dsn)
    assert info["cores"] and info["postgres"] and info["fsync"] in ("on", "off")
    assert not any("/" in str(v) for v in info.values())


def test_percentile_and_table() -> None:
    assert bench._percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert bench._percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert math.isnan(bench._percentile([], 50))
    text = bench.table([{"a": 1, "b": 2.5}])
    assert text.splitlines()[0].split() == ["a", "b"]


@pytest.mark.slow
def test_polling_claim_and_peers_produce_rows(small: Bench) -> None:
    polling = bench.bench_polling(small, intervals=[0.05], rate=20, seconds=1, idle_seconds=1)
    assert len(polling) == 2 and {r["listen"] for r in polling} == {True, False}
    for row in polling:
        assert row["jobs"] > 0 and row["latency_p50_ms"] <= row["latency_p99_ms"]
        assert row["idle_qps"] > 0  # a 50 ms poll sends about 20 claims a second

    claim = bench.bench_claim(small, sizes=[0, 1_000], samples=20, churn=500)
    assert {(r["index"], r["done_rows"]) for r in claim if r["phase"] == "vacuumed"} == {
        (i, n) for i in ("partial", "full") for n in (0, 1_000)
    }
    churned = [r for r in claim if r["phase"] == "churned, not vacuumed"]
    assert churned and churned[0]["dead_tuples"] > 0
    assert all(r["samples"] > 0 and r["claim_ms_median"] > 0 for r in claim)

    peers = bench.bench_peers(small, n_jobs=50, single_jobs=10, chunk=20, repeats=1)
    drains = {r["system"]: r for r in peers if r["operation"] == "drain"}
    assert drains["pgqueue"]["jobs_per_s_median"] > 0
    for system in ("procrastinate", "pgqueuer"):
        row = drains.get(system)
        # A peer that is not installed (no `bench` extra) is reported, not fatal.
        assert row is None or row["jobs_per_s_median"] > 0 or row["note"]
