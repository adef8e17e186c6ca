"""The course modules of notebooks 15 and 16, against a real server: each exercise check
passes its solution and catches plausible wrong answers, symptom first and the fragment only
at the second slip of a kind; the races the notebooks show come out as they say."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import pgqueue
from pgqueue import Job, Queue
from pgqueue.course import limits_lab, periodic_lab, steps_lab
from pgqueue.course.checks import ExerciseFailed, nb15, nb16
from pgqueue.course.checks.tiers import Hints

TICK = """
WITH taken AS (
  INSERT INTO my_slots (schedule, slot, job_id)
  VALUES (%(schedule)s, %(slot)s, nextval('jobs_id_seq'))
  ON CONFLICT (schedule, slot) DO NOTHING
  RETURNING job_id, slot
)
INSERT INTO jobs (id, queue, payload)
SELECT job_id, 'ticks', jsonb_build_object('schedule', %(schedule)s::text, 'slot', slot)
FROM taken
"""
CHECK_THEN_INSERT = """
INSERT INTO jobs (queue, payload)
SELECT 'ticks', jsonb_build_object('schedule', %(schedule)s::text, 'slot', %(slot)s)
WHERE NOT EXISTS (SELECT FROM jobs WHERE payload->>'schedule' = %(schedule)s
                    AND (payload->>'slot')::timestamptz = %(slot)s)
