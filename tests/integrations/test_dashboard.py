"""The web dashboard (``pgqueue.contrib.dashboard``) against a real PostgreSQL.

Most tests drive the ASGI app through Starlette's TestClient (httpx, in this process);
those about what listens where, and the live events, start ``pgqueue dashboard`` itself
and talk to it over a loopback socket. Running jobs are held by real ``pgqueue.Worker``
threads. Nothing here asserts a count that depends on timing: waits are bounds for a
broken run (``wait_for``), never the thing checked.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from conftest import rows, wait_for
from pgqueue import AsyncQueue, BadInput, Job, Queue, Tasks, Worker
from pgqueue.contrib import dashboard
from pgqueue.contrib.dashboard import actions

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    with TestClient(dashboard.app(dsn, token=TOKEN)) as c:
        yield c


def status_of(dsn: str, job_id: int) -> tuple[str, int]:
    [(status, fence)] = rows(dsn, "SELECT status, fence FROM jobs WHERE id = %s", [job_id])
    return status, fence


def make_dead(q: Queue, queue: str, payload: dict[str, Any]) -> int:
    job_id = q.enqueue(payload, queue=queue, priority=1_000_000)  # claimed first
    [job] = q.claim(queue)
    assert job.id == job_id and q.fail(job, "RuntimeError: boom", give_up=True)
    return job_id


class Holding:
    """A real worker thread whose handler holds each job until ``release``."""

    def __init__(self, dsn: str, queue: str, lease: float = 120.0) -> None:
        self.go = threading.Event()
        self.started: list[Job] = []

        def hold(job: Job) -> None:
            self.started.append(job)
            self.go.wait(60)

        self.worker = Worker(hold, queue=queue, dsn=dsn, lease=lease, poll_interval=0.05)

    def __enter__(self) -> Holding:
        self.worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.go.set()
        self.worker.stop()


# -- what it shows -------------------------------------------------------------------------
def test_overview_shows_each_queue_with_its_counts(client: TestClient, queue: Queue) -> None:
    queue.enqueue_many([{"n": n} for n in range(3)], queue="emails")
    queue.enqueue({"n": 1}, queue="reports")
    make_dead(queue, "reports", {"n": 2})

    page = client.get("/")
    assert page.status_code == 200, page.text
    assert "emails" in page.text and "reports" in page.text
    assert 'data-fragment="fragment/overview"' in page.text
    assert "dead job(s) wait for a person" in page.text  # reports needs attention

    found = {q["queue"]: q for q in client.get("/api/overview").json()["queues"]}
    assert (found["emails"]["ready"], found["emails"]["dead"]) == (3, 0)
    assert (found["reports"]["ready"], found["reports"]["dead"]) == (1, 1)
    assert found["reports"]["latest_error"] == "RuntimeError: boom"

    counted = client.get("/api/queues").json()
    assert {"queue": "emails", "status": "ready", "jobs": 3} in [
        {k: r[k] for k in ("queue", "status", "jobs")} for r in counted
    ]
    exact = client.get("/api/queues", params={"exact": "1"}).json()
    assert {(r["queue"], r["status"], r["jobs"]) for r in exact} == {
        ("emails", "ready", 3),
        ("reports", "ready", 1),
        ("reports", "dead", 1),
    }


def test_finished_jobs_between_two_looks_are_counted(client: TestClient, queue: Queue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(5)], queue="t")
    client.get("/api/overview")  # the first look
    for job in queue.claim("t", limit=3):
        assert queue.complete(job)
    queue.enqueue({"n": 9}, queue="t")  # added meanwhile: not finished
    dashboard_app = client.app.state.dashboard  # type: ignore[attr-defined]
    dashboard_app.store.looks.taken = -float("inf")  # the next request looks again
    client.get("/api/overview")
    last = dashboard_app.store.looks.kept[-1]
    assert last.finished == {"t": 3} and last.queues["t"]["ready"] == 3
    assert len(ids) == 5
    dashboard_app.store.looks.taken = -float("inf")  # a third look: two intervals to draw
    history = client.get("/").text.split('id="history"')[1].split("</section>")[0]
    assert history.count("<polyline") == 2  # finished per second and the wait, for "t"


def test_a_running_job_shows_its_lease_and_fence(client: TestClient, dsn: str) -> None:
    q = Queue(dsn)
    job_id = q.enqueue({"n": 1}, queue="slow")
    with Holding(dsn, "slow", lease=120):
        wait_for(lambda: status_of(dsn, job_id)[0] == "running", what="the worker's claim")
        [lease] = client.get("/api/overview").json()["running"]
        assert (lease["id"], lease["fence"], lease["attempts"]) == (job_id, 1, 1)
        assert 0 < lease["left_s"] <= 120  # by the database's clock
        page = client.get("/").text
        assert f'data-claim="{job_id}:1"' in page and "fence 1" in page
        one = client.get(f"/api/jobs/{job_id}").json()
        assert one["status"] == "running" and one["fence"] == 1 and 0 < one["left_s"] <= 120
    q.close()


def test_a_limited_queue_shows_who_holds_each_seat(client: TestClient, queue: Queue) -> None:
    queue.limit("tenants", per_group=1)
    held = queue.enqueue({"n": 1}, queue="tenants", group="t1")
    waiting = queue.enqueue({"n": 2}, queue="tenants", group="t1")
    [job] = queue.claim("tenants", limit=5)  # one seat for t1: the second job waits
    assert job.id == held
    [limit] = client.get("/api/overview").json()["limits"]
    assert (limit["queue"], limit["per_group"], limit["running"]) == ("tenants", 1, 1)
    [seat] = limit["holders"]
    assert (seat["group"], seat["seat"], seat["id"], seat["fence"]) == ("t1", 1, held, 1)
    [bar] = client.get("/api/overview").json()["running"]
    assert (bar["id"], bar["group"], bar["seat"]) == (held, "t1", 1)
    page = client.get("/").text
    assert f't1 seat 1: <a href="jobs/{held}">#{held}</a> fence 1' in page
    assert waiting not in [r["id"] for r in client.get("/api/overview").json()["running"]]


def test_jobs_list_filters_and_pages_by_keyset(client: TestClient, queue: Queue) -> None:
    blue = queue.enqueue_many([{"color": "Blue", "n": n} for n in range(5)], queue="a")
    queue.enqueue_many([{"color": "red", "n": n} for n in range(3)], queue="a")
    queue.enqueue({"color": "blue"}, queue="b", key="k1")
    dead = make_dead(queue, "a", {"color": "green"})

    found = client.get("/api/jobs", params={"queue": "a", "q": "blue", "limit": 2}).json()
    assert [j["id"] for j in found["jobs"]] == [blue[4], blue[3]]
    rest = client.get(
        "/api/jobs", params={"queue": "a", "q": "blue", "limit": 10, "before": found["next_before"]}
    ).json()
    assert [j["id"] for j in rest["jobs"]] == [blue[2], blue[1], blue[0]]
    assert rest["next_before"] is None

    assert [j["id"] for j in client.get("/api/jobs?status=dead").json()["jobs"]] == [dead]
    assert [j["queue"] for j in client.get("/api/jobs?key=k1").json()["jobs"]] == ["b"]
    assert [j["id"] for j in client.get("/api/jobs?q=boom").json()["jobs"]] == [dead]  # error
    page = client.get("/jobs", params={"queue": "a", "status": "dead"})
    assert page.status_code == 200 and f"#{dead}" in page.text


def test_one_job_shows_its_payload_result_and_durable_steps(client: TestClient, dsn: str) -> None:
    q = Queue(dsn)
    job_id = q.enqueue({"to": "a@example.com"}, queue="steps")

    def handler(job: Job) -> dict[str, int]:
        job.step("render", lambda: {"html": "<b>hi</b>"})
        return {"sent": 1}

    Worker(handler, queue="steps", dsn=dsn, burst=True).run()
    job = client.get(f"/api/jobs/{job_id}").json()
    assert job["status"] == "done" and job["result"] == {"sent": 1}
    assert [(s["name"], s["fence"], s["output"]) for s in job["steps"]] == [
        ("render", 1, {"html": "<b>hi</b>"})
    ]
    page = client.get(f"/jobs/{job_id}").text
    assert "a@example.com" in page and "&lt;b&gt;hi&lt;/b&gt;" in page  # escaped
    assert "<b>hi</b>" not in page
    q.close()


# -- actions -------------------------------------------------------------------------------
def test_a_dead_job_is_retried_from_its_page(client: TestClient, queue: Queue, dsn: str) -> None:
    job_id = make_dead(queue, "mail", {"n": 1})
    page = client.get(f"/jobs/{job_id}").text
    assert f'data-action="api/jobs/{job_id}/retry"' in page
    assert f'data-action="api/jobs/{job_id}/cancel"' not in page  # not for a dead job

    done = client.post(f"/api/jobs/{job_id}/retry", headers=AUTH)
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "ready" and status_of(dsn, job_id) == ("ready", 2)

    again = client.post(f"/api/jobs/{job_id}/retry", headers=AUTH)
    assert again.status_code == 409 and "is ready: only dead jobs" in again.json()["error"]
    assert status_of(dsn, job_id) == ("ready", 2)


def test_cancelling_a_running_job_raises_its_fence_and_refuses_its_holder(
    client: TestClient, queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({"n": 1}, queue="c")
    [job] = queue.claim("c")
    done = client.post(f"/api/jobs/{job_id}/cancel", headers=AUTH)
    assert done.status_code == 200 and status_of(dsn, job_id) == ("cancelled", 2)
    assert queue.complete(job) is False  # the late holder is refused
    deleted = client.post(f"/api/jobs/{job_id}/delete", headers=AUTH)
    assert deleted.status_code == 200
    assert rows(dsn, "SELECT id FROM jobs WHERE id = %s", [job_id]) == []
    assert client.get(f"/api/jobs/{job_id}").status_code == 404


def test_a_filter_wide_cancel_cancels_exactly_the_matching_jobs(
    client: TestClient, queue: Queue, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actions, "BATCH", 2)  # five matching jobs: three batches
    blue = queue.enqueue_many([{"color": "Blue", "n": n} for n in range(6)], queue="a")
    [running] = queue.claim("a")  # the oldest blue job, held by this "worker"
    [finished] = queue.claim("a")  # the next one, done: nothing to cancel
    assert queue.complete(finished) and (running.id, finished.id) == (blue[0], blue[1])
    others = queue.enqueue_many([{"color": "red", "n": n} for n in range(4)], queue="a")
    others += queue.enqueue_many([{"color": "blue"}], queue="b")

    answer = client.post("/api/bulk/cancel", params={"queue": "a", "q": "blue"}, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert answer.json()["changed"] == 5 and answer.json()["batches"] == 3
    cancelled = {r[0] for r in rows(dsn, "SELECT id FROM jobs WHERE status = 'cancelled'")}
    assert cancelled == {blue[0], *blue[2:]}
    assert all(status_of(dsn, i) == ("ready", 0) for i in others)
    assert status_of(dsn, finished.id) == ("done", 1)
    assert status_of(dsn, running.id) == ("cancelled", 2)  # its fence rose
    assert queue.heartbeat(running) is False  # so its holder is refused


def test_a_bulk_retry_of_a_queue_retries_its_dead_jobs_only(
    client: TestClient, queue: Queue, dsn: str
) -> None:
    dead = [make_dead(queue, "r", {"n": n}) for n in range(3)]
    other = make_dead(queue, "s", {"n": 9})
    ready = queue.enqueue({"n": 5}, queue="r")
    answer = client.post("/api/bulk/retry?queue=r", headers=AUTH)
    assert answer.status_code == 200 and answer.json()["changed"] == 3
    assert [status_of(dsn, i)[0] for i in dead] == ["ready"] * 3
    assert status_of(dsn, other)[0] == "dead" and status_of(dsn, ready) == ("ready", 0)
    refused = client.post("/api/bulk/retry?queue=r&status=ready", headers=AUTH)
    assert refused.status_code == 409 and "change the status filter" in refused.json()["error"]


def test_run_now_makes_one_job_for_this_seconds_slot(
    client: TestClient, dsn: str, queue: Queue
) -> None:
    tasks = Tasks()
    task = tasks.periodic(every=3600, name="nightly", queue="cron")(lambda job: None)
    schedule = tasks.schedules[task.name]

    async def first_slot_job() -> None:  # as a worker's ticks would leave it
        async with AsyncQueue(dsn) as aq:
            now, _ = await aq.schedule_clock(["nightly"])
            await aq.schedule_add(schedule, [now - timedelta(seconds=20), now + timedelta(hours=1)])
            assert await aq.schedule_tick(schedule, [now - timedelta(seconds=10)]) == 1

    asyncio.run(first_slot_job())
    page = client.get("/").text
    assert 'data-action="api/schedules/nightly/run"' in page

    made = client.post("/api/schedules/nightly/run", headers=AUTH)
    assert made.status_code == 200, made.text
    job_id = made.json()["id"]
    [(payload,)] = rows(dsn, "SELECT payload FROM jobs WHERE id = %s", [job_id])
    assert payload["task"] == task.name and payload["schedule"] == "nightly" and payload["manual"]
    [(slot_job,)] = rows(
        dsn, "SELECT job_id FROM pgqueue_slots WHERE slot = %s::timestamptz", [payload["slot"]]
    )
    assert slot_job == job_id  # one job for the slot, named by its row
    missing = client.post("/api/schedules/nope/run", headers=AUTH)
    assert missing.status_code == 404 and "no schedule 'nope'" in missing.json()["error"]


# -- closed by default ---------------------------------------------------------------------
def test_the_api_refuses_a_post_without_the_token_or_from_another_site(
    client: TestClient, queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({"n": 1}, queue="x")
    bare = client.post(f"/api/jobs/{job_id}/cancel")
    assert bare.status_code == 401 and "Authorization: Bearer" in bare.json()["error"]
    wrong = client.post(f"/api/jobs/{job_id}/cancel", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    cross = client.post(
        f"/api/jobs/{job_id}/cancel", headers=AUTH | {"Sec-Fetch-Site": "cross-site"}
    )
    assert cross.status_code == 403 and "cross-site request is refused" in cross.json()["error"]
    origin = client.post("/api/bulk/cancel", headers=AUTH | {"Origin": "http://evil.example"})
    assert origin.status_code == 403
    assert status_of(dsn, job_id) == ("ready", 0)  # nothing changed
    same = client.post(
        f"/api/jobs/{job_id}/cancel", headers=AUTH | {"Sec-Fetch-Site": "same-origin"}
    )
    assert same.status_code == 200 and status_of(dsn, job_id)[0] == "cancelled"


def test_a_queue_paused_from_the_dashboard_is_not_claimed_by_a_running_worker_until_resumed(
    client: TestClient, queue: Queue, dsn: str
) -> None:
    """The worker serves 'emails' then 'other' in each claim round: once the 'other' job
    enqueued after the paused e-mails is done, it has claimed past them."""
    done: list[str] = []
    worker = Worker(lambda job: done.append(job.queue), queue=["emails", "other"], dsn=dsn,
                    poll_interval=0.05)  # fmt: skip
    worker.start()
    try:
        queue.enqueue({}, queue="emails")
        wait_for(lambda: done == ["emails"], what="the first e-mail done")
        paused = client.post("/api/queues/emails/pause", headers=AUTH)
        assert paused.status_code == 200 and paused.json()["paused"] is True
        assert client.post("/api/queues/emails/pause", headers=AUTH).status_code == 409
        queue.enqueue_many([{}, {}], queue="emails")
        queue.enqueue({}, queue="other")
        wait_for(lambda: "other" in done, what="the later job of another queue done")
        assert rows(dsn, "SELECT status FROM jobs WHERE queue = 'emails' ORDER BY id") == [
            ("done",),
            ("ready",),
            ("ready",),
        ]
        page = client.get("/").text
        assert "paused: its 2 ready job(s) wait for a resume" in page
        assert 'data-action="api/queues/emails/resume"' in page
        [emails] = [
            q for q in client.get("/api/overview").json()["queues"] if q["queue"] == "emails"
        ]
        assert emails["paused_since"] is not None
        resumed = client.post("/api/queues/emails/resume", headers=AUTH)
        assert resumed.status_code == 200 and resumed.json()["paused"] is False
        wait_for(lambda: done.count("emails") == 3, what="the paused e-mails done")
    finally:
        worker.stop(grace=2)
    assert client.post("/api/queues/emails/resume", headers=AUTH).status_code == 409


def test_pausing_is_refused_without_the_token_for_a_bad_name_or_an_unknown_queue(
    client: TestClient, queue: Queue, dsn: str
) -> None:
    queue.enqueue({}, queue="emails")
    assert client.post("/api/queues/emails/pause").status_code == 401
    cross = AUTH | {"Sec-Fetch-Site": "cross-site"}
    assert client.post("/api/queues/emails/pause", headers=cross).status_code == 403
    unknown = client.post("/api/queues/nosuch/pause", headers=AUTH)
    assert unknown.status_code == 404 and "check its name" in unknown.json()["error"]
    assert client.post("/api/queues/emails/stop", headers=AUTH).status_code == 404
    assert client.post(f"/api/queues/{'x' * 300}/pause", headers=AUTH).status_code == 400
    assert queue.paused() == {}  # nothing changed
    with TestClient(dashboard.app(dsn, read_only=True)) as reader:
        assert reader.post("/api/queues/emails/pause", headers=AUTH).status_code == 403
        assert 'api/queues/emails/pause"' not in reader.get("/").text
    assert queue.paused() == {}


def test_read_only_refuses_every_action_and_shows_no_button(dsn: str, queue: Queue) -> None:
    job_id = make_dead(queue, "ro", {"n": 1})
    with TestClient(dashboard.app(dsn, read_only=True)) as ro:
        page = ro.get(f"/jobs/{job_id}").text
        assert "data-action" not in page and "read-only" in page
        for path in (f"/api/jobs/{job_id}/retry", "/api/bulk/delete", "/api/schedules/x/run"):
            refused = ro.post(path, headers=AUTH)
            assert refused.status_code == 403 and "read-only" in refused.json()["error"]
    assert status_of(dsn, job_id)[0] == "dead"


def test_hide_payload_hides_payloads_results_and_step_outputs(dsn: str, queue: Queue) -> None:
    job_id = queue.enqueue({"card": "4111-SECRET"}, queue="pay")

    def handler(job: Job) -> str:
        job.step("charge", lambda: "SECRET-step")
        return "SECRET-result"

    Worker(handler, queue="pay", dsn=dsn, burst=True).run()
    with TestClient(dashboard.app(dsn, token=TOKEN, hide_payload=True)) as hidden:
        for path in ("/", "/jobs", f"/jobs/{job_id}", "/api/jobs", f"/api/jobs/{job_id}"):
            answer = hidden.get(path)
            assert answer.status_code == 200 and "SECRET" not in answer.text, path
        assert "hidden (--hide-payload)" in hidden.get(f"/jobs/{job_id}").text
        # nor can a search find what it hides
        assert hidden.get("/api/jobs?q=4111").json()["jobs"] == []
    with TestClient(dashboard.app(dsn, token=TOKEN)) as shown:
        assert "4111-SECRET" in shown.get(f"/jobs/{job_id}").text


def test_bad_input_is_a_clear_4xx_and_changes_nothing(
    client: TestClient, queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({"n": 1}, queue="known")
    cases = [
        ("GET", "/api/jobs?status=lost", 400, "status must be one of"),
        ("GET", "/api/jobs?color=red", 400, "unknown filter 'color'"),
        ("GET", "/api/jobs?before=-3", 400, "before is a job id"),
        ("GET", "/api/jobs?limit=100000", 400, "limit is a page size"),
        ("GET", "/api/jobs/abc", 400, "a job id is a whole number"),
        ("GET", "/api/jobs/999999", 404, "no job 999999"),
        ("GET", "/api/jobs?queue=nowhere", 404, "no job has queue 'nowhere'"),
        ("POST", "/api/bulk/cancel?queue=nowhere", 404, "no job has queue 'nowhere'"),
        ("POST", "/api/bulk/explode", 404, "no action 'explode'"),
        ("POST", f"/api/jobs/{job_id}/explode", 404, "no action 'explode'"),
        ("POST", f"/api/jobs/{job_id}/retry", 409, "only dead jobs are retried"),
        ("POST", f"/api/jobs/{job_id}/delete", 409, "only done, dead or cancelled"),
        ("POST", "/api/jobs/0/cancel", 400, "a job id is a whole number"),
    ]
    for method, path, code, words in cases:
        answer = client.request(method, path, headers=AUTH)
        assert answer.status_code == code, (path, answer.text)
        assert words in answer.json()["error"], (path, answer.json())
    page = client.get("/jobs?status=lost")
    assert page.status_code == 400 and "status must be one of" in page.text
    assert status_of(dsn, job_id) == ("ready", 0)


def test_every_statement_runs_under_the_statement_timeout(dsn: str, queue: Queue) -> None:
    queue.enqueue({"n": 1}, queue="t")
    with TestClient(dashboard.app(dsn, token=TOKEN, statement_timeout=0.05)) as slow:
        lock = Queue(dsn)
        with lock.conn.transaction():  # a lock the dashboard's delete would wait for
            lock.conn.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            answer = slow.get("/api/jobs")
        lock.close()
        assert answer.status_code == 503 and "statement timeout (50 ms)" in answer.json()["error"]


def test_the_app_needs_a_token_unless_read_only(dsn: str) -> None:
    with pytest.raises(BadInput, match="actions need a token"):
        dashboard.app(dsn)
    with pytest.raises(BadInput, match="at least 8 characters"):
        dashboard.app(dsn, token="short")


def test_import_pgqueue_does_not_import_the_framework() -> None:
    names = "{'starlette', 'uvicorn', 'psycopg_pool'}"
    code = f"import sys, pgqueue; print(sorted({names} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == "[]"


# -- the command ---------------------------------------------------------------------------
def start_dashboard(dsn: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``pgqueue dashboard --port 0 ...`` and the address it printed."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    env.pop("PGQUEUE_DASHBOARD_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgqueue", "--dsn", dsn, "dashboard", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"pgqueue dashboard did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, line


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def listening_addresses(port: int) -> list[str]:
    """The local addresses listening on TCP ``port``, from /proc/net/tcp and tcp6."""
    found = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
def test_a_default_start_listens_on_loopback_only_and_prints_a_token(
    dsn: str, queue: Queue
) -> None:
    proc, line = start_dashboard(dsn)
    try:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/#token=([\w-]+)", line)
        assert found, line
        port, token = int(found[1]), found[2]
        assert len(token) >= 24
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, and nothing else
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/api/overview", timeout=10) as answer:
            assert answer.status == 200 and "queues" in json.load(answer)
        # Another name for this address (DNS rebinding) is not answered.
        request = urllib.request.Request(f"{base}/", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
        job_id = queue.enqueue({"n": 1}, queue="cli")
        post = urllib.request.Request(
            f"{base}/api/jobs/{job_id}/cancel",
            method="POST",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(post, timeout=10) as answer:
            assert answer.status == 200
        assert status_of(dsn, job_id)[0] == "cancelled"
    finally:
        stop(proc)


def test_live_events_say_change_when_a_job_is_added(dsn: str, queue: Queue) -> None:
    proc, line = start_dashboard(dsn, "--read-only")
    try:
        port = int(re.search(r":(\d+)/", line)[1])  # type: ignore[index]
        events = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/events", timeout=30)
        assert events.headers["Content-Type"].startswith("text/event-stream")
        assert events.readline().startswith(b"retry:")
        heard: list[bytes] = []

        def read() -> None:
            for raw in events:
                heard.append(raw)
                if raw.startswith(b"event: change"):
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def added_and_heard() -> bool:
            # The listener starts with this stream: enqueue until it hears one (a bound).
            queue.enqueue({"n": 1}, queue="live")
            reader.join(0.2)
            return not reader.is_alive()

        wait_for(added_and_heard, what="a change event")
        assert heard[-1].startswith(b"event: change")
        events.close()
    finally:
        stop(proc)


def test_a_port_in_use_is_one_line(dsn: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "pgqueue", "--dsn", dsn, "dashboard", "--port", str(port)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"pgqueue dashboard: port {port} is in use: choose another with --port"
    )


def test_a_filter_goes_back_into_its_query_string_unchanged() -> None:
    from pgqueue.contrib.dashboard.filters import jobs_filter

    args = {"queue": "a", "status": "dead", "key": "k", "q": "blue"}
    assert jobs_filter(args).query() == args
    assert jobs_filter({}).empty


def test_the_jupyter_launcher_tile_starts_a_dashboard_with_its_token(
    dsn: str, queue: Queue
) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert config["jupyter_serverproxy_servers"] == {
        "pgqueue-dashboard": "pgqueue.contrib.dashboard.jupyter:server"
    }
    from pgqueue.contrib.dashboard import jupyter
    from pgqueue.contrib.dashboard.background import free_port

    settings = jupyter.server()
    proxy = pytest.importorskip("jupyter_server_proxy.config")
    proxy.ServerProcess(name=jupyter.NAME, **settings)  # fields jupyter-server-proxy accepts
    token = settings["environment"]["PGQUEUE_DASHBOARD_TOKEN"]
    assert settings["launcher_entry"]["path_info"] == f"pgqueue-dashboard/#token={token}"
    assert token not in " ".join(settings["command"])  # not on a command line

    # What the proxy runs: the command with its port, the token in the environment.
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in settings["command"]]
    env = os.environ | settings["environment"] | {"PYTHONPATH": str(ROOT), "PGQUEUE_DSN": dsn}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        assert f"#token={token}" in proc.stdout.readline().decode()
        job_id = queue.enqueue({"n": 1}, queue="lab")
        # The proxy passes on the browser's Host: any is answered here.
        page = urllib.request.Request(
            f"http://127.0.0.1:{port}/jobs/{job_id}", headers={"Host": "hub.example:443"}
        )
        with urllib.request.urlopen(page, timeout=10) as answer:
            assert '<base href="../">' in answer.read().decode()  # works under any prefix
        post = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/jobs/{job_id}/cancel",
            method="POST",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(post, timeout=10) as answer:
            assert answer.status == 200
        assert status_of(dsn, job_id)[0] == "cancelled"
    finally:
        stop(proc)  # type: ignore[arg-type]


def test_a_dashboard_on_a_thread_serves_one_database(dsn: str, queue: Queue) -> None:
    from pgqueue.contrib.dashboard.background import Background

    queue.enqueue({"n": 1}, queue="lesson")
    with Background(dsn) as dash:
        assert dash.url.startswith(f"http://127.0.0.1:{dash.port}/#token=")
        with urllib.request.urlopen(f"http://127.0.0.1:{dash.port}/", timeout=10) as answer:
            assert "lesson" in answer.read().decode()
        assert f"port {dash.port}" in dash._repr_html_()


def test_the_benchmark_times_every_request(admin_dsn: str) -> None:
    from pgqueue.tools.bench import Bench
    from pgqueue.tools.bench.dashboard import DASHBOARD_COLUMNS, bench_dashboard

    bench = Bench(admin_dsn, progress=False)
    try:
        found = bench_dashboard(bench, n_rows=5_000, repeats=1)
    finally:
        bench.cleanup()
    assert {row["request"] for row in found} >= {"overview page", "GET /api/jobs?status=dead"}
    for row in found:
        assert set(DASHBOARD_COLUMNS) <= set(row) and row["ms_median"] > 0 and row["bytes"] > 0


def test_a_database_without_the_table_is_one_line_at_start(empty_dsn: str) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pgqueue", "--dsn", empty_dsn, "dashboard", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("pgqueue dashboard: ") and "pgqueue init" in line, line
