"""The layout keeps its promise: ``import pgqueue`` loads only the core."""

from __future__ import annotations

import subprocess
import sys


def test_import_pgqueue_loads_no_course_tool_or_plotting_module() -> None:
    code = "import pgqueue, sys; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    unwanted = [
        m
        for m in loaded
        if m.startswith(("pgqueue.course", "pgqueue.tools", "matplotlib", "pandas", "ipywidgets"))
    ]
    assert unwanted == []
    assert "pgqueue.worker" in loaded and "pgqueue.queue" in loaded