"""
JOB_FIRST = """
WITH job AS (
  INSERT INTO jobs (queue, payload)
  VALUES ('ticks', jsonb_build_object('schedule', %(schedule)s::text, 'slot', %(slot)s))
  RETURNING id
)
INSERT INTO my_slots SELECT %(schedule)s, %(slot)s, id FROM job ON CONFLICT DO NOTHING
"""
STEP_PUT = """
WITH held AS (
  SELECT id, fence FROM jobs
  WHERE id = %(job)s AND fence = %(fence)s AND status = 'running'
    AND lease_until > clock_timestamp()
  FOR SHARE
)
INSERT INTO pgqueue_steps (job_id, name, output, fence, written_at)
SELECT id, %(name)s, %(output)s, fence, clock_timestamp() FROM held
ON CONFLICT (job_id, name) DO NOTHING
"""


def failures(check: Any, *args: Any) -> list[str]:
    """The messages of two runs of a check that must fail."""
    found = []
    for _ in range(2):
        with pytest.raises(ExerciseFailed) as info:
            check(*args)
        found.append(str(info.value))
    return found


def test_hints_give_the_symptom_first_and_the_fragment_at_the_second_slip() -> None:
    hints = Hints()
    with pytest.raises(ExerciseFailed, match=r"^two jobs \(fix it") as first:
        hints.fail("twice", "two jobs", "ON CONFLICT")
    assert "ON CONFLICT" not in str(first.value)
    with pytest.raises(ExerciseFailed, match=r"^no job \(fix it"):
        hints.fail("none", "no job", "INSERT")  # another kind starts at its symptom
    with pytest.raises(ExerciseFailed, match=r"^two jobs\. Hint: ON CONFLICT$"):
        hints.fail("twice", "two jobs", "ON CONFLICT")
    hints.expect(True, "twice", "unused", "unused")


def test_the_tick_check_passes_the_solution_and_catches_the_races(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nb15.check_tick(TICK, dsn)
    assert capsys.readouterr().out.startswith("\N{CHECK MARK} two ticks of one slot")
    first, second = failures(nb15.check_tick, CHECK_THEN_INSERT, dsn)
    assert "left 0 rows in my_slots and 2 job(s)" in first and "Hint" not in first
    assert "Hint: INSERT INTO my_slots" in second
    first, second = failures(nb15.check_tick, JOB_FIRST, dsn)
    assert "made 2 jobs and my_slots kept one row" in first and "Hint" not in first
    assert "Hint: make the job FROM the slot insert's RETURNING" in second
    without = TICK.replace("ON CONFLICT (schedule, slot) DO NOTHING", "")
    assert "unique_violation" in failures(nb15.check_tick, without, dsn)[0]
    assert pgqueue.Queue(dsn).stats()[0]["status"] == "finished"  # the check left no job
    # A right tick but an empty payload: a job was made, just not findable by its keys (told
    # "made no job in jobs" before)
    empty = TICK.replace(
        "jsonb_build_object('schedule', %(schedule)s::text, 'slot', slot)", "'{}'::jsonb"
    )
    first, _ = failures(nb15.check_tick, empty, dsn)
    assert "with the payload {}" in first and "made no job" not in first
    assert pgqueue.Queue(dsn).stats()[0]["status"] == "finished"  # nor the empty ones


def test_the_step_check_passes_the_solution_and_tells_the_lock_slips_apart(dsn: str) -> None:
    nb16.check_step_put(STEP_PUT, dsn)
    now = STEP_PUT.replace("lease_until > clock_timestamp()", "lease_until > now()")
    assert (
        "a step written after the lease ran out was stored"
        in failures(nb16.check_step_put, now, dsn)[0]
    )
    key_share = failures(nb16.check_step_put, STEP_PUT.replace("FOR SHARE", "FOR KEY SHARE"), dsn)
    no_lock = failures(nb16.check_step_put, STEP_PUT.replace("FOR SHARE", ""), dsn)
    assert "a cancel of job" in key_share[0] and "Hint" not in key_share[0]
    assert "Hint: FOR KEY SHARE lets an UPDATE" in key_share[1]
    assert "Hint: lock the job row in the check" in no_lock[1]
    stale = STEP_PUT.replace("AND fence = %(fence)s", "")
    assert "a stale holder (fence 1" in failures(nb16.check_step_put, stale, dsn)[0]


def finish(q: Queue, job: Job, cents: int) -> bool:
    with q.conn.transaction():
        q.conn.execute("INSERT INTO invoices (job_id, cents) VALUES (%s, %s)", [job.id, cents])
        if not q.complete(job):
            raise pgqueue.LeaseLost("taken over")
    return True


def two_commits(q: Queue, job: Job, cents: int) -> bool:
    q.conn.execute("INSERT INTO invoices (job_id, cents) VALUES (%s, %s)", [job.id, cents])
    return q.complete(job)


def complete_first(q: Queue, job: Job, cents: int) -> bool:
    if not q.complete(job):
        return False
    q.conn.execute("INSERT INTO invoices (job_id, cents) VALUES (%s, %s)", [job.id, cents])
    return True


def test_the_finish_check_passes_one_transaction_and_catches_two(dsn: str) -> None:
    nb16.check_finish(finish, dsn)
    assert "left its invoice (700,) behind" in failures(nb16.check_finish, two_commits, dsn)[0]
    message = failures(nb16.check_finish, complete_first, dsn)[0]
    assert "failed, and the job is 'done'" in message


def test_a_count_then_claim_limit_of_one_runs_two_and_the_slots_run_one(dsn: str) -> None:
    race = limits_lab.two_claims_in_flight(dsn, per_group=1)
    naive, slots = race.loc["count, then claim"], race.loc["pgqueue's slots"]
    assert (naive["A got"], naive["B got (A in flight)"]) == (["job 1"], ["job 2"])
    assert naive["running of tenant-a (limit 1)"] == 2
    assert (slots["A got"], slots["B got (A in flight)"]) == (["job 1"], [])
    assert slots["running of tenant-a (limit 1)"] == 1


def test_one_slot_ticked_twice_at_once_and_by_a_stale_worker_makes_one_job(dsn: str) -> None:
    assert periodic_lab.one_slot_two_tickers(dsn) == {
        "first": 1,
        "second, at the same moment": 0,
        "stale, cursor set back": 0,
        "jobs for the slot": 1,
    }


def test_the_result_waits_are_drawn_with_their_polls_and_marks() -> None:
    import matplotlib.pyplot as plt

    def wait(poll: float, returned: float) -> dict[str, Any]:
        at = {"result() called": 100.0, "handler returned": 100.2, "job row done": 100.21}
        return {
            "result": {"sum": 5},
            "at": at | {"result() returned": 100.0 + returned},
            "poll every (s)": poll,
        }

    waits = {"LISTEN, poll 5 s": wait(5.0, 0.25), "poll 1 s only": wait(1.0, 1.0)}
    assert abs(steps_lab.waited(waits["poll 1 s only"]) - 0.8) < 1e-9
    fig = steps_lab.draw_result_waits(waits)
    [ax] = fig.axes
    assert ax.get_title() and ax.get_xlabel().endswith("(s)") and ax.get_ylabel()
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"handler returned", "job row done", "result() returned"} <= legend
    assert "a poll due (poll_interval)" in legend
    assert [t.get_text() for t in ax.get_yticklabels()] == list(waits)
    plt.close(fig)


def test_the_chaos_trace_never_counts_a_done_jobs_finishing_run_as_lost() -> None:
    """A job done at its second attempt whose first claim was cut before its handler
    started has one start: the run that finished it. That start is the re-run, and the lost
    attempt is the unstarted claim, traced to the fault before it (the chaos checks' rule).
    Before, the finishing run was counted as the lost attempt, with no re-run and no fault."""
    import pandas as pd

    from pgqueue.course import chaos_view

    t0 = pd.Timestamp("2026-12-02 01:00:00", tz="UTC")
    jobs = pd.DataFrame({"id": [7], "status": ["done"], "attempts": [2]})
    runs = pd.DataFrame(
        {
            "job_id": [7],
            "fence": [2],
            "worker": ["w2"],
            "started_at": [t0 + pd.Timedelta(seconds=5)],
        }
    )
    faults = pd.DataFrame({"kind": ["kill"], "worker": ["w1"], "at": [t0], "detail": [""]})
    traced = chaos_view.trace(jobs, runs, faults)
    assert len(traced) == 1
    row = traced.iloc[0]
    assert row["lost_worker"] == chaos_view.UNSTARTED and row["rerun_worker"] == "w2"
    assert row["cause"] == "kill" and row["fault_worker"] == "w1"


def test_the_chaos_figure_draws_each_rerun_jobs_fences_and_the_refused_late_write(
    tmp_path: Path,
) -> None:
    """Notebook 17's capstone figure: below the worker lanes, a lane per job run twice with
    its fence as a step, and the late write a worker logged as refused, at its stale fence.
    The refusals are read from the worker logs in the engine's own words."""
    import matplotlib
    import pandas as pd

    from pgqueue.course import chaos_view
    from pgqueue.tools.chaos import Report

    matplotlib.use("Agg")
    (tmp_path / "chaos-1.1.log").write_text(
        "2026-12-02 01:00:21,500 pgqueue.engine chaos-1.1: late fail of job 7 refused: "
        "fence 1 is stale (another holder has it)\n"
        "2026-12-02 01:00:22,000 pgqueue.engine something else\n"
    )
    refused = chaos_view.refused_writes(tmp_path)
    assert list(refused[["worker", "job_id", "fence", "action"]].itertuples(index=False)) == [
        ("chaos-1.1", 7, 1, "fail")
    ]
    assert chaos_view.refused_writes(None).empty

    t0 = pd.Timestamp(refused["at"].iloc[0]) - pd.Timedelta(seconds=20)
    run = chaos_view.ChaosRun(
        report=Report(seed=1, queue="q", workers=2, jobs=2, lease=3.0, restart_enabled=False),
        lines=[],
        jobs=pd.DataFrame(
            {
                "id": [7, 8],
                "status": ["done", "done"],
                "attempts": [2, 1],
                "max_attempts": [5, 5],
                "fence": [2, 1],
            }
        ),
        runs=pd.DataFrame(
            {
                "job_id": [7, 8, 7],
                "fence": [1, 1, 2],
                "worker": ["chaos-1.1", "chaos-0.1", "chaos-0.1"],
                "started_at": [t0 + pd.Timedelta(seconds=s) for s in (1, 2, 15)],
            }
        ),
        faults=pd.DataFrame(
            {
                "kind": ["stop"],
                "worker": ["chaos-1.1"],
                "at": [t0 + pd.Timedelta(seconds=3)],
                "detail": ["12s"],
            }
        ),
        results=pd.DataFrame(columns=["job_id", "worker", "fence", "history"]),
    )
    run.reruns = chaos_view.trace(run.jobs, run.runs, run.faults)
    run.refused = refused
    fig = chaos_view.plot_run(run)
    _workers, fences, scale = fig.axes
    assert [t.get_text() for t in fences.get_yticklabels()] == ["job #7"]  # job 8 ran once
    [step] = [line for line in fences.lines if line.get_drawstyle() == "steps-post"]
    assert len(set(step.get_ydata())) == 2, "fence 1, then 2: one rise"
    [cross] = [c for c in fences.collections if c.get_offsets().shape == (1, 2)
               and tuple(c.get_facecolors()[0]) == matplotlib.colors.to_rgba("red")]  # fmt: skip
    x, y = cross.get_offsets()[0]
    # 20 s after t0, which is 1 s before the first start (the axis's zero)
    assert abs(x - 19.0) < 0.01 and y < max(step.get_ydata()), "at 19 s, under the step to 2"
    assert fences.get_legend() is not None and scale.get_ylabel() == "fence"
    matplotlib.pyplot.close(fig)


def test_16_a_step_checked_on_now_in_a_long_transaction_is_stored_late(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "now()" in nb16.with_now(STEP_PUT) and "lease_until > clock" not in nb16.with_now(
        STEP_PUT
    )
    nb16.check_step_put_with_now(dsn, STEP_PUT, {"stored": True})
    assert "was stored" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="the moment the transaction began"):
        nb16.check_step_put_with_now(dsn, STEP_PUT, {"stored": False})
