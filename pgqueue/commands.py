"""The ``pgqueue`` commands that read or change the jobs table (init, enqueue, limit, pause,
resume, reap, stats, prune, retry-dead, cancel, show): each a function of the parsed command
line, on a ``Queue`` of its own. ``cli.py`` parses the line and runs the workers."""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone
from typing import Any

from .db import first_line, resolve_dsn
from .errors import BadInput, NotInstalled, PgQueueError
from .queue import Queue, ScheduleState


class UsageError(PgQueueError):
    """The command line itself is wrong (exit code 2)."""


def _queue(args: argparse.Namespace) -> Queue:
    return Queue(resolve_dsn(args.dsn))


def cmd_init(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        done = q.install(notify=args.notify, lock_timeout=args.lock_timeout)
    for change in done.changed:
        print(change)
    print("jobs table ready" + ("" if done.notify else " (no NOTIFY: workers poll)"))


def enqueue_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """The queue and the payload (None: read stdin) of ``pgqueue enqueue``, from the queue
    given positionally (as before) or with ``--queue`` (as ``worker`` takes it). With
    ``--queue``, a lone positional is the payload, unless it names the same queue."""
    given, first, second = args.queue_option, args.queue, args.payload
    if given is None:
        if first is None:
            raise UsageError("name the queue: pgqueue enqueue QUEUE [PAYLOAD] (or --queue QUEUE)")
        return first, second
    if first is None or second is not None or first == given:
        if first is not None and first != given:
            raise UsageError(
                f"the queue is named twice, differently: {first!r} and --queue {given!r}; "
                "give it once"
            )
        return given, second
    if first.lstrip().startswith(("{", "[", '"')):
        return given, first  # the payload: --queue named the queue
    raise UsageError(
        f"the queue is named twice, differently: {first!r} and --queue {given!r}; give it once"
    )


def cmd_enqueue(args: argparse.Namespace) -> None:
    try:
        queue_name, payload = enqueue_target(args)
    except UsageError as exc:
        args.usage_error(str(exc))  # prints the command's usage and exits 2
    if payload is not None:
        payloads = [_parse_json(payload, "payload")]
    else:
        payloads = []
        for number, raw in enumerate(sys.stdin.buffer, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise BadInput(
                    f"stdin line {number} is not valid UTF-8; nothing was enqueued"
                ) from None
            if line:
                payloads.append(_parse_json(line, f"stdin line {number}"))
    if args.key is not None and len(payloads) != 1:
        raise UsageError("--key names one job: give one payload, not lines on stdin")
    with _queue(args) as q:
        ids = q.enqueue_many(
            payloads,
            queue=queue_name,
            delay=args.delay,
            max_attempts=args.max_attempts,
            priority=args.priority,
            keys=None if args.key is None else [args.key],
            group=args.group,
        )
    print(
        f"enqueued {len(ids)} job(s) on {queue_name!r}"
        + (f": id {ids[0]}" if len(ids) == 1 else "")
    )


def cmd_limit(args: argparse.Namespace) -> None:
    if args.queue is None and (args.per_group is not None or args.remove):
        raise UsageError("name the queue: pgqueue limit QUEUE --per-group N (or --remove)")
    with _queue(args) as q:
        if args.per_group is not None or args.remove:
            q.limit(args.queue, per_group=None if args.remove else args.per_group)
        limits = q.limits()
    if args.remove:
        print(f"{args.queue!r}: no limit")
        return
    shown = [lim for lim in limits if args.queue in (None, lim.queue)]
    if args.queue is not None and not shown:
        print(f"{args.queue!r}: no limit")
    elif not shown:
        print("no queue has a per-group limit")
    for lim in shown:
        print(
            f"{lim.queue!r}: at most {lim.per_group} running per group "
            f"({lim.running} running under it now)"
        )


def cmd_pause(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        newly = q.pause(args.queue) if args.queue is not None else None
        paused = q.paused()
    if args.queue is not None:
        state = "paused" if newly else "was paused already"
        print(f"{args.queue!r}: {state}: no worker claims from it until `pgqueue resume`")
        return
    if not paused:
        print("no queue is paused")
    for name, since in paused.items():
        print(f"{name!r}: paused since {_utc(since)}")


def cmd_resume(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        was = q.resume(args.queue)
    print(f"{args.queue!r}: {'resumed' if was else 'was not paused'}: workers claim from it")


def _parse_json(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"{where} is not JSON ({exc.msg} at column {exc.colno}); nothing was enqueued"
        ) from None
    except RecursionError:
        raise BadInput(
            f"{where} is nested too deeply for Python to read (arrays or objects inside "
            f"each other, about {sys.getrecursionlimit()} levels at most); flatten it; "
            "nothing was enqueued"
        ) from None
    except ValueError as exc:  # an integer past Python's int-string conversion limit
        digits = re.search(r"limit \((\d+) digits\).*value has (\d+) digits", str(exc))
        detail = f"{digits[2]} digits, at most {digits[1]}" if digits else first_line(exc)
        raise BadInput(
            f"{where} has an integer too long for Python to read ({detail}); "
            "send it as a string; nothing was enqueued"
        ) from None
    if not isinstance(value, dict):
        raise BadInput(f'{where} must be a JSON object like \'{{"to": "a@example.com"}}\'')
    return value


def cmd_reap(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        reaped = q.reap()
    dead = sum(r.status == "dead" for r in reaped)
    print(f"reaped {len(reaped)} job(s): {len(reaped) - dead} ready again, {dead} dead")


def cmd_stats(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        rows = q.stats(exact=args.exact)
        try:
            schedules = q.schedules()
        except NotInstalled:  # installed before periodic jobs: so none
            schedules = []
        try:
            paused = q.paused()
        except NotInstalled:  # installed before pausing: so none
            paused = {}
    if args.json:
        stopped = [
            {"queue": name, "status": "paused", "since": since} for name, since in paused.items()
        ]
        print(json.dumps(rows + [_schedule_row(s) for s in schedules] + stopped, default=str))
        return
    counted = [r for r in rows if not r["estimated"]]
    if not counted:
        print("no jobs ready, running or dead" if not args.exact else "no jobs")
    else:
        print(f"{'queue':<20} {'status':<9} {'jobs':>8} {'oldest ready (s)':>17}  latest error")
        for row in counted:
            age = row["oldest_ready_seconds"]
            age_text = "" if age is None else f"{age:.1f}"
            error = (row["latest_error"] or "").splitlines()[0][:60] if row["latest_error"] else ""
            print(f"{row['queue']:<20} {row['status']:<9} {row['jobs']:>8} {age_text:>17}  {error}")
    for row in rows:
        if row["estimated"]:
            print(f"finished (done or cancelled), all queues, {_finished_text(row)}")
    for s in schedules:
        last, following = _utc(s.last_slot), _utc(s.next_slot) if s.next_slot else "unknown"
        print(f"schedule {s.name} ({s.spec}) on {s.queue!r}: last slot {last}, next {following}")
    for name, since in paused.items():
        print(f"queue {name!r} is paused since {_utc(since)} (pgqueue resume {name})")


def _finished_text(row: dict[str, Any]) -> str:
    if row["jobs"] is None:  # never analyzed, and too big to count on every call
        return "estimated: unknown until the table is analyzed (ANALYZE jobs; autovacuum will)"
    return f"{'counted' if row.get('counted') else 'estimated'}: {row['jobs']}"


def _utc(t: datetime) -> str:
    return f"{t.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def _schedule_row(s: ScheduleState) -> dict[str, Any]:
    """A schedule as ``stats --json`` lists it: a row of status 'schedule'."""
    return {
        "queue": s.queue,
        "status": "schedule",
        "jobs": None,
        "oldest_ready_seconds": None,
        "latest_error": None,
        "estimated": False,
        "schedule": s.name,
        "spec": s.spec,
        "last_slot": s.last_slot.isoformat(),
        "next_slot": s.next_slot.isoformat() if s.next_slot else None,
    }


def cmd_prune(args: argparse.Namespace) -> None:
    def progress(done: int, total: int) -> None:
        if args.verbose:
            print(f"  {done}/{total} ids", file=sys.stderr)

    with _queue(args) as q:
        count = q.prune(args.older_than, archive=args.archive, batch=args.batch, progress=progress)
    print(f"{'archived' if args.archive else 'deleted'} {count} finished job(s)")


def cmd_retry_dead(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        ids = q.retry_dead(args.queue, ids=args.ids, extra=args.extra)
    where = f"on {args.queue or 'default'!r}" if args.ids is None else "of the ids given"
    print(f"requeued {len(ids)} dead job(s) {where}")
    if ids.skipped:
        held = (f"job {j.id} (key {j.key!r} is held by job {j.held_by})" for j in ids.skipped)
        print(f"left dead: {', '.join(held)}; let the holder finish or cancel it, then retry")
    left = {j.id for j in ids.skipped}
    if args.ids is not None and (skipped := sorted(set(args.ids) - set(ids) - left)):
        print(f"not dead (or not found{' in that queue' if args.queue else ''}): {skipped}")


def cmd_cancel(args: argparse.Namespace) -> int:
    with _queue(args) as q:
        results = {job_id: q.cancel(job_id) for job_id in args.ids}
    for job_id, cancelled in results.items():
        print(f"job {job_id}: {'cancelled' if cancelled else 'not ready or running; unchanged'}")
    return 0 if all(results.values()) else 1


def cmd_show(args: argparse.Namespace) -> None:
    with _queue(args) as q:
        job = q.get(args.id)
        steps = [] if job is None else q.steps(args.id)
    if job is None:
        raise PgQueueError(f"no job {args.id}")
    fields = job._asdict()
    if args.json:
        fields["steps"] = [step._asdict() for step in steps]
        print(json.dumps(fields, default=str))
        return
    trace = fields.pop("traceback")
    for name, value in fields.items():
        print(f"{name:<13} {json.dumps(value) if name in ('payload', 'result') else value}")
    if trace:  # where the last failed attempt raised, as Python printed it
        print(f"{'traceback':<13} (the last failed attempt's)")
        print("".join(f"  {line}" for line in trace.splitlines(keepends=True)).rstrip())
    # The durable steps it stored (Job.step), oldest first: name, fence, when.
    print(f"{'steps':<13} {len(steps)}")
    for step in steps:
        print(f"  {step.name}  fence {step.fence}  {step.written_at}")
