"""OpenTelemetry spans of jobs: one ``process <queue>`` span (kind CONSUMER) around each
handler run, with the messaging attributes, current while the handler runs (so its own
spans are its children), marked as an error when the handler raises (a timed-out async
handler's cancellation too).

Nothing at all without ``opentelemetry-api`` (``pip install -e ".[otel]"`` in the pgqueue
clone), or while no tracer provider is configured when the worker starts: then a job costs
one call of ``no_span`` and no span is made. ``opentelemetry`` is imported only when a
worker starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .job import Job

SpanFor = Callable[[Job], AbstractContextManager[Any]]

_NONE = contextlib.nullcontext()


def no_span(job: Job) -> AbstractContextManager[Any]:
    """No span: what every job gets without OpenTelemetry."""
    return _NONE


def _version() -> str:
    """This package's version, from its installed metadata (importing ``pgqueue`` here
    would run back up the imports, from a room below the package's own)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pgqueue")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def job_spans() -> SpanFor:
    """The span maker for the jobs of a worker starting now: ``no_span`` unless
    ``opentelemetry-api`` is installed and a tracer provider has been set."""
    try:
        from opentelemetry import context, trace
    except ImportError:
        return no_span
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return no_span
    tracer = provider.get_tracer("pgqueue", _version())
    consumer, error = trace.SpanKind.CONSUMER, trace.StatusCode.ERROR

    class JobSpan:
        """The span of one handler run, current in this thread or task while it runs."""

        __slots__ = ("job", "span", "token")

        def __init__(self, job: Job) -> None:
            self.job = job

        def __enter__(self) -> Any:
            job = self.job
            self.span = tracer.start_span(
                f"process {job.queue}",
                kind=consumer,
                attributes={
                    "messaging.system": "pgqueue",
                    "messaging.destination.name": job.queue,
                    "messaging.message.id": str(job.id),
                    "messaging.operation.type": "process",
                    "messaging.operation.name": "process",
                    "pgqueue.job.attempt": job.attempts,
                    "pgqueue.job.max_attempts": job.max_attempts,
                    "pgqueue.job.fence": job.fence,
                },
            )
            self.token = context.attach(trace.set_span_in_context(self.span))
            return self.span

        def __exit__(
            self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
        ) -> None:
            span = self.span
            try:
                if exc is not None:  # BaseException too: a cancelled (timed-out) handler
                    span.record_exception(exc)
                    span.set_status(trace.Status(error, f"{type(exc).__name__}: {exc}"))
                    span.set_attribute("error.type", type(exc).__qualname__)
            finally:
                context.detach(self.token)
                span.end()

    return JobSpan
