"""Smoke runs of ``pgqueue.tools.bench``: tiny sizes, asserting only sane, non-empty results
(never timings), so the benchmark code cannot rot."""

from __future__ import annotations

import csv
import hashlib
import importlib
import math
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pgqueue.tools import bench
from pgqueue.tools.bench import Bench, DrainConfig
from pgqueue.tools.bench.cli_worker import bench_cli_worker, pgbench_script
from pgqueue.tools.bench.cpu import bench_cpu
from pgqueue.tools.bench.housekeeping import bench_housekeeping
from pgqueue.tools.bench.notify import bench_notify
from pgqueue.tools.bench.plots import stamp
from pgqueue.tools.bench.report import row_targets
from pgqueue.tools.bench.results import NOTIFY_VARIANTS, completion_rate, variant
from pgqueue.tools.bench.roundtrips import bench_roundtrips

ROOT = Path(__file__).resolve().parents[2]


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
    by_phase = {r["phase"]: r for r in claim if r["phase"] != "vacuumed"}
    # VACUUM removed the churn's dead versions, except while a session held the horizon
    assert by_phase["churned, vacuumed"]["dead_tuples"] < 500
    assert by_phase["churned, vacuumed, horizon held"]["dead_tuples"] >= 500
    assert all(r["samples"] > 0 and r["claim_ms_median"] > 0 for r in claim)

    peers = bench.bench_peers(small, n_jobs=50, single_jobs=10, chunk=20, repeats=1)
    drains = {r["system"]: r for r in peers if r["operation"] == "drain"}
    assert drains["pgqueue"]["jobs_per_s_median"] > 0
    for system in ("procrastinate", "pgqueuer"):
        row = drains.get(system)
        # A peer that is not installed (no `bench` extra) is reported, not fatal.
        assert row is None or row["jobs_per_s_median"] > 0 or row["note"]


# -- the benchmarks of the worker as users run it, and of housekeeping -----------------
def test_cli_worker_drains_with_the_cli_the_hand_loop_and_pgbench(small: Bench) -> None:
    rows = bench_cli_worker(small, n_jobs=200, repeats=1)
    assert [r["system"] for r in rows] == ["cli-worker", "worker-library", "hand-loop", "pgbench"]
    for row in rows:  # each run checks that all 200 jobs ended done
        assert (
            row["runs"] == 1 and row["jobs_per_s_median"] > 0 and row["wall_jobs_per_s_median"] > 0
        )
    cli = rows[0]
    assert cli["ratio_to_hand_loop"] > 0 and cli["ratio_to_pgbench"] > 0
    assert cli["startup_s_median"] > 0 and cli["empty_queue_s_median"] > 0
    assert "--concurrency 4 --batch 10" in cli["command"]


def test_pgbench_script_runs_the_worker_sql() -> None:
    script = pgbench_script(10)
    assert "ORDER BY priority DESC, run_at, id" in script and "started_at  = now()" in script
    assert "finished_at = now()" in script and "%(" not in script and "\\gset" in script


def test_cpu_runs_threads_and_processes(small: Bench) -> None:
    rows = bench_cpu(small, n_jobs=6, repeats=1, handler_ms=2)
    assert [r["config"] for r in rows] == ["threads-1", "threads-2", "processes-2"]
    assert all(r["jobs_per_s_median"] > 0 and r["ratio_to_threads_2"] > 0 for r in rows)


def test_roundtrip_variants_each_drain_every_job(small: Bench) -> None:
    rows = bench_roundtrips(small, grid=[(2, 5)], n_jobs=lambda b: 103, repeats=1)
    assert [r["variant"] for r in rows] == ["two-statements", "pipeline", "one-statement"]
    assert all(r["jobs_per_s_median"] > 0 for r in rows)
    assert rows[0]["ratio_to_two_statements"] == 1.0


def test_housekeeping_removes_the_same_rows_each_way(small: Bench) -> None:
    rows = {r["operation"]: r for r in bench_housekeeping(small, n_rows=5_000, repeats=1)}
    assert set(rows) == {"stats", "stats-exact", "prune", "delete", "archive-move", "archive-drop"}
    removed = {rows[op]["rows_affected"] for op in ("prune", "delete", "archive-move")}
    assert len(removed) == 1 and removed.pop() > 0
    assert rows["prune"]["transactions"] > 0 and rows["delete"]["transactions"] == 1
    assert all(r["seconds_median"] > 0 for op, r in rows.items() if op != "archive-drop")


