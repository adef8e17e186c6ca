"""``pgqueue.monitor`` live in JupyterLab, in Debian's Chromium driven by Playwright.

A notebook written for the test starts two workers on a queue of jobs and runs the monitor
in a cell. While that cell runs, the figure in its output must change (the monitor redraws it
in place: the image's source differs between two looks at the page), and when the watch ends
its last figure stays. The screenshots go to the test's temporary directory, outside the
repository. JupyterLab, its fixture and the page helpers are those of ``test_browser.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

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
    'watch = pgqueue.monitor(q, "live", every=0.2, seconds=25, until="drained")',
    """for worker in workers:
    worker.stop()
q.close()
lab.drop_database("browser_monitor")
print("stopped by", watch.stopped_by, "after", len(watch.snapshots), "looks")""",
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
MONITOR_CELL = 1


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
            first = page.wait_for_function(
                f"() => ({IMAGES_OF})({MONITOR_CELL}).length > 0", timeout=120_000
            )
            assert first
            before = page.evaluate(IMAGES_OF, MONITOR_CELL)
            page.locator(".jp-Notebook .jp-CodeCell").nth(MONITOR_CELL).scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "monitor-live-1.png"))
            deadline, after = time.monotonic() + 20, before
            while after == before and time.monotonic() < deadline:
                time.sleep(0.25)
                after = page.evaluate(IMAGES_OF, MONITOR_CELL)
            page.screenshot(path=str(tmp_path / "monitor-live-2.png"))
            # One figure, redrawn in place while the cell ran: not a second image below.
            assert len(before) == len(after) == 1, (before[:1], after[:1])
            assert after != before, "the monitor's figure did not change while it watched"
            assert not page.evaluate(KERNEL_IDLE), "the monitor stopped before it was seen live"

            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            assert page.evaluate(PROBLEMS) == []
            final = page.evaluate(IMAGES_OF, MONITOR_CELL)
            assert len(final) == 1, "the last figure did not stay in the output"
            said = page.locator(".jp-Notebook .jp-CodeCell").nth(2).inner_text()
            assert "stopped by until" in said, said
        finally:
            page.screenshot(path=str(tmp_path / "monitor-live-end.png"))
            print(f"\nscreenshots of the live monitor in JupyterLab: {tmp_path}")
            browser.close()
