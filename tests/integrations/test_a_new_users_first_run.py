"""The first ten minutes of a new user (issue 22): a script's worker says what it does, the
stats of a small fresh table give a number, the demo tells its story, and the course's
Jupyter settings open trusted notebooks without a news pop-up."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from test_browser import (
    CHROMIUM,
    CHROMIUM_FLAGS,
    Lab,
    _free_port,
    _stop,
    _unavailable,
    _wait_until_serving,
)

from conftest import rows
from pgqueue import EmbeddedServer, Queue

ROOT = Path(__file__).resolve().parents[2]
PGQUEUE = str(Path(sys.executable).parent / "pgqueue")


def run_script(code: str, dsn: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a stand-alone script with PGQUEUE_DSN=dsn, as a README reader would."""
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"PGQUEUE_DSN": dsn}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def execute(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement)  # type: ignore[arg-type]


# -- a worker in a script that configured no logging ----------------------------------------

SYNC_WORKER = """
    import pgqueue

    q = pgqueue.Queue()
    q.enqueue({"n": 1}, queue="first", max_attempts=1)
    q.enqueue({"n": 2}, queue="first")

    def handle(job):
        if job.payload["n"] == 1:
            raise ValueError("no such customer")

    {setup}
    pgqueue.Worker(handle, queue="first", burst=True, name="w1").run()
"""

ASYNC_WORKER = """
    import asyncio
    import pgqueue

    q = pgqueue.Queue()
    q.enqueue({"n": 1}, queue="first", max_attempts=1)
    q.enqueue({"n": 2}, queue="first")

    async def handle(job):
        if job.payload["n"] == 1:
            raise ValueError("no such customer")

    {setup}
    asyncio.run(pgqueue.AsyncWorker(handle, queue="first", burst=True, name="w1").run())
"""


