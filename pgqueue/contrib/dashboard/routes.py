"""The dashboard's routes: three pages, their live fragments, and the JSON API the pages
use for every action (docs/dashboard.md lists it). Starlette is imported here only, so
only a dashboard imports it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import actions, filters, live, pages
from .filters import Refused
from .guard import check_action
from .store import Store

STATEMENT_TIMEOUT_MS = 5000  # the longest any statement of a page may run
# What the pages may load: their own script and style sheet, nothing inline, never framed
# by another site; no referrer, so no address of the dashboard leaves with a link.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'self'; form-action 'self'; base-uri 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class Dashboard:
    """One dashboard: its settings, its store (the connections) and its listener."""

    def __init__(
        self,
        dsn: str | None,
        token: str,
        *,
        read_only: bool,
        hide_payload: bool,
        statement_timeout_ms: int,
    ) -> None:
        if not read_only and (not isinstance(token, str) or len(token) < 8):
            raise ValueError(
                "the dashboard's token must be a text of at least 8 characters (or read_only=True)"
            )
        self.token = token
        self.read_only = read_only
        self.hide_payload = hide_payload
        self.store = Store(dsn, timeout_ms=statement_timeout_ms, hide_payload=hide_payload)
        self.listener = live.Listener(self.store)

    # -- pages ------------------------------------------------------------------------
    def _page(
        self,
        request: Request,
        title: str,
        body: str,
        live_at: str | None = None,
        head: str = "",
    ) -> Response:
        # Relative to this page (./ or ../), so links work under any path a proxy
        # serves it from (Jupyter's /proxy/PORT/, a mount), with nothing to configure.
        depth = request.scope["path"].strip("/").count("/")
        base = "../" * depth if depth else "./"
        html = pages.page(title, body, base=base, read_only=self.read_only, live=live_at, head=head)
        return HTMLResponse(html)

    async def overview_page(self, request: Request) -> Response:
        body = pages.overview(await self.store.overview(), self.read_only)
        return self._page(request, "Overview", body, "fragment/overview")

    async def overview_fragment(self, request: Request) -> Response:
        return HTMLResponse(pages.overview(await self.store.overview(), self.read_only))

    async def jobs_page(self, request: Request) -> Response:
        chosen, found, more = await self._jobs(request)
        await self.store.look()
        known = sorted(self.store.looks.kept[-1].queues) if self.store.looks.kept else []
        head = pages.jobs_head(chosen, known, self.read_only)
        live_at = f"fragment/jobs?{request.url.query}" if request.url.query else "fragment/jobs"
        return self._page(request, "Jobs", pages.jobs(chosen, found, more), live_at, head)

    async def jobs_fragment(self, request: Request) -> Response:
        chosen, found, more = await self._jobs(request)
        return HTMLResponse(pages.jobs(chosen, found, more))

    async def job_page(self, request: Request) -> Response:
        job = await self.store.job(filters.job_id(request.path_params["id"]))
        body = pages.job(job, self.read_only, self.hide_payload)
        return self._page(request, f"Job {job['id']}", body, f"fragment/jobs/{job['id']}")

    async def job_fragment(self, request: Request) -> Response:
        job = await self.store.job(filters.job_id(request.path_params["id"]))
        return HTMLResponse(pages.job(job, self.read_only, self.hide_payload))

    # -- the JSON API -----------------------------------------------------------------
    async def api_overview(self, request: Request) -> Response:
        return JSONResponse(await self.store.overview())

    async def api_queues(self, request: Request) -> Response:
        exact = request.query_params.get("exact", "") in ("1", "true", "yes")
        return JSONResponse(await self.store.queues(exact=exact))

    async def api_jobs(self, request: Request) -> Response:
        chosen, found, more = await self._jobs(request)
        after = found[-1]["id"] if more and found else None
        return JSONResponse({"filter": chosen.query(), "jobs": found, "next_before": after})

    async def api_job(self, request: Request) -> Response:
        return JSONResponse(await self.store.job(filters.job_id(request.path_params["id"])))

    async def api_action(self, request: Request) -> Response:
        check_action(request, self.token, self.read_only)
        name = request.path_params["action"]
        filters.action(name)
        job_id = filters.job_id(request.path_params["id"])
        done = await actions.one(self.store, name, job_id, _who(request))
        return JSONResponse(done | {"message": f"job {job_id}: {name} done, now {done['status']}"})

    async def api_bulk(self, request: Request) -> Response:
        check_action(request, self.token, self.read_only)
        name = request.path_params["action"]
        filters.action(name)
        chosen = filters.jobs_filter(dict(request.query_params))
        done = await actions.bulk(self.store, name, chosen, _who(request))
        said = f"{name}: {done['changed']} job(s) changed"
        if done["skipped"]:
            said += f", {len(done['skipped'])} left dead (their key is held)"
        return JSONResponse(done | {"message": said})

    async def api_queue_action(self, request: Request) -> Response:
        check_action(request, self.token, self.read_only)
        name = request.path_params["action"]
        if name not in ("pause", "resume"):
            raise Refused(404, f"no queue action {name!r}: pause or resume")
        queue = filters.queue_name(request.path_params["name"])
        done = await actions.queue_action(self.store, name, queue, _who(request))
        said = f"queue {queue}: " + (
            "paused: no worker claims from it" if done["paused"] else "resumed"
        )
        return JSONResponse(done | {"message": said})

    async def api_run_schedule(self, request: Request) -> Response:
        check_action(request, self.token, self.read_only)
        done = await actions.run_schedule(self.store, request.path_params["name"], _who(request))
        said = f"schedule {done['schedule']}: job {done['id']} made for slot {done['slot']}"
        return JSONResponse(done | {"message": said})

    async def api_events(self, request: Request) -> Response:
        return StreamingResponse(
            live.stream(self.listener),
            media_type="text/event-stream",
            headers={"X-Accel-Buffering": "no"},
        )

    async def _jobs(self, request: Request) -> tuple[filters.Filter, list[dict[str, Any]], bool]:
        args = dict(request.query_params)
        chosen = filters.jobs_filter(args)
        before, size = filters.page(args)
        found = await self.store.jobs(chosen, before, size + 1)  # one more: is there a next?
        if (
            not found
            and chosen.queue is not None
            and not await self.store.known_queue(chosen.queue)
        ):
            raise Refused(404, f"no job has queue {chosen.queue!r}: check its name")
        return chosen, found[:size], len(found) > size

    # -- errors -----------------------------------------------------------------------
    async def refused(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, Refused):
            status, message = exc.status, exc.message
        elif isinstance(exc, PoolTimeout | psycopg.OperationalError):
            status = 503
            message = "the database cannot be reached now: check that it runs, then reload"
        else:
            raise exc
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if request.scope["path"].startswith("/api/") or "/api/" in request.url.path:
            return JSONResponse({"error": message}, status, headers=headers)
        return self._page_error(request, status, message)

    def _page_error(self, request: Request, status: int, message: str) -> Response:
        response = self._page(request, str(status), pages.error(status, message))
        response.status_code = status
        return response

    async def close(self) -> None:
        await self.listener.stop()
        await self.store.close()


class _Headers:
    """Adds ``HEADERS`` to every response (a plain ASGI middleware: it leaves the event
    stream's body alone)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    if name not in headers:
                        headers[name] = value
            await send(message)

        await self.app(scope, receive, sending)


def _who(request: Request) -> str:
    return request.client.host if request.client else "someone"


def build(dashboard: Dashboard, *, hosts: list[str] | None = None) -> Starlette:
    """The ASGI app of ``dashboard``; ``hosts``: the Host headers it answers (None: any)."""
    d = dashboard

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await d.close()

    middleware = [Middleware(_Headers)]
    if hosts:
        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=hosts))
    routes = [
        Route("/", d.overview_page),
        Route("/fragment/overview", d.overview_fragment),
        Route("/jobs", d.jobs_page),
        Route("/jobs/{id}", d.job_page),
        Route("/fragment/jobs", d.jobs_fragment),
        Route("/fragment/jobs/{id}", d.job_fragment),
        Route("/api/overview", d.api_overview),
        Route("/api/queues", d.api_queues),
        Route("/api/jobs", d.api_jobs),
        Route("/api/jobs/{id}", d.api_job),
        Route("/api/jobs/{id}/{action}", d.api_action, methods=["POST"]),
        Route("/api/bulk/{action}", d.api_bulk, methods=["POST"]),
        Route("/api/schedules/{name}/run", d.api_run_schedule, methods=["POST"]),
        Route("/api/queues/{name}/{action}", d.api_queue_action, methods=["POST"]),
        Route("/api/events", d.api_events),
        Mount("/static", StaticFiles(packages=[(__package__, "static")]), name="static"),
    ]
    handlers: dict[Any, Any] = {
        Refused: d.refused,
        PoolTimeout: d.refused,
        psycopg.OperationalError: d.refused,
    }
    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan
    )
    app.state.dashboard = d
    return app
