"""What the dashboard changes: retry a dead job, cancel a ready or running one, delete a
finished one, each for one job or for every job matching a filter; pause and resume a
queue (``AsyncQueue.pause``: the claim statement itself skips a paused queue, on every
worker); and run a periodic schedule now.

One job goes through the library (``AsyncQueue.retry_dead``, ``AsyncQueue.cancel``: a
running job's fence rises, so its holder is refused from then on). A filter's jobs go in
batches of ``BATCH`` ids, one short transaction each (never one statement over millions of
rows that holds back vacuum): the ids are read newest first below a cursor, then changed
by one statement that checks each job's status again (``retry_dead_ids``, and
``AsyncQueue.cancel_many`` and ``dashboard.sql``'s ``delete_finished``). Jobs added after the action
began are left alone: it starts below the newest id of its first look.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import KeyRace
from .filters import Filter, Refused, bulk_statuses
from .store import Conn, Store

log = logging.getLogger("pgqueue.dashboard")

BATCH = 1000  # ids a statement, and a transaction, of a bulk action


async def one(store: Store, name: str, job_id: int, who: str) -> dict[str, Any]:
    """Apply action ``name`` to one job; a 404 or 409 saying why if it does not apply."""
    async with store.transaction() as c:
        if name == "retry":
            retried = await _retry(c, [job_id])
            if job_id not in retried:
                for left in retried.skipped:
                    raise Refused(
                        409,
                        f"job {job_id} stays dead: its key {left.key!r} is held by job "
                        f"{left.held_by}; let that one finish or cancel it, then retry",
                    )
                raise await _not_for(c, job_id, "retried", "dead")
        elif name == "cancel":
            if not await c.queue.cancel(job_id):
                raise await _not_for(c, job_id, "cancelled", "ready or running")
        else:
            if not await c.rows("delete_finished", {"ids": [job_id]}):
                raise await _not_for(c, job_id, "deleted", "done, dead or cancelled")
        state = await c.queue.get(job_id)
    log.info("%s: %s job %d", who, name, job_id)
    return {"id": job_id, "action": name, "status": None if state is None else state.status}


async def bulk(store: Store, name: str, chosen: Filter, who: str) -> dict[str, Any]:
    """Apply action ``name`` to every job matching ``chosen`` now (of the statuses it
    applies to), ``BATCH`` ids a transaction; return how many it changed and skipped."""
    statuses = bulk_statuses(name, chosen)
    if chosen.queue is not None and not await store.known_queue(chosen.queue):
        raise Refused(404, f"no job has queue {chosen.queue!r}: check its name")
    async with store.transaction() as c:
        _, _, newest = await c.one("clock", {})
    before, changed, skipped, batches = int(newest) + 1, 0, [], 0
    params = chosen.params(store.hide_payload) | {"statuses": list(statuses), "limit": BATCH}
    while True:
        async with store.transaction() as c:
            ids = [r[0] for r in await c.rows("matching_ids", params | {"before": before})]
            if not ids:
                break
            before = min(ids)
            batches += 1
            if name == "retry":
                retried = await _retry(c, ids)
                changed += len(retried)
                skipped += [left._asdict() for left in retried.skipped]
            elif name == "cancel":
                changed += len(await c.queue.cancel_many(ids))
            else:
                changed += len(await c.rows("delete_finished", {"ids": ids}))
    log.info("%s: %s %d job(s) matching %s", who, name, changed, chosen.query() or "everything")
    return {
        "action": name,
        "filter": chosen.query(),
        "changed": changed,
        "skipped": skipped,
        "batches": batches,
    }


async def queue_action(store: Store, name: str, queue: str, who: str) -> dict[str, Any]:
    """Pause or resume ``queue``; a 404 for a queue no job and no pause names, a 409 for a
    pause or resume that changes nothing."""
    async with store.transaction() as c:
        paused = await c.queue.paused()
    if queue not in paused and not await store.known_queue(queue):
        raise Refused(404, f"no job has queue {queue!r} and it is not paused: check its name")
    async with store.transaction() as c:
        changed = await (c.queue.pause(queue) if name == "pause" else c.queue.resume(queue))
    if not changed:
        state = "paused already" if name == "pause" else "not paused"
        raise Refused(409, f"queue {queue!r} is {state}; nothing changed")
    log.info("%s: %s queue %s", who, name, queue)
    return {"queue": queue, "action": name, "paused": name == "pause"}


async def run_schedule(store: Store, name: str, who: str) -> dict[str, Any]:
    """One job for schedule ``name`` now, in the slot of this second (one job a slot)."""
    if not name or len(name) > 200:
        raise Refused(400, "a schedule's name is a text of 1 to 200 characters")
    async with store.transaction() as c:
        exists, model, slot, made, holder = await c.one("run_schedule", {"name": name})
    if not exists:
        raise Refused(404, f"no schedule {name!r}: a worker adds it at its first tick")
    if not model:
        raise Refused(
            409,
            f"no job of schedule {name!r} is left to copy its task from (the schedules table "
            "does not record it): wait for its next slot, then run it again",
        )
    if made is None:
        raise Refused(409, f"slot {slot.isoformat()} of {name!r} has a job already: {holder}")
    log.info("%s: ran schedule %s now: job %d", who, name, made)
    return {"schedule": name, "slot": slot.isoformat(), "id": made}


async def _retry(c: Conn, ids: list[int]) -> Any:
    try:
        return await c.queue.retry_dead(ids=ids)
    except KeyRace:
        raise Refused(409, "a key of these jobs was taken meanwhile: try again") from None


async def _not_for(c: Conn, job_id: int, done: str, statuses: str) -> Refused:
    state = await c.queue.get(job_id)
    if state is None:
        return Refused(404, f"no job {job_id}: it never existed, or was deleted or pruned")
    return Refused(
        409, f"job {job_id} is {state.status}: only {statuses} jobs are {done}; nothing changed"
    )
