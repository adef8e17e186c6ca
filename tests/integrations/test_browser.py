"""Notebooks in a real browser: JupyterLab in headless Chromium, run all cells.

Starts JupyterLab on a free loopback port with a random token, in a copy of the course
(JupyterLab autosaves what it runs, and the committed notebooks must not change), opens
a notebook in Debian's Chromium driven by Playwright, runs every cell and checks what a
reader would see: no errors, the figures drawn as images, the widget control rendered, and
a click on it re-running the experiment with a new picture. The click comes after Run All,
so after the notebook's clean-up cell has dropped its database: the widget must not depend
on it. Covered: the fencing notebook (04) and the failures notebook (05), one of those whose
widget once used the dropped database. The kernel inherits ``PGQUEUE_HOME`` from the test
run (see the top-level conftest.py).

Needs ``/usr/bin/chromium`` (Debian's ``chromium`` package; Playwright's own browser
download does not work everywhere). Without it the test is skipped, except under CI
(``CI`` set), where it fails. Deselect it with ``-m 'not browser'``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["notebooks/04-fencing-tokens.ipynb", "notebooks/06-failures-and-backoff.ipynb"]
BUTTON = "Run Interact"  # the interact_manual button that re-runs the experiment
CHROMIUM = Path("/usr/bin/chromium")
# Headless Chromium without a network: no background connections, no first-run work.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAB_START_TIMEOUT = 90.0  # seconds
RUN_TIMEOUT_MS = 150_000  # for all cells, and again for the widget's re-run

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _unavailable(reason: str) -> None:
    """Skip on a developer's machine; under CI a missing browser is a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this does not skip)")
    pytest.skip(reason)


