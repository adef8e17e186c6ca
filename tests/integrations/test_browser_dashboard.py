"""The web dashboard in Debian's Chromium, driven by Playwright.

``pgqueue dashboard --port 0`` runs as a process of its own against this test's database;
the page is opened at the address it printed (its ``#token=`` fragment gives the page the
token). A real worker thread holds a job: its lease bar must shrink in the browser between
two looks at it, beside its fence. A dead job is retried by a click on its page, and a
filter's cancel button cancels exactly the jobs the filter matches. Screenshots go to the
test's temporary directory, outside the repository.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from test_browser import CHROMIUM, CHROMIUM_FLAGS, _unavailable
from test_dashboard import Holding, make_dead, start_dashboard, status_of, stop

from conftest import rows, wait_for
from pgqueue import Queue, Worker

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FILL = """claim => {
    const bar = document.querySelector(`.lease[data-claim="${claim}"]`);
    if (!bar) return null;
    return {width: bar.querySelector('.fill').getBoundingClientRect().width,
            text: bar.querySelector('.left').textContent,
            row: bar.closest('tr')?.textContent ?? ''};
}"""


@pytest.mark.timeout(240)
def test_the_dashboard_in_chromium(dsn: str, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is missing: pip install -e '.[dev]'")
    q = Queue(dsn)
    held = q.enqueue({"n": 1}, queue="slow")
    dead = make_dead(q, "mail", {"to": "a@example.com"})
    blue = q.enqueue_many([{"color": "blue", "n": n} for n in range(3)], queue="paint")
    red = q.enqueue_many([{"color": "red", "n": n} for n in range(2)], queue="paint")
    proc, line = start_dashboard(dsn)
    address = re.search(r"(http://\S+/)#token=\S+", line)
    assert address, line
    try:
        with Holding(dsn, "slow", lease=120), sync_playwright() as playwright:
            wait_for(lambda: status_of(dsn, held)[0] == "running", what="the worker's claim")
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("dialog", lambda dialog: dialog.accept())  # the bulk action's confirm
            try:
                page.goto(line.split()[-1])
                # The token moved from the address into the tab's storage.
                assert page.evaluate("location.hash") == ""
                assert page.locator("#token-state").inner_text() == "actions on"
                assert "slow" in page.locator("#queues").inner_text()

                # The running job's lease bar shrinks in the browser, beside its fence.
                claim = f"{held}:1"
                page.wait_for_function(f"() => ({FILL})('{claim}') !== null")
                first = page.evaluate(FILL, claim)
                time.sleep(1.5)  # the bar is redrawn every frame: it must have moved
                second = page.evaluate(FILL, claim)
                page.screenshot(path=str(tmp_path / "dashboard-overview.png"))
                assert second["width"] < first["width"], (first, second)
                assert "fence 1" in second["row"] and re.match(r"[\d.]+ s left", second["text"])

                # A dead job is retried from its page.
                page.goto(f"{address[1]}jobs/{dead}")
                page.get_by_role("button", name="retry").click()
                page.wait_for_function(
                    "() => document.getElementById('said').textContent.includes('now ready')"
                )
                assert status_of(dsn, dead)[0] == "ready"

                # A filter's cancel cancels exactly the jobs it matches.
                page.goto(f"{address[1]}jobs?queue=paint&q=blue")
                listed = page.locator("tbody tr").count()
                assert listed == 3
                page.get_by_role("button", name=re.compile("^cancel all matching")).click()
                page.wait_for_function(
                    "() => document.getElementById('said').textContent.includes('3 job(s)')"
                )
                # The list refreshes itself after the action (its live fragment).
                page.wait_for_function(
                    "() => document.querySelectorAll('#live td.status.cancelled').length === 3"
                )
                page.screenshot(path=str(tmp_path / "dashboard-jobs.png"))
                statuses = dict(rows(dsn, "SELECT id, status FROM jobs WHERE queue = 'paint'"))
                assert {i: statuses[i] for i in blue} == dict.fromkeys(blue, "cancelled")
                assert {i: statuses[i] for i in red} == dict.fromkeys(red, "ready")

                # A queue paused by a click is not claimed by a running worker until a
                # click resumes it ('other', served after 'paint' in each claim round, is
                # done first: the worker has claimed past the paused jobs).
                page.goto(address[1])
                paint = page.locator('#queues tr[data-queue="paint"]')
                paint.get_by_role("button", name="pause").click()
                page.wait_for_function(
                    "() => document.getElementById('said').textContent.includes('paused')"
                )
                ran: list[str] = []
                worker = Worker(lambda job: ran.append(job.queue), queue=["paint", "other"],
                                dsn=dsn, poll_interval=0.05).start()  # fmt: skip
                try:
                    q.enqueue({}, queue="other")
                    wait_for(lambda: ran == ["other"], what="the other queue's job done")
                    statuses = dict(rows(dsn, "SELECT id, status FROM jobs WHERE queue = 'paint'"))
                    assert {i: statuses[i] for i in red} == dict.fromkeys(red, "ready")
                    page.wait_for_function(
                        "() => document.querySelector('#queues tr[data-queue=\"paint\"]')"
                        "?.textContent.includes('paused')"
                    )
                    paint.get_by_role("button", name="resume").click()
                    wait_for(lambda: ran.count("paint") == len(red), what="the paint jobs done")
                finally:
                    worker.stop(grace=2)
                assert problems == []
            finally:
                page.screenshot(path=str(tmp_path / "dashboard-last.png"))
                print("said:", page.locator("#said").inner_text())
                print(f"\nscreenshots of the dashboard: {tmp_path}")
                browser.close()
    finally:
        stop(proc)
        q.close()
