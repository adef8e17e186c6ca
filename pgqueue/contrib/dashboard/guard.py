"""Who may change anything: the dashboard is closed by default.

A POST (every action) is refused, in this order: by a read-only dashboard (403); when the
browser says it comes from another site (``Sec-Fetch-Site``, sent by every current browser,
or else an ``Origin`` that is not this one: 403); without ``Authorization: Bearer <token>``
(401). The token travels in a header, never in a cookie, so a page of another site cannot
make the browser send it, and a request that carries it is not a simple request another
site may send without asking (CORS preflight, which the dashboard never grants). The page
keeps the token in ``sessionStorage``, from the ``#token=`` fragment of the address printed
at start (a fragment never reaches a server or its logs) or typed in.
"""

from __future__ import annotations

import secrets

from starlette.requests import Request

from .filters import Refused

SAME_SITE = ("same-origin", "none")  # "none": typed in the address bar, or not a browser


def new_token() -> str:
    """A token for a dashboard started without one (printed at start)."""
    return secrets.token_urlsafe(24)


def check_action(request: Request, token: str, read_only: bool) -> None:
    """Refuse a POST that may not change anything (see the module's docstring)."""
    if read_only:
        raise Refused(403, "this dashboard is read-only (--read-only): it changes nothing")
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    if site is not None and site not in SAME_SITE:
        raise Refused(403, f"a {site} request is refused: act from the dashboard's own page")
    if site is None and origin is not None and origin != _own_origin(request):
        raise Refused(403, f"a request from {origin[:100]} is refused: act from the dashboard")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise Refused(
            401,
            "actions need the dashboard's token: send Authorization: Bearer <token> "
            "(printed when the dashboard started, or --token / PGQUEUE_DASHBOARD_TOKEN)",
        )


def _own_origin(request: Request) -> str:
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}"
