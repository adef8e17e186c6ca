"""``pgqueue.monitor`` live in JupyterLab, in Debian's Chromium driven by Playwright.

A notebook written for the test starts two workers on a queue of jobs and runs the monitor
in a cell, then a ``Monitor`` on its thread beside a later cell. While each watches, the
figure in its cell's output must change (it is redrawn in place: the image's source differs
between two looks at the page), and when the watch ends its last figure stays. The
screenshots go to the test's temporary directory, outside the repository. JupyterLab, its
fixture and the page helpers are those of ``test_browser.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from test_browser import (  # noqa: F401  (lab: the fixture)
    CHROMIUM,
    CHROMIUM_FLAGS,
    KERNEL_IDLE,
    NOTEBOOK_OPEN,
    PROBLEMS,
    Lab,
    _unavailable,
    lab,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "notebooks/monitor-live.ipynb"
CELLS = [
    """import time

import pgqueue
from pgqueue.course import lab

dsn = lab.fresh_database("browser_monitor")
q = pgqueue.Queue(dsn)
q.enqueue_many([{"n": n} for n in range(300)], queue="live")
workers = [
    pgqueue.Worker(lambda job: time.sleep(0.05), queue="live", dsn=dsn, name=f"w{i}").start()
    for i in range(2)
]""",
    'watch = pgqueue.monitor(q, "live", every=0.2, seconds=60, until="drained")',
    """q.enqueue_many([{"n": n} for n in range(300)], queue="live")
beside = pgqueue.Monitor(q, "live", every=0.2).start()  # watches on its thread""",
    "time.sleep(8)  # the workers run, the monitor beside them updates the cell above",
    """beside.stop()
for worker in workers:
    worker.stop()
q.close()
lab.drop_database("browser_monitor")
print("stopped by", watch.stopped_by, "then", beside.stopped_by)""",
]
# Start Run All without waiting for it: the test looks at the page while the cells run.
RUN_ALL_LATER = """async () => {
    const panel = window.jupyterapp.shell.currentWidget;
    await panel.context.ready;
    await panel.sessionContext.ready;
    window.jupyterapp.commands.execute('notebook:run-all-cells');
    return true;
}"""
# The sources of the images shown in the output of code cell ``index``.
IMAGES_OF = """index => {
    const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
    const imgs = cells[index]?.querySelectorAll('.jp-OutputArea-output img') ?? [];
    return [...imgs].filter(img => img.complete && img.naturalWidth > 0).map(img => img.src);
}"""
BLOCKING, BESIDE, LAST = 1, 2, 4  # code cells: pgqueue.monitor, Monitor.start, the last
# What code cell ``index`` shows: its prompt ("[*]:" while it runs) and its output's text.
SHOWN = """index => {
    const cell = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')][index];
    return {prompt: cell?.querySelector('.jp-InputPrompt')?.textContent ?? '',
            output: cell?.querySelector('.jp-OutputArea')?.textContent ?? ''};
}"""


@pytest.mark.timeout(300)
def test_monitor_updates_live_in_jupyterlab(lab: Lab, tmp_path: Path) -> None:  # noqa: F811
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is missing: pip install -e '.[dev]'")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, tmp_path / "course" / NOTEBOOK)  # the lab fixture's course copy

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(60_000)
        try:
            page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}")
            page.wait_for_function(NOTEBOOK_OPEN, arg=NOTEBOOK)
            page.evaluate(RUN_ALL_LATER)
            _redrawn_while_running(page, BLOCKING, BLOCKING, tmp_path / "monitor-blocking.png")
            _redrawn_while_running(page, BESIDE, BESIDE + 1, tmp_path / "monitor-beside.png")
            # The kernel is idle for a moment between cells: wait for the last one's words.
            page.wait_for_function(
                f"() => ({SHOWN})({LAST}).output.includes('stopped by')", timeout=120_000
            )
            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            assert page.evaluate(PROBLEMS) == []
            for cell in (BLOCKING, BESIDE):
                assert len(page.evaluate(IMAGES_OF, cell)) == 1, "the last figure must stay"
            said = page.evaluate(SHOWN, LAST)["output"]
            assert "stopped by until then stop" in said, said
        finally:
            page.screenshot(path=str(tmp_path / "monitor-end.png"))
            print(f"\nscreenshots of the live monitor in JupyterLab: {tmp_path}")
            browser.close()


def _redrawn_while_running(page: Any, cell: int, running: int, screenshot: Path) -> None:
    """The monitor's figure appears in code cell ``cell`` and changes in place while code
    cell ``running`` still runs (one image, a new source); a screenshot is taken meanwhile."""
    page.wait_for_function(f"() => ({IMAGES_OF})({cell}).length > 0", timeout=120_000)
    page.locator(".jp-Notebook .jp-CodeCell").nth(cell).scroll_into_view_if_needed()
    before = after = page.evaluate(IMAGES_OF, cell)
    deadline = time.monotonic() + 20
    while after == before and time.monotonic() < deadline:
        time.sleep(0.25)
        after = page.evaluate(IMAGES_OF, cell)
    page.screenshot(path=str(screenshot))
    assert len(before) == len(after) == 1, "one figure, redrawn in place, not a second image"
    assert after != before, f"the monitor's figure in cell {cell} did not change as it watched"
    assert "*" in page.evaluate(SHOWN, running)["prompt"], "the watch ended before it was seen"
