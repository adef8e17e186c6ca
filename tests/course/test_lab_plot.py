"""The course's helpers: counterfactual claims misbehave as taught, timelines draw lanes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import matplotlib
import psycopg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from conftest import rows
from pgqueue import EventLog, Queue, Worker
from pgqueue.course import failures, lab, plot, stories
from pgqueue.course.faults import FaultyWorker

matplotlib.use("Agg")


def test_claim_without_lock_hands_one_job_to_two_workers(queue: Queue, dsn: str) -> None:
    queue.enqueue({"n": 1}, queue="cf")
    got: list[list[int]] = []
    barrier = threading.Barrier(2)

    def grab() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait()
            got.append([j.id for j in lab.claim_without_lock(conn, "cf", window=0.3)])

    threads = [threading.Thread(target=grab) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] and len(got[0]) == 1  # the same job, twice
    assert rows(dsn, "SELECT fence FROM jobs") == [(2,)]


def test_claim_without_skip_locked_returns_the_claimed_jobs(queue: Queue) -> None:
    ids = queue.enqueue_many([{"n": i} for i in range(3)], queue="cf")
    jobs = lab.claim_without_skip_locked(queue.conn, "cf", limit=2, hold=0)
    assert len(jobs) == 2 and {j.id for j in jobs} <= set(ids)
    assert all(j.fence == 1 for j in jobs)


def test_complete_ignoring_fence_lets_a_stale_holder_through(queue: Queue) -> None:
    queue.enqueue({"n": 1}, queue="cf")
    [stale] = queue.claim("cf", lease=0.1)
    queue.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
    queue.reap()
    [fresh] = queue.claim("cf")
    assert not queue.complete(stale)  # the real statement refuses
    assert lab.complete_ignoring_fence(queue.conn, stale)  # the counterfactual does not
    assert fresh.fence == 2


def test_scratch_database_is_gone_afterwards(admin_dsn: str) -> None:
    with lab.scratch_database("pgqueue_scratch_test", admin_dsn) as target, Queue(target) as q:
        q.enqueue({"n": 1})
    names = rows(
        admin_dsn, "SELECT datname FROM pg_database WHERE datname = 'pgqueue_scratch_test'"
    )
    assert names == []


def test_timeline_draws_a_lane_per_worker_and_marks_rejected_writes(queue: Queue, dsn: str) -> None:
    queue.enqueue({"n": 1}, queue="tl")
    log = EventLog()
    common = dict(queue="tl", dsn=dsn, lease=0.5, poll_interval=0.05, reap_interval=0.1)
    a = FaultyWorker(lambda job: None, name="A", events=log, **common)  # type: ignore[arg-type]
    a.pause_on_next_claim(1.2)
    a.start()
    lab.wait_for(log, "claim", timeout=10)
    b = Worker(lambda job: None, name="B", events=log, **common).start()  # type: ignore[arg-type]
    lab.wait_for(log, "complete-rejected", timeout=15)
    a.stop(grace=1)
    b.stop(grace=1)
    fig = plot.timeline(log, lease=0.5)
    [ax] = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:2] == ["A", "B"] or sorted(labels) == ["A", "B"]
    assert ax.get_xlabel() and ax.get_title()
    assert ax.get_legend() is not None


def _labels_apart(fig: object, gap: float = 4.0) -> None:
    """Every text label of every axes lies inside its axes and stands at least ``gap``
    points clear of every other across (labels that touch read as one: "#19 f=1#19 f=3")."""
    fig.canvas.draw()  # type: ignore[attr-defined]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    clear = gap * fig.dpi / 72.0  # type: ignore[attr-defined]
    for ax in fig.axes:  # type: ignore[attr-defined]
        area = ax.get_window_extent(renderer)
        texts = [t for t in ax.texts if t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in texts]
        for i, box in enumerate(boxes):
            name = texts[i].get_text()
            assert area.x0 - 1 <= box.x0 and box.x1 <= area.x1 + 1, name
            wide = Bbox.from_extents(box.x0 - clear, box.y0, box.x1 + clear, box.y1)
            for j, other in enumerate(boxes[i + 1 :], i + 1):
                assert not wide.overlaps(other), f"{name!r} touches {texts[j].get_text()!r}"


def _frame(rows: list[tuple[float, str, str, int | None, int | None, str]]) -> object:
    import pandas as pd

    frame = pd.DataFrame(rows, columns=["s", "kind", "worker", "job_id", "fence", "detail"])
    frame["t"] = frame["s"] + 1000.0
    return frame.astype({"job_id": "Int64", "fence": "Int64"})


def _texts(fig: object) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]  # type: ignore[attr-defined]


def test_timeline_draws_the_database_lease_and_a_mark_for_dead_jobs(queue: Queue, dsn: str) -> None:
    stories.watch(queue.conn)
    log = EventLog()
    queue.enqueue({"n": 1}, queue="tl", max_attempts=1)
    [job] = queue.claim("tl", lease=0.2)
    log.record("claim", "A", job.id, job.fence, "1")
    queue.heartbeat(job, lease=0.2)
    time.sleep(0.3)
    [reaped] = queue.reap()
    log.record("reap", "B", reaped.id, reaped.fence, reaped.status)
    leases = stories.leases(queue.conn)
    assert len(leases) == 2 and ((leases.until_t - leases.set_t - 0.2).abs() < 1e-3).all()
    fig = plot.timeline(log, leases=leases, lanes=["A"], title="dead by the reaper")
    [ax] = fig.axes
    expiry = leases.until_t.max() - log.started
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(dotted) == 1 and abs(dotted[0].get_xdata()[0] - expiry) < 1e-9
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "job dead (not retried)" in legend and "reaper takes the job back" not in legend
    assert f"#{job.id} dead" in _texts(fig)
    _labels_apart(fig)


def test_timeline_marks_the_last_fail_of_a_dead_job_and_timeouts() -> None:
    frame = _frame(
        [
            (0.0, "claim", "w", 7, 1, "1"),
            (0.1, "fail", "w", 7, 1, "ValueError: no"),
            (0.3, "claim", "w", 7, 3, "2"),
            (0.4, "fail", "w", 7, 3, "ValueError: no"),
            (0.5, "claim", "w", 8, 1, "1"),
            (0.9, "fail", "w", 8, 1, "TimeoutError: the handler ran past the 0.4 s timeout"),
        ]
    )
    fig = plot.timeline(frame, dead=[7])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert {"fail (retry later)", "job dead (not retried)", "fail: handler timed out"} <= set(
        legend
    )
    assert "#7 dead" in _texts(fig) and "timed out" in _texts(fig)
    # a job dead by its timeout (12's transcode) keeps the reason on its dead mark
    died = plot.timeline(frame, dead=[7, 8])
    assert "#8 dead: timed out" in _texts(died)


def test_timeline_legend_promises_claim_labels_only_when_it_draws_them() -> None:
    rows = [(0.01 * i, "claim", "w", 100 + i, 1, "1") for i in range(40)]
    labelled, plain = (plot.timeline(_frame(rows), annotate=a) for a in (True, False))
    said, unsaid = (
        [t.get_text() for t in f.axes[0].get_legend().get_texts()] for f in (labelled, plain)
    )
    assert "claim (#job f=fence)" in said and "#100 f=1" in _texts(labelled)
    assert "claim" in unsaid and "claim (#job f=fence)" not in unsaid
    assert not any(text.startswith("#") for text in _texts(plain))


def test_timeline_labels_of_crowded_claims_do_not_overlap() -> None:
    rows = []
    for i in range(12):  # a claim and a complete every 20 ms, like a busy worker
        rows += [
            (0.02 * i, "claim", "w", 100 + i, 1, "1"),
            (0.02 * i + 0.015, "complete", "w", 100 + i, 1, ""),
        ]
    rows += [
        (0.05, "fenced-write-rejected", "w", 101, 1, ""),
        (0.06, "complete-rejected", "w", 101, 1, ""),
    ]
    fig = plot.timeline(_frame(rows))
    _labels_apart(fig)
    assert any("rejected" in text for text in _texts(fig))


def test_labels_side_by_side_keep_a_gap() -> None:
    import matplotlib.pyplot as plt

    from pgqueue.course.labels import _Labels

    # Two claims a label's width (and 3 px) apart: before, the second label went on the same
    # row 3 px after the first, and the pair read as one ("#19 f=1#19 f=3", 06's timeouts).
    fig, ax = plt.subplots(figsize=(8, 2))
    ax.set_xlim(0, 1)
    ax.set_ylim(-1, 1)
    fig.canvas.draw()
    probe = ax.text(0, 0, "#19 f=1", fontsize=8)
    width = probe.get_window_extent(fig.canvas.get_renderer()).width
    probe.remove()
    per_px = 1 / ax.get_window_extent().width
    labels = _Labels(ax)
    labels.add(0.2, 0, "#19 f=1")
    labels.add(0.2 + (width + 3) * per_px, 0, "#19 f=3")
    labels.place()
    assert not labels.dropped
    _labels_apart(fig)
    plt.close(fig)


def test_fencing_draws_the_stored_fences_and_where_a_late_write_is_refused(
    queue: Queue, dsn: str
) -> None:
    queue.conn.execute(
        "CREATE TABLE reports (id int PRIMARY KEY, body text, job_id bigint, fence bigint)"
    )
    stories.watch(queue.conn, "reports")
    log = EventLog()
    job_id = queue.enqueue({"n": 1}, queue="f")
    [a] = queue.claim("f", lease=30)
    log.record("claim", "A", a.id, a.fence, "1")
    queue.conn.execute("UPDATE jobs SET lease_until = now() - interval '1 s'")
    queue.reap()
    [b] = queue.claim("f", lease=30)
    log.record("claim", "B", b.id, b.fence, "2")
    assert b.fenced_write("reports", {"id": 1}, {"body": "B"})
    log.record("fenced-write", "B", b.id, b.fence)
    assert queue.complete(b)
    log.record("complete", "B", b.id, b.fence)
    assert not a.fenced_write("reports", {"id": 1}, {"body": "A"})
    log.record("fenced-write-rejected", "A", a.id, a.fence)
    assert not queue.complete(a)
    log.record("complete-rejected", "A", a.id, a.fence)
    storage = {
        "jobs row": stories.fences(queue.conn, "jobs", id=job_id),
        "reports row": stories.fences(queue.conn, "reports", id=1),
    }
    assert [list(s.fence) for s in storage.values()] == [[0, 1, 2], [2]]
    fig = plot.fencing(log, storage, lanes=["A", "B"])
    [ax] = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["A", "B", "jobs row", "reports row"]
    texts = _texts(fig)
    # The job's row takes only its current fence, the report's row any fence no older.
    assert texts.count("1 ≠ 2: refused") == 1 and texts.count("1 < 2: refused") == 1
    assert "fence 2" in texts or "f=2" in texts
    # The stored fence is drawn as a step: the job row's segments climb with 0, 1, 2 (the
    # lanes' axis runs downwards, so a higher fence has a smaller y).
    jobs_y = [t.get_text() for t in ax.get_yticklabels()].index("jobs row")
    steps = [
        line.get_ydata()[0]
        for line in ax.lines
        if line.get_linewidth() == 5 and abs(line.get_ydata()[0] - jobs_y) < 0.5
    ]
    assert len(steps) == 3 and steps[0] > steps[1] > steps[2], steps
    arrows = [t for t in ax.texts if t.get_text() == "" and t.arrow_patch is not None]
    assert len(arrows) == 6  # two claims, two accepted writes, two refused
    _labels_apart(fig)


# -- the two failures the committed benchmark measures (notebooks 08 and 09) -----------
DATA = Path(__file__).resolve().parents[2] / "data"


def _titled(fig: Figure) -> None:
    """Every axes of ``fig`` has a title, both axis labels and a legend."""
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
        assert ax.get_legend() is not None


def test_claim_cases_read_the_dead_versions_from_the_committed_data() -> None:
    claim, machine = failures.read_bench("claim_size", DATA)
    cases = failures.claim_cases(claim)
    assert list(cases.index) == list(failures.CLAIM_CASES)
    kept = cases.loc["jobs churned, dead versions kept"]
    assert kept.dead_tuples > 0 and cases.loc["the same table after VACUUM"].dead_tuples == 0
    held = cases.loc["the same churn, VACUUM while a session held the horizon"]
    assert held.dead_tuples == kept.dead_tuples  # VACUUM under the held horizon removed none
    where = failures.stamp(claim, machine)
    assert claim["date_utc"].iloc[0] in where and str(claim["cores"].iloc[0]) in where
    _titled(failures.plot_claim_cases(cases, where))


def test_notify_ratios_pair_the_trigger_on_and_off_rows() -> None:
    notify, machine = failures.read_bench("notify", DATA)
    ratios = failures.notify_ratios(notify)
    assert len(ratios) == len(notify) // 2
    assert set(ratios.index.get_level_values("method")) == {"enqueue", "enqueue_many"}
    assert (ratios.ratio_min <= ratios.ratio_off_to_on).all()
    # 16 producers: every run apart; 4 producers: the runs overlap (within noise)
    assert ratios.apart[("enqueue", 16)] and not ratios.apart[("enqueue", 4)]
    fig = failures.plot_notify_cost(notify, failures.stamp(notify, machine))
    _titled(fig)
    left = fig.axes[0]
    # every run drawn as its own marker (3 per setting, trigger on and off), no trend line
    points = sum(len(line.get_xdata()) for line in left.get_lines())
    assert points == 3 * len(notify[notify.method == "enqueue"])
    notes = [t.get_text() for t in left.texts]
    assert sum("within noise" in n for n in notes) == 1
