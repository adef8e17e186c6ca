"""A web dashboard for pgqueue: queues, running jobs as lease bars with their fence, the
jobs list with filters and bulk actions, one job's payload, result and durable steps,
periodic schedules and per-group limits (docs/dashboard.md).

``pgqueue dashboard`` serves it (on 127.0.0.1; actions need the token it prints), or mount
the ASGI app in an application of yours::

    from pgqueue.contrib.dashboard import app
    dashboard = app(dsn="postgresql://...", token=os.environ["PGQUEUE_DASHBOARD_TOKEN"])

Starlette and psycopg_pool (``pip install -e ".[dashboard]"`` in the clone) are imported only when a
dashboard is made: ``import pgqueue`` never imports them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...errors import BadInput

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["app"]

TOKEN_ENV = "PGQUEUE_DASHBOARD_TOKEN"


def app(
    dsn: str | None = None,
    *,
    token: str | None = None,
    read_only: bool = False,
    hide_payload: bool = False,
    statement_timeout: float = 5.0,
    hosts: list[str] | None = None,
) -> Starlette:
    """The dashboard as an ASGI app (Starlette), on ``dsn`` (None: as ``pgqueue.Queue``
    finds it). ``token``: what every action must send as ``Authorization: Bearer <token>``
    (None: ``$PGQUEUE_DASHBOARD_TOKEN``; required unless ``read_only``). ``read_only``:
    the views alone, every action refused. ``hide_payload``: payloads, results and step
    outputs are never sent to the browser. ``statement_timeout``: seconds any statement of
    a request may run. ``hosts``: the Host headers answered (None: any; the command line
    gives its loopback names, against DNS rebinding)."""
    needs_framework()
    from .routes import Dashboard, build

    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if token is None and not read_only:
        raise BadInput(
            f"the dashboard's actions need a token: pass token=... (or set {TOKEN_ENV}), "
            "or read_only=True for the views alone"
        )
    if not isinstance(statement_timeout, int | float) or not 0.01 <= statement_timeout <= 3600:
        raise BadInput(f"statement_timeout is seconds from 0.01 to 3600, got {statement_timeout!r}")
    try:
        dashboard = Dashboard(
            dsn,
            token or "",
            read_only=read_only,
            hide_payload=hide_payload,
            statement_timeout_ms=max(10, round(statement_timeout * 1000)),
        )
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return build(dashboard, hosts=hosts)


def needs_framework() -> None:
    """A one-line ``BadInput`` unless the dashboard's packages can be imported."""
    try:
        import psycopg_pool  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        raise BadInput(
            "the dashboard needs starlette, uvicorn and psycopg-pool: pip install starlette "
            'uvicorn psycopg-pool (or pip install -e ".[dashboard]" in your pgqueue clone)'
        ) from None