@dataclass
class Lab:
    """A running JupyterLab: where it listens and the token that opens it."""

    url: str
    token: str
    log: Path


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """JupyterLab on a free loopback port, serving a copy of the course."""
    course = tmp_path / "course"
    for folder in ("notebooks", "data"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, course / folder)
    settings = tmp_path / "lab-settings"
    # No news or update checks: there is no network, and no toast over the screenshot.
    notification = settings / "@jupyterlab" / "apputils-extension" / "notification"
    notification.parent.mkdir(parents=True)
    notification.with_suffix(".jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    port, token = _free_port(), secrets.token_hex(16)
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp, to run commands
    ]  # fmt: skip
    if os.geteuid() == 0:
        command.append("--allow-root")
    # The course's server extension, turned on as binder/prepare-lab turns it on for
    # `make course` and Binder: its JSON in a jupyter_server_config.d on the config path.
    server_config = tmp_path / "jupyter-config" / "jupyter_server_config.d"
    server_config.mkdir(parents=True)
    shutil.copy(ROOT / "binder" / "jupyter-server-config.json", server_config / "pgqueue.json")
    env = os.environ | {
        "JUPYTER_CONFIG_PATH": str(server_config.parent),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
    }
    log = tmp_path / "jupyterlab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            command,
            cwd=course,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running = Lab(f"http://127.0.0.1:{port}", token, log)
    try:
        _wait_until_serving(running, server)
        yield running
    finally:
        _stop(running, server)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(lab: Lab, path: str, method: str = "GET") -> int:
    request = urllib.request.Request(
        f"{lab.url}{path}", method=method, headers={"Authorization": f"token {lab.token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def _wait_until_serving(lab: Lab, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + LAB_START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited ({server.returncode}):\n{lab.log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            if _api(lab, "/api/status") == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer in {LAB_START_TIMEOUT:.0f} s; log: {lab.log}")


def _stop(lab: Lab, server: subprocess.Popen) -> None:
    """Shut JupyterLab down with its kernels; kill what is left by process id."""
    kernels = _children(server.pid)  # kernels run in sessions of their own
    with contextlib.suppress(OSError):
        _api(lab, "/api/shutdown", method="POST")  # stops the kernels, then the server
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    for pid, started in kernels.items():
        if _start_time(pid) == started:  # still that kernel, not a reused process id
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> dict[int, str]:
    """Direct children of ``pid``, with their start times (from /proc; no extra dependency)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields and int(fields[1]) == pid:
            found[int(stat.parent.name)] = fields[19]
    return found


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return fields[19] if fields else None


def _stat_fields(stat: Path) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...; index 19 is the start time)."""
    try:
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ")".
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


# JavaScript run in the page, against JupyterLab's application object.
NOTEBOOK_OPEN = """path => {
    const widget = window.jupyterapp?.shell.currentWidget;
    return widget?.context?.path === path && widget.sessionContext !== undefined;
}"""
RUN_ALL = """async () => {
    const panel = window.jupyterapp.shell.currentWidget;
    await panel.context.ready;
    await panel.sessionContext.ready;
    return await window.jupyterapp.commands.execute('notebook:run-all-cells');
}"""
KERNEL_IDLE = """() => {
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel;
    return kernel?.status === 'idle';
}"""
# Errors, tracebacks and warnings: in the notebook model (cell outputs) and on the page
# (widget outputs, such as the interact's, live in widget models, not in the cells).
PROBLEMS = """() => {
    const problems = [];
    const bad = /Traceback|Error|Warning/;
    const cells = window.jupyterapp.shell.currentWidget.content.widgets;
    cells.forEach((cell, index) => {
        if (cell.model.type !== 'code') return;
        for (const out of cell.model.outputs.toJSON()) {
            if (out.output_type === 'error') {
                problems.push(`cell ${index}: ${out.ename}: ${out.evalue}`);
            } else if (out.output_type === 'stream' && out.name === 'stderr'
                       && bad.test(out.text)) {
                problems.push(`cell ${index} stderr: ${out.text.slice(0, 500)}`);
            }
        }
    });
    const shown = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]';
    for (const out of document.querySelectorAll(shown)) {
        if (bad.test(out.textContent)) problems.push(`shown: ${out.textContent.slice(-800)}`);
    }
    return problems;
}"""
# After the click: the widget's cell shows new pictures, or an error; null while waiting.
RERUN = """([label, before]) => {
    const button = [...document.querySelectorAll('button')]
        .find(b => b.textContent.trim() === label);
    const cell = button?.closest('.jp-Cell');
    if (!cell) return null;
    const shown = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]';
    const errors = [...cell.querySelectorAll(shown)].map(out => out.textContent)
        .filter(text => /Traceback|Error/.test(text));
    if (errors.length) return {errors: errors.map(text => text.slice(-1500))};
    const srcs = [...cell.querySelectorAll('.jp-OutputArea-output img')]
        .filter(img => img.complete && img.naturalWidth > 0).map(img => img.src);
    const redrawn = srcs.length > 0 && JSON.stringify(srcs) !== JSON.stringify(before);
    return redrawn ? {errors: [], images: srcs.length} : null;
}"""
IMAGES_SHOWN = (
    """els => els.filter(img => img.complete && img.naturalWidth > 0).map(img => img.src)"""
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: Path(path).stem[:2])
def test_notebook_runs_in_jupyterlab_in_chromium(
    notebook: str, lab: Lab, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is missing: pip install -e '.[dev]'")
    if not (ROOT / notebook).is_file():
        _unavailable(f"{notebook} is not in the repository yet")

    screenshot = tmp_path / f"{Path(notebook).stem}.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            page.goto(f"{lab.url}/lab/tree/{notebook}?token={lab.token}")
            page.wait_for_function(NOTEBOOK_OPEN, arg=notebook)
            # Resolves when every cell has run; false if a cell failed and stopped the run.
            completed = page.evaluate(RUN_ALL)
            page.wait_for_function(KERNEL_IDLE, timeout=RUN_TIMEOUT_MS)
            assert page.evaluate(PROBLEMS) == []
            assert completed, "Run All Cells stopped early"

            images = page.locator(".jp-Notebook .jp-RenderedImage img")
            assert images.evaluate_all(IMAGES_SHOWN), "no figure was drawn as an image"

            buttons = page.get_by_role("button", name=BUTTON)
            assert buttons.count() >= 1, f"no {BUTTON!r} button: the interact widget is missing"
            button = buttons.first  # RERUN below watches the first one too
            widget_cell = page.locator(".jp-Cell", has=button)
            widget_images = widget_cell.locator(".jp-OutputArea-output img")
            before = widget_images.evaluate_all(IMAGES_SHOWN)
            button.scroll_into_view_if_needed()
            button.click()
            rerun = page.wait_for_function(RERUN, arg=[BUTTON, before], timeout=RUN_TIMEOUT_MS)
            errors = rerun.json_value()["errors"]
            assert not errors, f"{BUTTON!r} failed:\n" + "\n".join(errors)
            page.wait_for_function(KERNEL_IDLE, timeout=RUN_TIMEOUT_MS)
            assert page.evaluate(PROBLEMS) == [], "the widget's re-run reported a problem"
            widget_images.last.scroll_into_view_if_needed()
        finally:
            page.screenshot(path=str(screenshot))
            with capsys.disabled():
                print(f"\nscreenshot of {notebook} in JupyterLab: {screenshot}")
            browser.close()


# Once the kernel has answered, JupyterLab has written its language_info into the notebook.
OPENED_CLEAN = """version => {
    const panel = window.jupyterapp.shell.currentWidget;
    const info = panel?.context?.model?.getMetadata('language_info');
    if (info?.version !== version) return null;
    return {dirty: panel.context.model.dirty};
}"""


@pytest.mark.timeout(180)
def test_a_lesson_opens_not_marked_unsaved(lab: Lab, tmp_path: Path) -> None:
    """A lesson stored with another Python than the learner's opens unmodified.

    JupyterLab writes the kernel's ``language_info`` into the notebook when the kernel
    answers; without ``pgqueue.course.lab_contents`` a lesson executed on another Python
    version (always, for a learner) opened with the unsaved mark, and closing it asked to
    save changes nobody made. The lesson here is stored as if executed on Python 3.0.0.
    """
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is missing: pip install -e '.[dev]'")
    lesson = "notebooks/08-notify-delivery-and-cost.ipynb"
    stored = tmp_path / "course" / lesson  # the lab fixture serves this copy
    notebook = json.loads(stored.read_text())
    notebook["metadata"]["language_info"]["version"] = "3.0.0"
    stored.write_text(json.dumps(notebook, indent=1))
    kernel_python = sys.version.split()[0]  # the kernel is this environment's python3

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{lab.url}/lab/tree/{lesson}?token={lab.token}")
            page.wait_for_function(NOTEBOOK_OPEN, arg=lesson)
            page.wait_for_function(KERNEL_IDLE)
            opened = page.wait_for_function(OPENED_CLEAN, arg=kernel_python).json_value()
            assert opened == {"dirty": False}, "the lesson opened marked unsaved"
            # The file itself is untouched until the learner saves.
            assert json.loads(stored.read_text())["metadata"]["language_info"]["version"] == "3.0.0"
        finally:
            browser.close()
