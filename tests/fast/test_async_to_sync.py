"""The sync faces are generated from their async sources (``pgqueue/tools/async_to_sync.py``)
and cannot drift: the converter on small pieces, and the committed files as it makes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "pgqueue" / "tools" / "async_to_sync.py"
sys.path.insert(0, str(TOOL.parent))
import async_to_sync  # noqa: E402


def body(text: str) -> str:
    """The converted text without the generated-file header."""
    return async_to_sync.convert(text, "x.py").split("\n", 2)[2]


def test_async_and_await_go_and_names_are_swapped_comments_kept() -> None:
    source = (
        '"""Kept as written: AsyncJob stays here."""\n'
        "async def f(conn: AsyncConnection) -> None:\n"
        "    # await the AsyncJob's write\n"
        "    async with conn.transaction():\n"
        "        await async_fenced_write(conn)\n"
        '    """await job.step(...), with AsyncJob"""\n'
    )
    assert body(source) == (
        '"""Kept as written: AsyncJob stays here."""\n'
        "def f(conn: Connection) -> None:\n"
        "    # the Job's write\n"
        "    with conn.transaction():\n"
        "        fenced_write(conn)\n"
        '    """job.step(...), with Job"""\n'
    )


def test_the_line_markers_leave_out_and_put_in_lines() -> None:
    source = (
        "import inspect  # async-only\n    # sync: x = 1\nx = await y  # async-only\nawaited = 2\n"
    )
    assert body(source) == "    x = 1\nawaited = 2\n"  # a name that starts with await stays


def test_the_committed_sync_files_are_what_their_sources_make() -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--check"], capture_output=True, text=True, check=False
    )
    if "ruff is not installed" in done.stderr:
        pytest.skip("ruff is not installed here")
    assert done.returncode == 0, done.stderr