@pytest.mark.parametrize("script", [SYNC_WORKER, ASYNC_WORKER], ids=["Worker", "AsyncWorker"])
def test_run_prints_its_first_and_last_lines_and_each_failure_without_logging_setup(
    script: str, dsn: str, tmp_path: Path
) -> None:
    result = run_script(script.replace("{setup}", ""), dsn, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, result.stderr
    assert "w1: " in lines[0] and "queues first" in lines[0] and "lease 30s" in lines[0]
    assert (
        "job 1 (first) failed, attempt 1 of 1: ValueError: no such customer; now dead" in (lines[1])
    )
    assert lines[2].endswith(
        "w1: 1 done, 1 failed attempts (1 now dead, 0 timed out), 0 late writes refused"
    )
    assert result.stdout == ""  # stdout stays the application's
    assert rows(dsn, "SELECT status FROM jobs ORDER BY id") == [("dead",), ("done",)]


@pytest.mark.parametrize("script", [SYNC_WORKER, ASYNC_WORKER], ids=["Worker", "AsyncWorker"])
def test_run_leaves_logging_to_an_application_that_configured_it(
    script: str, dsn: str, tmp_path: Path
) -> None:
    setup = "import logging, sys; logging.basicConfig(stream=sys.stdout, format='APP %(message)s')"
    result = run_script(script.replace("{setup}", setup), dsn, tmp_path)
    assert result.stderr == ""  # nothing of its own: the application's handler has it all
    lines = result.stdout.strip().splitlines()
    # basicConfig's WARNING level: the failed attempt, not the INFO banner and summary
    assert len(lines) == 1 and lines[0].startswith("APP w1: job 1 (first) failed"), lines


# -- pgqueue stats on a small table never analyzed ------------------------------------------


def test_stats_counts_the_finished_jobs_of_a_small_table_never_analyzed(
    queue: Queue, dsn: str
) -> None:
    assert rows(dsn, "SELECT reltuples FROM pg_class WHERE relname = 'jobs'") == [(-1.0,)]
    ids = queue.enqueue_many([{}] * 4, queue="q")
    for job in queue.claim("q", limit=2):
        queue.complete(job)
    queue.cancel(ids[3])
    [finished] = [r for r in queue.stats() if r["estimated"]]
    assert finished["status"] == "finished"
    assert finished["jobs"] == 3 and finished["counted"]
    result = subprocess.run(
        [PGQUEUE, "stats"], capture_output=True, text=True, env=os.environ | {"PGQUEUE_DSN": dsn}
    )
    assert result.returncode == 0, result.stderr
    assert "finished (done or cancelled), all queues, counted: 3" in result.stdout
    assert "unknown" not in result.stdout
    [finished] = [
        r
        for r in json.loads(
            subprocess.check_output(
                [PGQUEUE, "stats", "--json"], text=True, env=os.environ | {"PGQUEUE_DSN": dsn}
            )
        )
        if r["status"] == "finished"
    ]
    assert finished["jobs"] == 3 and finished["counted"]
    execute(dsn, "ANALYZE jobs")  # analyzed: the planner's estimate, as before
    [finished] = [r for r in queue.stats() if r["estimated"]]
    assert finished["jobs"] == 3 and not finished["counted"]


def test_stats_does_not_read_a_large_table_never_analyzed(queue: Queue, dsn: str) -> None:
    execute(dsn, "ALTER TABLE jobs SET (autovacuum_enabled = off)")  # stays never analyzed
    execute(
        dsn,
        "INSERT INTO jobs (queue, payload, status) SELECT 'big', "
        "jsonb_build_object('pad', repeat('x', 1500)), 'done' FROM generate_series(1, 6000)",
    )
    [(size,)] = rows(dsn, "SELECT pg_relation_size('jobs')")
    assert size > 8 * 1024 * 1024
    [finished] = [r for r in queue.stats() if r["estimated"]]
    assert finished["jobs"] is None and not finished["counted"]
    from pgqueue import statements

    explain = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + statements.query("stats_rows")
    plan = "\n".join(r[0] for r in rows(dsn, explain))
    assert "Seq Scan on jobs (never executed)" in plan, plan  # the table was not read


# -- pgqueue demo ----------------------------------------------------------------------------


def demo(env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PGQUEUE_DSN", "DATABASE_URL")}
    result = subprocess.run(
        [PGQUEUE, "demo"], capture_output=True, text=True, env=base | env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_demo_tells_the_lease_the_wake_up_and_how_to_stop_the_embedded_server(
    server: EmbeddedServer | None,
) -> None:
    if server is None:
        pytest.skip("PGQUEUE_DSN names the server: no embedded one to talk about")
    lines = demo({"PGQUEUE_HOME": str(server.home)})  # the embedded server, as found
    assert lines[1].startswith("lease 1 s: ")
    assert "A freezes for 2 s right after its claim" in lines[2]
    story = [line.split(maxsplit=2)[1:] for line in lines if line[:8].strip().endswith("s")]
    said = [f"{who} {what}" for who, what in story]
    lease_end = said.index("A (about now its lease on job 1 ends)")
    wake = said.index("A wakes up after 2 s, unaware")
    refused = said.index("A completes job 1 with fence 1: REFUSED (0 rows)")
    assert lease_end < wake < refused, said  # in causal order (B's takeover: whenever)
    assert "B claims job 1 and gets fence 2" in said
    assert lines[-2].startswith("The embedded PostgreSQL server is still running")
    on_path = shutil.which("pgqueue")  # else the command as the test ran it
    shown = "pgqueue" if on_path and Path(on_path).resolve() == Path(PGQUEUE) else PGQUEUE
    assert lines[-1] == f"Stop it with: {shown} server stop"
    assert server.is_running()  # said, not done: it still serves the course


@pytest.mark.slow
def test_demo_on_a_configured_server_says_nothing_about_stopping_it(dsn: str) -> None:
    lines = demo({"PGQUEUE_DSN": dsn})
    assert lines[-1].startswith("A woke up late")
    assert not any("server stop" in line for line in lines)


# -- the course's JupyterLab: no news pop-up, trusted notebooks -----------------------------


@dataclass
class PreparedLab:
    """JupyterLab after binder/prepare-lab, in directories of this module's own."""

    lab: Lab
    app_dir: Path
    data_dir: Path
    config_dir: Path
    prepared: str  # what prepare-lab printed
    before: dict[Path, bytes]  # the notebooks before it ran


@pytest.fixture(scope="module")
def prepared_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreparedLab]:
    """binder/prepare-lab (what `make course` and binder/postBuild run) into a JupyterLab
    application dir and a Jupyter data dir of its own, then a real JupyterLab on them with
    a learner's settings dir that is empty, serving a copy of the course."""
    tmp = tmp_path_factory.mktemp("lab")
    app_dir, data_dir = tmp / "lab-app", tmp / "jupyter-data"
    config_dir = tmp / "jupyter-config"  # where the server extension is turned on
    data_dir.mkdir()
    before = {nb: nb.read_bytes() for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "JUPYTERLAB_DIR": str(app_dir),
        "JUPYTER_DATA_DIR": str(data_dir),
        "JUPYTER_CONFIG_PATH": str(config_dir),
    }
    done = subprocess.run(
        ["binder/prepare-lab"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    shutil.copytree(ROOT / "notebooks", tmp / "course" / "notebooks")
    port, token = _free_port(), secrets.token_hex(16)
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--LabApp.app_settings_dir={app_dir / 'settings'}",
    ]  # fmt: skip
    if os.geteuid() == 0:
        command.append("--allow-root")
    lab_env = os.environ | {
        "JUPYTER_DATA_DIR": str(data_dir),  # where the trust went
        "JUPYTER_CONFIG_PATH": str(config_dir),  # where the extension was turned on
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "user-settings"),  # a learner's: empty
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
    }
    log = tmp / "jupyterlab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            command, cwd=tmp / "course", env=lab_env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    lab = Lab(f"http://127.0.0.1:{port}", token, log)
    try:
        _wait_until_serving(lab, server)
        yield PreparedLab(lab, app_dir, data_dir, config_dir, done.stdout, before)
    finally:
        _stop(lab, server)


@pytest.mark.slow
def test_prepare_lab_turns_the_news_off_and_trusts_the_notebooks(
    prepared_lab: PreparedLab,
) -> None:
    from nbformat import read
    from nbformat.sign import NotebookNotary

    assert prepared_lab.prepared.count("\n") == 1 and "news pop-up off" in prepared_lab.prepared
    notary = NotebookNotary(data_dir=str(prepared_lab.data_dir))
    for nb, content in prepared_lab.before.items():
        assert notary.check_signature(read(nb, as_version=4)), f"{nb.name} is not trusted"
        assert nb.read_bytes() == content  # trusted without changing the file
    installed = prepared_lab.app_dir / "settings" / "overrides.d" / "pgqueue-course.json"
    shipped = ROOT / "binder" / "jupyterlab-overrides.json"
    assert json.loads(installed.read_text()) == json.loads(shipped.read_text())
    lab = prepared_lab.lab
    request = urllib.request.Request(
        f"{lab.url}/lab/api/settings/@jupyterlab/apputils-extension:notification",
        headers={"Authorization": f"token {lab.token}"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        schema = json.load(response)["schema"]["properties"]
    assert schema["fetchNews"]["default"] == "false"  # JupyterLab asks nothing, shows none
    assert schema["checkForUpdates"]["default"] is False
    # The server extension that keeps lessons from opening marked unsaved (see
    # tests/integrations/test_browser.py) is turned on, and the server loaded it.
    turned_on = prepared_lab.config_dir / "jupyter_server_config.d" / "pgqueue-course.json"
    shipped = ROOT / "binder" / "jupyter-server-config.json"
    assert json.loads(turned_on.read_text()) == json.loads(shipped.read_text())
    assert "notebooks handed out by CourseContents" in lab.log.read_text()


NEWS_TOAST = ".Toastify__toast"  # JupyterLab's notifications ("...official Jupyter news?")
SLIDER = ".jp-Notebook .widget-slider"


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_first_notebook_page_has_no_pop_up_and_04_shows_its_sliders_unrun(
    prepared_lab: PreparedLab, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    lab, notebook = prepared_lab.lab, "notebooks/04-fencing-tokens.ipynb"
    screenshot = tmp_path / "04-unrun.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{lab.url}/lab/tree/{notebook}?token={lab.token}")
            # Nothing is run: the sliders come from the widget state saved in the notebook,
            # which JupyterLab renders only in a trusted one.
            page.locator(SLIDER).first.wait_for(timeout=90_000)
            page.wait_for_timeout(3000)  # the news question comes soon after start-up
            assert page.locator(NEWS_TOAST).all_inner_texts() == []
        finally:
            page.screenshot(path=str(screenshot))
            with capsys.disabled():
                print(f"\nscreenshot of {notebook}, unrun: {screenshot}")
            browser.close()
