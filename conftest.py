"""Session setup shared by tests/ and the notebooks checked by nbval.

Without PGQUEUE_DSN, notebook kernels (which inherit this environment) start the embedded
server; point them at a throwaway PGQUEUE_HOME so a test run never touches the user's own
server, and stop that server when the run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_home: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _home
    if os.environ.get("PGQUEUE_DSN") or os.environ.get("PGQUEUE_HOME"):
        return
    _home = Path(tempfile.mkdtemp(prefix="pgqueue-home-"))
    os.environ["PGQUEUE_HOME"] = str(_home)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _home is None:
        return
    from pgqueue.server import EmbeddedServer

    EmbeddedServer(_home).stop()
    os.environ.pop("PGQUEUE_HOME", None)
    shutil.rmtree(_home, ignore_errors=True)
