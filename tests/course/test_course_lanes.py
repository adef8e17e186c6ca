"""The lifecycle picture (pgqueue.course.job_lanes): built from the database's own record of
a job's row, it draws each claim, the lease running out, the reaper, the fence as a step and
the stale holder's refused writes; ``upto`` shows only what had happened by then."""

from __future__ import annotations

import matplotlib
import pytest

from pgqueue import EventLog, Queue, Worker
from pgqueue.course import job_lanes, lab, stories
from pgqueue.course.faults import FaultyWorker

matplotlib.use("Agg")


@pytest.fixture
def lives(queue: Queue, dsn: str) -> job_lanes.Lives:
    """A live run: A freezes 1 s holding the first of three jobs (0.4 s lease), B takes
    it over; A's late complete is refused."""
    stories.watch(queue.conn)
    log = EventLog()
    common = dict(
        queue="lanes", dsn=dsn, lease=0.4, poll_interval=0.05, reap_interval=0.05,
        listen=False, events=log,
    )  # fmt: skip
    ids = queue.enqueue_many([{"n": n} for n in range(3)], queue="lanes")
    a = FaultyWorker(lambda job: None, name="A", **common)
    a.pause_on_next_claim(1.0)
    a.start()
    try:
        lab.wait_for(log, "claim")
        b = Worker(lambda job: None, name="B", **common).start()
        try:
            lab.wait_for(log, "complete", count=3, timeout=15)
            lab.wait_for(log, lambda e: e.worker == "A" and e.kind == "complete-rejected")
        finally:
            b.stop()
    finally:
        a.stop()
    return job_lanes.record(queue.conn, log, ids)


def test_record_reads_each_fence_the_row_held_and_each_claim_as_its_worker_lived_it(
    lives: job_lanes.Lives,
) -> None:
    first, *rest = lives.jobs
    assert lives.fences(first) == [0, 1, 2]
    assert all(lives.fences(job) == [0, 1] for job in rest)
    held = {(h.job_id, h.fence): h for h in job_lanes.holds(lives)}
    stale, fresh = held[(first, 1)], held[(first, 2)]
    assert (stale.worker, stale.end_kind) == ("A", "complete-rejected")
    assert (fresh.worker, fresh.end_kind) == ("B", "complete")
    # A's lease ran out while it still held on: the database's deadline is before its end.
    assert stale.lease_at(stale.end) is not None and stale.lease_at(stale.end) < stale.end
    assert stale.lease_at(stale.start - 1) is None


def test_draw_shows_the_fence_as_a_step_and_marks_the_refused_write(
    lives: job_lanes.Lives,
) -> None:
    import matplotlib.pyplot as plt

    fig = job_lanes.draw(lives, title="test")
    try:
        ax, fences = fig.axes
        assert ax.get_title() == "test" and "(s)" in ax.get_xlabel() and ax.get_ylabel()
        assert "fence" in fences.get_ylabel() and ax.get_legend() is not None
        # One step line per job; the first job's climbs twice, the others' once.
        steps = [line for line in ax.lines if line.get_drawstyle() == "steps-post"]
        rises = sorted(len(set(line.get_ydata())) for line in steps)
        assert rises == [2, 2, 3]
        red_crosses = [c for c in ax.collections if c.get_paths() and _is(c, "red")]
        assert red_crosses, "the refused late complete is marked"
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "held by A" in labels and "late write refused (0 rows)" in labels
    finally:
        plt.close(fig)


def test_draw_upto_shows_only_what_had_happened(lives: job_lanes.Lives) -> None:
    import matplotlib.pyplot as plt

    first_claim = float(lives.events.loc[lives.events["kind"] == "claim", "s"].min())
    fig = job_lanes.draw(lives, upto=first_claim + 0.01)
    try:
        ax = fig.axes[0]
        assert not [c for c in ax.collections if _is(c, "red")], "no refusal yet"
        assert any(abs(line.get_xdata()[0] - (first_claim + 0.01)) < 1e-9 for line in ax.lines)
    finally:
        plt.close(fig)
    box = job_lanes.scrub(lives)
    assert box.children[0].children[1].max >= float(lives.events["s"].max())


def _is(collection: object, colour: str) -> bool:
    from matplotlib.colors import to_rgba

    faces = collection.get_facecolors()  # type: ignore[attr-defined]
    return len(faces) > 0 and tuple(faces[0]) == to_rgba(colour)