def test_notify_compares_the_trigger_on_and_off(small: Bench) -> None:
    rows = bench_notify(small, producers=(1, 2), seconds=0.2, repeats=1)
    assert len(rows) == 8 and {r["trigger"] for r in rows} == {"on", "off"}
    assert all(r["jobs_per_s_median"] > 0 and r["ratio_off_to_on"] > 0 for r in rows)


def test_figures_are_drawn_from_every_csv(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    machine = {"date_utc": "2026-01-01 00:00", "cpu_model": "cpu", "cores": 2, "mode": "quick"}
    one = {"jobs_per_s_median": 2.0, "jobs_per_s_min": 1.0, "jobs_per_s_max": 3.0}
    wall = {f"wall_{k}": v for k, v in one.items()}
    ratios = [f"{c}ratio_to_{o}" for c in ("", "wall_") for o in ("hand_loop", "pgbench")]
    tables = {
        "cli_worker": [
            {"system": s, "n_jobs": 10, **one, **wall, **dict.fromkeys(ratios, 1.0)}
            for s in ("cli-worker", "worker-library", "hand-loop", "pgbench")
        ],
        "cpu": [{"config": c, "flags": "-c 1", "n_jobs": 5, **one, **wall} for c in ("a", "b")],
        "roundtrips": [
            {"variant": v, "concurrency": 4, "batch": 10, **one, "ratio_to_two_statements": 1.0}
            for v in ("two-statements", "pipeline")
        ],
        "housekeeping": [
            {
                "operation": op,
                "rows_in_table": 9,
                "rows_affected": 1,
                "seconds_median": 0.5,
                "longest_txn_s": 0.1,
            }
            for op in ("stats", "stats-exact", "prune", "delete")
        ],
        "notify": [
            {"method": "enqueue", "jobs_per_transaction": 1, "producers": p, "trigger": t, **one}
            for p in (1, 4)
            for t in ("on", "off")
        ],
    }
    for name, rows in tables.items():
        bench.write_csv(tmp_path / f"bench_{name}.csv", rows, list(rows[0]), machine)
    written = bench.figures(tmp_path)
    assert {p.name for p in written} == {f"bench_{n}.png" for n in tables}
    assert all(p.stat().st_size > 0 for p in written)
    assert "2026-01-01 00:00 UTC (quick run)" in stamp(tables["cpu"], machine, "cpu")


def test_row_targets_read_the_ratios_from_the_rows() -> None:
    cli = {"system": "cli-worker", "startup_s_median": 0.4, "exit_s_median": 0.5}
    for other in ("worker_library", "hand_loop", "pgbench"):
        for clock in ("", "wall_"):
            cli |= {f"{clock}ratio_to_{other}{s}": 0.8 for s in ("", "_min", "_max")}
    cpu = {
        "config": "processes-2",
        "handler_ms": 20,
        "ratio_to_threads_2": 1.8,
        "ratio_to_threads_2_min": 1.7,
        "ratio_to_threads_2_max": 1.9,
        "wall_ratio_to_threads_2": 1.5,
        "ratio_to_threads_1": 1.8,
    }
    targets = {t["target"]: t for t in row_targets({"cli_worker": [cli], "cpu": [cpu]})}
    assert targets["CLI worker c=4 b=10 vs hand-written loop"]["met"] == "no"
    assert targets["CLI worker c=4 b=10 vs pgbench, same SQL"]["met"] == "yes"
    assert targets["CPU-bound: --processes 2 vs 2 threads"]["met"] == "yes"


# -- where a run writes: never into the committed data/ unless told ----------------------
def _digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_the_default_output_is_a_new_directory_outside_the_repository(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PGQUEUE_BENCH_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.chdir(ROOT)  # the worst case: run from the top of a checkout
    out = bench.default_out(datetime(2026, 12, 1, 9, 30, 5, tzinfo=timezone.utc))
    assert out == Path.home() / ".cache" / "pgqueue" / "bench" / "20261201T093005Z"
    assert not out.resolve().is_relative_to(ROOT)
    monkeypatch.setenv("PGQUEUE_BENCH_DIR", str(tmp_path / "mine"))
    assert bench.default_out().parent == tmp_path / "mine"


def test_a_run_without_out_leaves_data_alone_and_says_where_it_wrote(
    admin_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli = importlib.import_module("pgqueue.tools.bench.cli")
    real_run = cli.run
    # main() as `pgqueue bench` runs it, every step but the benchmarks themselves.
    monkeypatch.setattr(cli, "run", lambda b, only, out: real_run(b, (), out))
    monkeypatch.delenv("PGQUEUE_BENCH_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    before = _digest(ROOT / "data")
    assert cli.main(["--dsn", admin_dsn, "--no-progress"]) == 0
    assert _digest(ROOT / "data") == before
    runs = list((tmp_path / "cache" / "pgqueue" / "bench").iterdir())
    assert len(runs) == 1 and (runs[0] / "machine.json").is_file()
    assert f"wrote {runs[0].resolve()}" in capsys.readouterr().out


def test_limits_drains_every_case_and_compares_it_with_no_groups(small: Bench) -> None:
    cases = [
        bench.LimitCase("no groups", 0, None, concurrency=2, batch=5),
        bench.LimitCase("limit", 3, 1, concurrency=2, batch=5),
    ]
    rows = bench.bench_limits(small, n_jobs=120, cases=cases, repeats=1)
    assert [r["case"] for r in rows] == ["no groups", "limit"]  # each checks 120 jobs done
    assert rows[0]["ratio_to_no_groups"] == 1.0 and rows[1]["ratio_to_no_groups"] > 0
    assert all(r["jobs_per_s_median"] > 0 and r["client_cpu_us_per_job"] > 0 for r in rows)


def test_the_done_notify_cost_compares_the_same_completions_notifying_or_not(
    small: Bench,
) -> None:
    from pgqueue.statements import query

    for name in ("complete", "complete_many"):
        shipped = query(name)
        assert variant(shipped, "waited-for only") == shipped
        assert "EXISTS" in shipped and "EXISTS" not in variant(shipped, "every job")
        assert "pg_notify" in variant(shipped, "every job")
        assert "pg_notify" not in variant(shipped, "none")
    dsn = small.database("smoke_done_notify")
    for notify in NOTIFY_VARIANTS:  # each run checks that every job ended done, once
        for batch in (1, 7):
            assert completion_rate(dsn, notify=notify, threads=2, batch=batch, jobs=60) > 0


def test_drivers_measures_each_driver_and_the_hop(small: Bench) -> None:
    from pgqueue.tools.bench.drivers import ASYNC, HOP, SYNC, THREAD, bench_drivers

    rows = bench_drivers(small, n_jobs=100, batch=10)
    assert [r["system"] for r in rows] == [SYNC, ASYNC, THREAD, HOP]
    for row in rows:
        assert row["runs"] == 1
        assert (
            0 < row["client_cpu_us_min"] <= row["client_cpu_us_median"] <= row["client_cpu_us_max"]
        )
    assert rows[0]["cpu_ratio_to_sync"] == 1.0
    assert all(r["per"] == "job" and r["jobs_per_s_median"] > 0 for r in rows[:3])


def test_the_quick_look_runs_fewer_limit_cases_than_the_full_run() -> None:
    # The limit bench ignored --quick: its eight cases were a fifth of `bench --quick`.
    quick, full = bench.limit_cases(quick=True), bench.limit_cases()
    assert 0 < len(quick) < len(full)
    assert {c.case for c in quick} == {c.case for c in full}  # every case, at one batch


def test_a_run_says_how_long_the_full_run_takes() -> None:
    from pgqueue.tools.bench.cli import FULL_TAKES, how_long

    assert FULL_TAKES in how_long(quick=True) and "without --quick" in how_long(quick=True)
    assert how_long(quick=True, took=97.4).startswith("quick look took 97 s")
    assert "--quick takes" in how_long(quick=False, took=900)
