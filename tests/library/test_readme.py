"""The README and docs/ stay true: their Python snippets run as written against a real
server, every test they name as evidence exists, and every link reaches a file (and a
heading, for links with #anchor)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


# ```python blocks run; ```py blocks are illustrations (a Django settings file, say).
SNIPPETS = [
    (f"{_name(page)}#{i}", code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", _text(page), flags=re.DOTALL))
]
EVIDENCE = [
    (name, page, target)
    for page in PAGES
    for name, target in re.findall(r"\[`(test_\w+)`\]\(((?:\.\./)?tests/[\w/]+\.py)\)", _text(page))
]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", _text(page), flags=re.DOTALL)  # not a code comment's "#"
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", body, flags=re.MULTILINE)}


def test_the_pages_have_snippets_and_evidence() -> None:
    assert len(PAGES) >= 8, "README.md and the docs/ pages it links"
    assert len(SNIPPETS) >= 8 and len(EVIDENCE) >= 30


def test_the_readme_fits_on_a_few_screens() -> None:
    assert _text(ROOT / "README.md").count("\n") <= 140, "the reference belongs in docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = _text(ROOT / "README.md")
    unlinked = [_name(p) for p in PAGES[1:] if f"]({_name(p)}" not in readme]
    assert unlinked == []


@pytest.mark.parametrize("where,code", SNIPPETS, ids=[where for where, _ in SNIPPETS])
def test_each_python_snippet_runs_as_written(
    where: str, code: str, dsn: str, tmp_path: Path
) -> None:
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


@pytest.mark.parametrize(
    "name,page,target", EVIDENCE, ids=[f"{_name(p)}:{n}" for n, p, _ in EVIDENCE]
)
def test_every_test_named_as_evidence_exists(name: str, page: Path, target: str) -> None:
    source = (page.parent / target).read_text(encoding="utf-8")
    assert re.search(rf"^(async )?def {name}\(", source, flags=re.MULTILINE), (
        f"{_name(page)} names {name} in {target}, which has no such test"
    )


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_every_link_reaches_its_file_and_heading(page: Path) -> None:
    body = re.sub(r"```.*?```", "", _text(page), flags=re.DOTALL)
    links = re.findall(r"\]\(((?!https?://|mailto:)[^)\s]+)\)", body)
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (
            anchor and target.suffix == ".md" and anchor not in _anchors(target)
        ):
            broken.append(link)
    assert broken == []
