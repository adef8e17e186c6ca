"""Durable steps: the checks and replies of ``Job.step`` and ``AsyncJob.step``, shared so
the two cannot drift apart.

A step is a named part of a job's work whose JSON output is stored in ``pgqueue_steps``
under the claim (``step_put`` in ``sql/queries.sql``: the fence, status and lease are
checked, and the job row locked ``FOR SHARE``, in the statement that writes the step). A
later attempt of the job reads the stored output instead of running the step again, so a
job killed after two of three steps resumes at the third. A holder whose claim is over
stores nothing and gets ``LeaseLost``.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb

from .errors import BadInput, LeaseLost, NotInstalled

MAX_NAME = 200  # characters of a step name
_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False)
# A NUL in JSON text as Python's encoder writes it: \u0000 after an even number of
# backslashes (none, or escaped backslashes). After an odd number it is a backslash, then
# the characters u0000: valid text, which jsonb stores.
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def holds_nul(json_text: str) -> bool:
    """Whether JSON text made by ``json`` holds a NUL character, which jsonb cannot store."""
    return "\\u0000" in json_text and _NUL.search(json_text) is not None


class StepState(NamedTuple):
    """One stored step of a job (``Queue.steps``): its name, the fence of the claim that
    wrote it, when, and its output."""

    name: str
    fence: int
    written_at: datetime
    output: Any


def step_name(job_id: int, name: object) -> str:
    """``name`` if it is a step name: non-empty text, one line, no NUL, valid UTF-8."""
    if (
        not isinstance(name, str)
        or not name.strip()
        or len(name) > MAX_NAME
        or any(c in name for c in "\x00\n\r")
    ):
        raise BadInput(
            f"job {job_id}: a step name must be non-empty text of one line and at most "
            f"{MAX_NAME} characters, got {name!r}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"job {job_id}: step name {name!r} is not valid UTF-8 text") from None
    return name


def encode(job_id: int, name: str, output: object) -> tuple[Jsonb, Any]:
    """The output of step ``name`` as the statement sends it, and as a later attempt will
    read it back (tuples become lists, keys text): what ``step()`` returns either way.
    Not JSON: ``BadInput`` naming the step, so the handler raises it and nothing is stored."""
    where = f"job {job_id}: step {name!r} returned"
    try:
        text = _JSON.encode(output)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadInput(
            f"{where} {type(output).__name__}, which is not JSON ({exc}); return a JSON value"
        ) from None
    if holds_nul(text):
        raise BadInput(f"{where} text with a NUL character (\\u0000), which jsonb cannot store")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"{where} text that is not valid UTF-8 (lone surrogates)") from None
    return Jsonb(output, dumps=lambda _: data), json.loads(text)


def put_statement(in_job_transaction: bool) -> str:
    """The statement that stores a step: ``step_put`` locks the job row for the rest of its
    transaction; inside ``job.transaction()``, whose commit checks and holds the claim
    itself, ``step_put_held`` checks without a lock, so heartbeats are not held up."""
    return "step_put_held" if in_job_transaction else "step_put"


def put_params(job_id: int, fence: int, name: str, output: Jsonb) -> dict[str, Any]:
    return {"job": job_id, "fence": fence, "name": name, "output": output}


def refused(job_id: int, fence: int, name: str) -> LeaseLost:
    """What a step whose write the claim check refused raises."""
    return LeaseLost(
        f"job {job_id}: step {name!r} was not stored: the claim with fence {fence} is over "
        "(taken over, cancelled, failed, reaped or its lease ran out); discard this work"
    )


def stale(job_id: int, fence: int, name: str) -> LeaseLost:
    """What a step of a job already known lost raises, with no round trip."""
    return LeaseLost(f"job {job_id}: fence {fence} is stale; step {name!r} not run")


def missing(exc: psycopg.errors.UndefinedTable) -> NotInstalled | None:
    """A missing ``pgqueue_steps`` as a one-line error (None: another table is missing)."""
    if "pgqueue_steps" not in str(exc):
        return None
    return NotInstalled(
        "pgqueue_steps does not exist: this database was installed by an older pgqueue; "
        "run `pgqueue init` (or Queue.install()) to add it"
    )
