"""The dashboard on a thread of this process: for a notebook (one lesson's own database)
and for the benchmark. ``pgqueue dashboard`` is the way to serve it otherwise.

>>> from pgqueue.contrib.dashboard.background import Background
>>> dash = Background(dsn).start()   # in a notebook, shows a link to the dashboard
>>> dash.stop()

It listens on 127.0.0.1 only, on a free port unless told one. In JupyterLab with
``jupyter-server-proxy`` (the Binder image has it) the link goes through the Jupyter
server, ``proxy/<port>/``, which the browser can reach where 127.0.0.1 is not its own
machine (Binder); the page's links are relative, so it works under that path as is.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from html import escape

from . import app
from .guard import new_token


class Background:
    """A dashboard served by uvicorn on a daemon thread (``start``/``stop``, or ``with``)."""

    def __init__(
        self,
        dsn: str | None = None,
        *,
        port: int = 0,
        token: str | None = None,
        read_only: bool = False,
        hide_payload: bool = False,
        statement_timeout: float = 5.0,
    ) -> None:
        self.token = None if read_only else token or new_token()
        self.asgi = app(
            dsn,
            token=self.token,
            read_only=read_only,
            hide_payload=hide_payload,
            statement_timeout=statement_timeout,
        )
        self.port = port
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self, timeout: float = 30.0) -> Background:
        """Listen (on 127.0.0.1) and serve on a thread; return once it answers."""
        import uvicorn

        from .cli import listen

        sock = listen("127.0.0.1", self.port)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(self.asgi, log_level="warning", timeout_graceful_shutdown=2)
        )
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="pgqueue-dashboard"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not start: see the log above")
            time.sleep(0.01)
        self._sock = sock  # uvicorn serves on this very socket: closed after it stops
        return self

    def stop(self) -> None:
        """Stop serving (open pages' event streams end with it)."""
        if self._server is not None:
            self._server.should_exit = True  # type: ignore[attr-defined]
        if self._thread is not None:
            self._thread.join(10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    def __enter__(self) -> Background:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Its address here, with the token in the fragment (never sent to a server)."""
        return f"http://127.0.0.1:{self.port}/" + (f"#token={self.token}" if self.token else "")

    @property
    def proxy_path(self) -> str:
        """Its path through jupyter-server-proxy, relative to JupyterLab's base URL."""
        return f"proxy/{self.port}/" + (f"#token={self.token}" if self.token else "")

    def _repr_html_(self) -> str:
        href = self.url
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX")  # set by JupyterHub and Binder
        if prefix and _has_proxy():  # 127.0.0.1 is not the browser's machine there
            href = prefix.rstrip("/") + "/" + self.proxy_path
        return (
            f'<p>pgqueue dashboard on port {self.port}: <a href="{escape(href)}" '
            'target="_blank" rel="noopener">open it</a></p>'
        )

    def __repr__(self) -> str:
        return f"<pgqueue dashboard {self.url}>"


def _has_proxy() -> bool:
    try:
        import jupyter_server_proxy  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    """A free loopback port (for tests)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
