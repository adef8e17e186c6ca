"""``pgqueue dashboard``: serve the web dashboard with uvicorn.

Closed by default: it listens on 127.0.0.1 (``--host`` to change that), answers only the
loopback Host names there (a page of another site cannot reach it by renaming itself:
DNS rebinding), and its actions need a token, generated with ``secrets`` and printed at
start unless ``--token`` or ``PGQUEUE_DASHBOARD_TOKEN`` gives one. The socket is bound
here, before uvicorn starts, so a port in use is one line and ``--port 0`` prints the
port it got.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
from collections.abc import Sequence

from ...db import describe_dsn, resolve_dsn
from ...errors import BadInput, PgQueueError
from ...queue import Queue
from . import TOKEN_ENV, app, needs_framework
from .guard import new_token

LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pgqueue dashboard",
        description="Serve the web dashboard: queues, running jobs' leases and fences, jobs "
        "with filters and bulk actions, schedules and limits (docs/dashboard.md).",
    )
    p.add_argument("--dsn", help="libpq connection string or URL (default: as every command)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: only here)"
    )
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free)")
    p.add_argument(
        "--token",
        help=f"what actions must send as Authorization: Bearer (default: ${TOKEN_ENV}, else "
        "a new one, printed)",
    )
    p.add_argument("--read-only", action="store_true", help="the views alone: no action")
    p.add_argument(
        "--hide-payload",
        action="store_true",
        help="never send payloads, results or step outputs to the browser",
    )
    p.add_argument(
        "--statement-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="the longest any statement of a page may run (default 5)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host header to answer (repeat; '*': any). Default: the loopback names when "
        "listening on loopback, else any",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return serve(args)
    except BadInput as exc:
        print(f"pgqueue dashboard: {exc}", file=sys.stderr)
        return 2
    except PgQueueError as exc:  # no server there, no jobs table
        print(f"pgqueue dashboard: {exc}", file=sys.stderr)
        return 1


def serve(args: argparse.Namespace) -> int:
    needs_framework()
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port must be from 0 to 65535, got {args.port}")
    token = None
    if not args.read_only:
        token = args.token or os.environ.get(TOKEN_ENV) or new_token()
    # The database first: a bad DSN or a missing table is one line now, not a page later.
    dsn = resolve_dsn(args.dsn)
    with Queue(dsn, application_name="pgqueue dashboard") as queue:
        queue.check()
    loopback = _is_loopback(args.host)
    hosts = args.allowed_host or (LOOPBACK_NAMES if loopback else None)
    if hosts and "*" in hosts:
        hosts = None
    asgi = app(
        dsn,
        token=token,
        read_only=args.read_only,
        hide_payload=args.hide_payload,
        statement_timeout=args.statement_timeout,
        hosts=hosts,
    )
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    print(f"pgqueue dashboard: {describe_dsn(args.dsn)}", file=sys.stderr)
    if token is None:
        print(f"pgqueue dashboard: {url} (read-only: no action)", flush=True)
    else:
        given = "given" if args.token or os.environ.get(TOKEN_ENV) else "new"
        print(f"pgqueue dashboard: {url}#token={token}", flush=True)
        print(f"  actions need the token ({given}): Authorization: Bearer {token}", flush=True)
    if not loopback:
        print(
            f"pgqueue dashboard: listening on {args.host}: anyone who reaches it sees the "
            "views (actions still need the token); put it behind a proxy that authenticates, "
            "or add --hide-payload",
            file=sys.stderr,
        )
    config = uvicorn.Config(
        asgi,
        log_level="warning",
        timeout_graceful_shutdown=3,
        server_header=False,
        proxy_headers=False,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port``; a one-line ``BadInput`` if it cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: uvicorn writes a response's head and body
        # apart, and with Nagle's algorithm the body waited for the client's delayed ACK
        # (40 ms on Linux: every request took 44 ms, measured with the bench).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise BadInput(f"port {port} is in use: choose another with --port") from None
        raise BadInput(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock
