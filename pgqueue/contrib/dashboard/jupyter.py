"""The dashboard as a JupyterLab launcher tile, through ``jupyter-server-proxy``.

pyproject.toml names ``server`` under the entry point group ``jupyter_serverproxy_servers``:
where jupyter-server-proxy is installed (the Binder image), the Jupyter server calls it once
at start and shows a "pgqueue dashboard" tile. A click starts ``pgqueue dashboard`` on a
free port of 127.0.0.1 (``{port}``, filled in by the proxy) and opens
``<lab base>/pgqueue-dashboard/`` in a new tab, through the Jupyter server, which lets in
only its own signed-in user. The token is made here, handed to the process in its
environment (not on its command line, which every local user can read), and to the page in
the tile's address fragment, so the learner's clicks are actions without typing a token.

The dashboard answers any Host header here (``--allowed-host '*'``): the proxy passes on
the browser's, which the dashboard cannot know in advance. It reads the database that
``pgqueue`` finds by itself (the embedded server's); a lesson that works in a database of
its own starts one on it instead (``background.Background``).
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

from . import TOKEN_ENV
from .guard import new_token

NAME = "pgqueue-dashboard"  # the entry point's name: the proxied path


def server() -> dict[str, Any]:
    """jupyter-server-proxy's settings for the dashboard (its ``ServerProcess`` fields)."""
    token = new_token()
    icon = resources.files(__package__).joinpath("static/icon.svg")
    return {
        "command": [
            sys.executable,
            "-m",
            "pgqueue",
            "dashboard",
            "--port",
            "{port}",
            "--allowed-host",
            "*",
        ],
        "environment": {TOKEN_ENV: token},
        "timeout": 60,  # the first start may start the embedded server too
        "absolute_url": False,  # the dashboard sees /, its links are relative
        "new_browser_tab": True,
        "launcher_entry": {
            "enabled": True,
            "title": "pgqueue dashboard",
            "path_info": f"{NAME}/#token={token}",
            "icon_path": str(icon),
        },
    }
