"""The README stays true: its Python snippets run as written against a real server, and
every test it names as evidence exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
EVIDENCE = re.findall(r"\[`(test_\w+)`\]\((tests/[\w/]+\.py)\)", README)


def test_the_readme_has_snippets_and_evidence() -> None:
    assert len(SNIPPETS) >= 3 and len(EVIDENCE) >= 10


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_each_python_snippet_runs_as_written(code: str, dsn: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"PGQUEUE_DSN": dsn}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("name,path", EVIDENCE, ids=[name for name, _ in EVIDENCE])
def test_every_test_the_readme_names_exists(name: str, path: str) -> None:
    source = (ROOT / path).read_text(encoding="utf-8")
    assert re.search(rf"^(async )?def {name}\(", source, flags=re.MULTILINE), (
        f"README names {name} in {path}, which has no such test"
    )


def test_every_file_the_readme_links_exists() -> None:
    links = re.findall(r"\]\(((?!https?://|#)[^)\s]+)\)", README)
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert missing == []
