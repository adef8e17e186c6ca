"""How a Django task is kept as a pgqueue job, and read back as a ``TaskResult``.

Nothing is added to pgqueue's schema. The job's payload holds what enqueue knew::

    {"django": {"task": "myapp.tasks.send", "backend": "default", "queue": "default",
                "priority": 0, "run_after": null, "args": [...], "kwargs": {...},
                "enqueued_at": "2026-12-01T22:00:00.123456+00:00"}}

Each claim a worker runs stores a durable step ``attempt F`` (F: the claim's fence)
with the worker's id and when the claim began, and each attempt that raised a step
``error F`` with the exception's class path and traceback: both are written under the
claim, so a stale holder writes neither. The job's status, ``started_at``, ``finished_at``,
``last_error`` and ``result`` columns are the rest. ``task_result`` builds the
``TaskResult`` from these alone, so every process reads the same one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.utils import timezone
from django.utils.module_loading import import_string

from pgqueue.queue import JobState
from pgqueue.steps import StepState

ATTEMPT = "attempt "  # + the claim's fence: {"worker_id": ..., "started_at": ...}
ERROR = "error "  # + the claim's fence: {"exception_class_path": ..., "traceback": ...}

STATUS = {
    "ready": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "done": TaskResultStatus.SUCCESSFUL,
    "dead": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


def payload(task: Task, result: TaskResult, enqueued_at: datetime) -> dict[str, Any]:
    """The job payload of a task enqueued at ``enqueued_at`` (the server's clock)."""
    return {
        "django": {
            "task": task.module_path,
            "backend": result.backend,
            "queue": task.queue_name,
            "priority": task.priority,
            "run_after": _text(task.run_after),
            "args": result.args,
            "kwargs": result.kwargs,
            "enqueued_at": _text(enqueued_at),
        }
    }


def fields(state_payload: object, job_id: int) -> dict[str, Any]:
    """The Django part of a job's payload; ``TaskResultDoesNotExist`` if it has none."""
    data = state_payload.get("django") if isinstance(state_payload, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("task"), str):
        raise TaskResultDoesNotExist(f"job {job_id} is not a Django task")
    return data


def load_task(data: dict[str, Any]) -> Task:
    """The task a job names, with the options it was enqueued with. Only a
    ``django.tasks.Task`` is ever returned: a path naming anything else (``os.system``)
    raises ``InvalidTask`` and nothing is called; one that cannot be imported raises the
    import error."""
    path = data["task"]
    found = import_string(path)  # ImportError: the worker fails the task with it
    if not isinstance(found, Task):
        raise InvalidTask(
            f"{path!r} is a {type(found).__name__}, not a django.tasks Task: refused "
            "(a worker runs only tasks)"
        )
    try:
        return found.using(
            priority=int(data["priority"]),
            queue_name=str(data["queue"]),
            backend=str(data["backend"]),
            run_after=_time(data.get("run_after")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidTask(f"job for {path!r} has a malformed payload: {exc!r}") from None


def task_result(task: Task, state: JobState, steps: list[StepState]) -> TaskResult:
    """The ``TaskResult`` of job ``state`` of ``task``, from the row and its steps."""
    data = fields(state.payload, state.id)
    attempts = sorted((s for s in steps if s.name.startswith(ATTEMPT)), key=lambda s: s.fence)
    failures = sorted((s for s in steps if s.name.startswith(ERROR)), key=lambda s: s.fence)
    errors = [
        TaskError(
            exception_class_path=str(s.output["exception_class_path"]),
            traceback=str(s.output["traceback"]),
        )
        for s in failures
    ]
    status = STATUS[state.status]
    last_claim = attempts[-1].fence if attempts else None
    unexplained = not failures or (last_claim is not None and failures[-1].fence < last_claim)
    if status == TaskResultStatus.FAILED and unexplained:
        # It ended without an exception of its own: a timeout, a lease that ran out on
        # the last attempt, a cancel. last_error says which.
        errors.append(
            TaskError(
                exception_class_path="pgqueue.errors.JobFailed",
                traceback=state.last_error or f"job {state.id} was {state.status}",
            )
        )
    first = _time(attempts[0].output.get("started_at")) if attempts else None
    result = TaskResult(
        task=task,
        id=str(state.id),
        status=status,
        enqueued_at=_time(data.get("enqueued_at")),
        started_at=first or _django_time(state.started_at),
        finished_at=_django_time(state.finished_at) if status in _ENDED else None,
        last_attempted_at=_django_time(state.started_at),
        args=data.get("args", []),
        kwargs=data.get("kwargs", {}),
        backend=str(data["backend"]),
        errors=errors,
        worker_ids=[str(s.output.get("worker_id")) for s in attempts],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", state.result)
    return result


_ENDED = (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)


def _text(when: datetime | None) -> str | None:
    """A time as stored: ISO 8601 with its offset (a naive one is in Django's zone)."""
    if when is None:
        return None
    if timezone.is_naive(when):
        when = timezone.make_aware(when)
    return when.isoformat()


def _time(text: object) -> datetime | None:
    return _django_time(datetime.fromisoformat(text)) if isinstance(text, str) else None


def _django_time(when: datetime | None) -> datetime | None:
    """A time as Django hands them out: aware with USE_TZ, else naive in its zone."""
    if when is None:
        return None
    from django.conf import settings

    if settings.USE_TZ:
        return timezone.make_aware(when) if timezone.is_naive(when) else when
    return timezone.make_naive(when) if timezone.is_aware(when) else when


def as_django_time(when: datetime) -> datetime:
    """``_django_time`` for a time that is known."""
    found = _django_time(when)
    assert found is not None
    return found
